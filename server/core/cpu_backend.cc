// CpuBackend: append by row conversion into pages; attention per (span, kv head, query
// block) with the block's K/V gathered once into float32 and shared by the GQA group.
#include "server/core/cpu_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/core/cache.h"
#include "server/core/host_memory.h"

namespace pagedattn {
namespace {

// Queries per work item: large enough that gathering K/V is cheap relative to the math.
constexpr int kQueryBlock = 64;
// A pool's pages are faulted in this many bytes at a time, the stop token read in between.
constexpr size_t kPopulateChunk = size_t{64} << 20;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// One anonymous private mapping (zero-filled by the kernel): K of every layer, then V, then (an
// FP8 cache with PER_TOKEN scaling) the rows' scales of K, then of V, [layer][page][kv head][row].
class CpuPool final : public KvPool {
 public:
  CpuPool(char* base, size_t bytes, size_t elem_bytes)
      : base_(base), bytes_(bytes), elem_bytes_(elem_bytes) {}
  ~CpuPool() override { munmap(base_, bytes_); }
  char* k() const { return base_; }
  char* v() const { return base_ + elem_bytes_; }
  float* k_scales() const { return reinterpret_cast<float*>(base_ + 2 * elem_bytes_); }
  float* v_scales() const { return k_scales() + (bytes_ - 2 * elem_bytes_) / 2 / sizeof(float); }

 private:
  char* base_;
  size_t bytes_;
  size_t elem_bytes_;  // of K (or V), every layer
};

// Where one layer's K and V lie in the pool, and how its stored values read back as floats:
// FP8 values times their row's scale (PER_TOKEN) or the layer's (STATIC); others as they are.
struct LayerStore {
  char* k;
  char* v;
  float* k_scales = nullptr;  // PER_TOKEN: per row (element offset / head_dim)
  float* v_scales = nullptr;
  float k_static = 1.f;
  float v_static = 1.f;

  LayerStore(const CpuPool& pool, const CacheGeometry& g, int layer) {
    const int64_t layer_elems = g.num_pages * g.PageElems();
    k = pool.k() + layer * layer_elems * DTypeSize(g.kv_dtype);
    v = pool.v() + layer * layer_elems * DTypeSize(g.kv_dtype);
    if (g.kv_scaling == KvScaling::kPerToken) {
      k_scales = pool.k_scales() + layer * (layer_elems / g.head_dim);
      v_scales = pool.v_scales() + layer * (layer_elems / g.head_dim);
    } else if (g.kv_scaling == KvScaling::kStatic) {
      k_static = g.kv_scales[2 * static_cast<size_t>(layer)];
      v_static = g.kv_scales[2 * static_cast<size_t>(layer) + 1];
    }
  }
  float k_scale(int64_t row) const { return k_scales != nullptr ? k_scales[row] : k_static; }
  float v_scale(int64_t row) const { return v_scales != nullptr ? v_scales[row] : v_static; }
};

// Stores one row of n values (src, in dtype `from`, as AttentionValue gives them) as FP8 at dst:
// scaled by the row's own scale (row_scale non-null: PER_TOKEN, written there) or by
// static_scale.
void StoreFp8Row(DType from, const void* src, int n, float static_scale, float* row_scale,
                 uint8_t* dst) {
  static_assert(kCpuHeadDims.back() <= 512, "a row fits the buffer below");
  float x[512];
  float max_abs = 0.f;
  for (int i = 0; i < n; ++i) {
    x[i] = AttentionValue(LoadAsFloat(from, src, i));
    max_abs = std::max(max_abs, std::fabs(x[i]));
  }
  const Fp8RowScale s =
      row_scale != nullptr ? Fp8RowScale::OfMax(max_abs) : Fp8RowScale::Static(static_scale);
  if (row_scale != nullptr) *row_scale = s.scale;
  for (int i = 0; i < n; ++i) dst[i] = FloatToE4m3(x[i] * s.inverse);
}

struct WorkItem {
  int32_t span;
  int32_t kv_head;
  int32_t q_begin;  // Query index within the span.
  int32_t q_end;
};

// Faults in [base, base + bytes) so that a pool that does not fit fails now rather than
// mid-Forward. MADV_POPULATE_WRITE where the kernel has it, else a write to each page.
absl::Status Populate(char* base, size_t bytes, const StopToken& stop) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  bool madvise_works = true;
  for (size_t at = 0; at < bytes; at += kPopulateChunk) {
    if (absl::Status s = stop.Check(); !s.ok()) return s;
    const size_t n = std::min(kPopulateChunk, bytes - at);
    if (madvise_works && madvise(base + at, n, MADV_POPULATE_WRITE) == 0) continue;
    if (madvise_works && errno == ENOMEM) {
      return absl::ResourceExhaustedError(
          absl::StrCat("could not fault in ", bytes, " bytes of host memory for the pool"));
    }
    madvise_works = false;
    for (size_t p = 0; p < n; p += page) base[at + p] = 0;
  }
  return absl::OkStatus();
}

// A score that stays finite whatever q, k and sm_scale are: an overflowing dot product or
// scale saturates (and a NaN one, from inf - inf, counts as -FLT_MAX), so the softmax below
// never computes inf - inf and a row never comes out NaN from finite inputs.
float SaturatedScore(float s) {
  return std::fmin(std::fmax(s, -std::numeric_limits<float>::max()),
                   std::numeric_limits<float>::max());
}

// Element offset of (position, kv head) of a span within a layer's K or V pool.
int64_t RowOffset(const CacheGeometry& g, const ForwardPlan& plan, const SpanPlan& sp, int64_t pos,
                  int kvh) {
  const int64_t page = plan.page_table[sp.page_table_offset + pos / g.page_size];
  return (page * g.num_kv_heads + kvh) * g.page_size * g.head_dim +
         (pos % g.page_size) * g.head_dim;
}

// The committed rows a Forward overwrites (rewinds), saved before it writes so that a Forward
// that is stopped can put them back.
class OverwrittenRows {
 public:
  OverwrittenRows(const CacheGeometry& g, const ForwardPlan& plan, const LayerStore& store)
      : g_(g), plan_(plan), store_(store) {}

  // Throws std::bad_alloc where the rows' copy cannot be had: nothing is overwritten yet then.
  void Save() {
    Move(/*save=*/true);
    saved_all_ = true;
  }
  // Puts back what Save kept; nothing where Save did not finish (nothing was written then).
  void Restore() {
    if (saved_all_) Move(/*save=*/false);
  }

 private:
  void Move(bool save) {
    const size_t row_bytes = static_cast<size_t>(g_.head_dim) * DTypeSize(g_.kv_dtype);
    size_t at = 0;
    auto move = [&](void* place, size_t n) {
      if (save) {
        saved_.resize(at + n);
        std::memcpy(saved_.data() + at, place, n);
      } else {
        std::memcpy(place, saved_.data() + at, n);
      }
      at += n;
    };
    for (const SpanPlan& sp : plan_.spans) {
      for (int64_t pos = sp.start; pos < sp.overwrite_end(); ++pos) {
        for (int kvh = 0; kvh < g_.num_kv_heads; ++kvh) {
          const int64_t elem = RowOffset(g_, plan_, sp, pos, kvh);
          const size_t off = static_cast<size_t>(elem) * DTypeSize(g_.kv_dtype);
          for (char* layer : {store_.k, store_.v}) move(layer + off, row_bytes);
          for (float* scales : {store_.k_scales, store_.v_scales}) {
            if (scales != nullptr) move(scales + elem / g_.head_dim, sizeof(float));
          }
        }
      }
    }
  }

  const CacheGeometry& g_;
  const ForwardPlan& plan_;
  const LayerStore& store_;
  std::vector<char> saved_;
  bool saved_all_ = false;
};

}  // namespace

CpuBackend::CpuBackend(const CpuBackendOptions& options)
    : threads_(std::make_unique<ThreadPool>(
          options.num_threads > 0
              ? options.num_threads
              : std::max(1, static_cast<int>(std::thread::hardware_concurrency())))),
      reserved_bytes_(std::max<int64_t>(0, options.reserved_bytes)) {}

std::string CpuBackend::device_name() const {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return absl::StrCat(line.substr(colon + 2), " (", threads_->num_threads(), " threads)");
      }
    }
  }
  return absl::StrCat("cpu (", threads_->num_threads(), " threads)");
}

absl::StatusOr<MemoryInfo> CpuBackend::memory(int device) const {
  if (device != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpu has device 0 only (got ", device, ")"));
  }
  const HostMemoryInfo host = HostMemory();
  return MemoryInfo{host.total_bytes, std::max<int64_t>(0, host.free_bytes - reserved_bytes_)};
}

absl::StatusOr<std::unique_ptr<KvPool>> CpuBackend::AllocatePool(const CacheGeometry& g,
                                                                 const StopToken& stop) {
  const size_t bytes = static_cast<size_t>(g.TotalBytes());
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not map ", bytes, " bytes of host memory for the pool"));
  }
  const size_t elem_bytes =
      static_cast<size_t>(g.num_layers * g.num_pages * g.PageElems() * DTypeSize(g.kv_dtype));
  auto pool = std::make_unique<CpuPool>(static_cast<char*>(base), bytes, elem_bytes);
  if (absl::Status s = Populate(pool->k(), bytes, stop); !s.ok()) return s;
  return pool;
}

namespace {
// 1. and 2. of a Forward (below): its K/V rows stored, its queries answered into io.
void AppendAndAttend(ThreadPool& threads, const CacheGeometry& g, const ForwardPlan& plan,
                     const ForwardIO& io, const LayerStore& store);
}  // namespace

absl::Status CpuBackend::Forward(KvPool& pool_base, const CacheGeometry& g, const ForwardPlan& plan,
                                 const ForwardIO& io_in) {
  auto& pool = static_cast<CpuPool&>(pool_base);
  if (io_in.device_tensors) {
    return absl::FailedPreconditionError("device tensors need the CUDA backend");
  }
  ForwardIO io = io_in;
  if (io.buffers != nullptr) {  // this backend's own (the default heap buffers)
    auto* heap = static_cast<HeapForwardBuffers*>(io.buffers);
    io.out = heap->mutable_out();
    io.lse = plan.return_lse ? heap->mutable_lse() : nullptr;
  }
  const LayerStore store(pool, g, plan.layer);
  if (absl::Status s = plan.stop.Check(); !s.ok()) return s;
  const absl::Time start = absl::Now();

  // 0. A rewind overwrites committed rows: keep them until the Forward is sure to commit.
  OverwrittenRows overwritten(g, plan, store);
  // Memory this Forward cannot have (its working copies below, of up to a sequence's K and V
  // in float an item) is RESOURCE_EXHAUSTED, the overwritten rows put back: never a crash.
  try {
    overwritten.Save();
    AppendAndAttend(*threads_, g, plan, io, store);
  } catch (const std::bad_alloc&) {
    overwritten.Restore();
    return absl::ResourceExhaustedError(
        "the CPU backend could not allocate this Forward's working memory (about 8 x head_dim "
        "bytes a visible position, for each of --cpu_threads items at once): send fewer or "
        "shorter spans, or leave memory beside the caches' pools");
  }
  // 3. Commit point: a stop seen now puts the overwritten rows back (new rows past the
  // committed length are invisible once the cache rolls its lengths back).
  if (absl::Status s = plan.stop.Check(); !s.ok()) {
    overwritten.Restore();
    return s;
  }
  if (io.timings != nullptr) {
    io.timings->kernel_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  }
  return absl::OkStatus();
}

namespace {

void AppendAndAttend(ThreadPool& threads, const CacheGeometry& g, const ForwardPlan& plan,
                     const ForwardIO& io, const LayerStore& store) {
  const int D = g.head_dim;
  const int Hq = g.num_q_heads;
  const int Hkv = g.num_kv_heads;
  const int group = Hq / Hkv;
  const int esize = DTypeSize(g.kv_dtype);
  char* k_layer = store.k;
  char* v_layer = store.v;
  const bool fp8 = g.kv_dtype == DType::kFloat8E4M3;

  // 1. Append: convert each new row to the cache dtype (its values as AttentionValue gives them:
  // NaN as 0, past 2^48 saturated, as the GPU stores them) and store it in its page.
  if (plan.total_new_tokens > 0) {
    threads.ParallelFor(static_cast<int64_t>(plan.spans.size()), [&](int64_t si) {
      const SpanPlan& sp = plan.spans[si];
      const int in_size = DTypeSize(io.kv_dtype);
      for (int32_t t = 0; t < sp.num_new_tokens; ++t) {
        for (int kvh = 0; kvh < Hkv; ++kvh) {
          const int64_t src = ((sp.kv_offset + t) * Hkv + kvh) * D;
          const int64_t dst = RowOffset(g, plan, sp, sp.start + t, kvh);
          const char* k_src = static_cast<const char*>(io.k) + src * in_size;
          const char* v_src = static_cast<const char*>(io.v) + src * in_size;
          if (fp8) {
            const int64_t row = dst / D;
            StoreFp8Row(io.kv_dtype, k_src, D, store.k_static,
                        store.k_scales != nullptr ? store.k_scales + row : nullptr,
                        reinterpret_cast<uint8_t*>(k_layer) + dst);
            StoreFp8Row(io.kv_dtype, v_src, D, store.v_static,
                        store.v_scales != nullptr ? store.v_scales + row : nullptr,
                        reinterpret_cast<uint8_t*>(v_layer) + dst);
            continue;
          }
          StoreAttentionValues(io.kv_dtype, k_src, g.kv_dtype, k_layer + dst * esize, D);
          StoreAttentionValues(io.kv_dtype, v_src, g.kv_dtype, v_layer + dst * esize, D);
        }
      }
    });
  }

  // 2. Attention, one (span, kv head, query block) item at a time per worker; the stop token
  // is read before each item and each of its queries, so a stopped Forward ends within one
  // query's time (an item of 64 queries over 131072 positions took 8 s on two cores: a drain
  // waited for it past its grace).
  std::vector<WorkItem> items;
  for (int32_t si = 0; si < static_cast<int32_t>(plan.spans.size()); ++si) {
    const SpanPlan& sp = plan.spans[si];
    for (int32_t q0 = 0; q0 < sp.num_queries; q0 += kQueryBlock) {
      for (int kvh = 0; kvh < Hkv; ++kvh) {
        items.push_back({si, kvh, q0, std::min(sp.num_queries, q0 + kQueryBlock)});
      }
    }
  }
  std::atomic<bool> stopped{false};  // A worker saw the stop: the others skip their items.
  threads.ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t ii) {
    if (stopped.load(std::memory_order_relaxed)) return;
    if (!plan.stop.Check().ok()) {
      stopped.store(true, std::memory_order_relaxed);
      return;
    }
    const WorkItem& w = items[ii];
    const SpanPlan& sp = plan.spans[w.span];
    const LayerAttention* variant = plan.attention;
    const int64_t window = variant != nullptr ? variant->sliding_window : 0;
    const float softcap = variant != nullptr ? variant->logit_softcap : 0.f;
    const int64_t first_pos = sp.kv_len - sp.num_queries;  // Position of query 0.
    // Positions query qi sees: [lo(qi), hi(qi)); the block's queries together
    // [lo(q_begin), hi(q_end - 1)), loaded once.
    auto lo = [&](int64_t qi) {
      return window > 0 ? std::max<int64_t>(0, first_pos + qi - window + 1) : 0;
    };
    auto hi = [&](int64_t qi) { return plan.causal ? first_pos + qi + 1 : sp.kv_len; };
    const int64_t base = lo(w.q_begin), visible_max = hi(w.q_end - 1);
    std::vector<float> k(static_cast<size_t>(visible_max - base) * D);
    std::vector<float> v(static_cast<size_t>(visible_max - base) * D);
    for (int64_t j = base; j < visible_max; ++j) {
      const int64_t off = RowOffset(g, plan, sp, j, w.kv_head);
      const float k_scale = store.k_scale(off / D), v_scale = store.v_scale(off / D);
      for (int d = 0; d < D; ++d) {
        k[(j - base) * D + d] = LoadAsFloat(g.kv_dtype, k_layer, off + d) * k_scale;
        v[(j - base) * D + d] = LoadAsFloat(g.kv_dtype, v_layer, off + d) * v_scale;
      }
    }
    std::vector<float> q(D), scores(static_cast<size_t>(visible_max - base)), acc(D);
    // A sink is a logit of the row with no value: it joins the max and the denominator.
    const bool sink = variant != nullptr && !variant->sinks.empty();
    for (int32_t qi = w.q_begin; qi < w.q_end; ++qi) {
      if (qi > w.q_begin && (stopped.load(std::memory_order_relaxed) || !plan.stop.Check().ok())) {
        stopped.store(true, std::memory_order_relaxed);
        return;  // the Forward fails at its commit point: what was written is never read
      }
      const int64_t first = lo(qi) - base, visible = hi(qi) - base;
      for (int hg = 0; hg < group; ++hg) {
        const int h = w.kv_head * group + hg;
        const int64_t qrow = (sp.q_offset + qi) * Hq + h;
        for (int d = 0; d < D; ++d) {
          q[d] = AttentionValue(LoadAsFloat(io.q_dtype, io.q, qrow * D + d));
        }
        float m = sink ? variant->sinks[h] : -std::numeric_limits<float>::infinity();
        for (int64_t j = first; j < visible; ++j) {
          const float* kj = &k[j * D];
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += q[d] * kj[d];
          s *= plan.sm_scale;
          if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
          scores[j] = SaturatedScore(s);
          m = std::max(m, scores[j]);
        }
        float denom = sink ? std::exp(variant->sinks[h] - m) : 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = first; j < visible; ++j) {
          const float p = std::exp(scores[j] - m);
          denom += p;
          const float* vj = &v[j * D];
          for (int d = 0; d < D; ++d) acc[d] += p * vj[d];
        }
        const float inv = 1.f / denom;
        for (int d = 0; d < D; ++d) StoreFromFloat(io.q_dtype, io.out, qrow * D + d, acc[d] * inv);
        if (io.lse != nullptr) io.lse[qrow] = m + std::log(denom);
      }
    }
  });
}

}  // namespace

}  // namespace pagedattn
