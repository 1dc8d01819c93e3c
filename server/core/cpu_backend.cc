// CpuBackend: append by row conversion into pages; attention per (span, kv head, query
// block) with the block's K/V gathered once into float32 and shared by the GQA group.
#include "server/core/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace pagedattn {
namespace {

// Queries per work item: large enough that gathering K/V is cheap relative to the math.
constexpr int kQueryBlock = 64;

class CpuPool final : public KvPool {
 public:
  CpuPool(size_t bytes_each) : k(new char[bytes_each]), v(new char[bytes_each]) {}
  std::unique_ptr<char[]> k;
  std::unique_ptr<char[]> v;
};

struct WorkItem {
  int32_t span;
  int32_t kv_head;
  int32_t q_begin;  // Query index within the span.
  int32_t q_end;
};

}  // namespace

MemoryInfo HostMemory() {
  MemoryInfo m;
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t value;
  std::string unit;
  while (in >> key >> value >> unit) {
    if (key == "MemTotal:") m.total_bytes = value * 1024;
    if (key == "MemAvailable:") m.free_bytes = value * 1024;
  }
  if (m.total_bytes == 0) {
    m.total_bytes = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGE_SIZE);
    m.free_bytes = int64_t{sysconf(_SC_AVPHYS_PAGES)} * sysconf(_SC_PAGE_SIZE);
  }
  return m;
}

CpuBackend::CpuBackend(int num_threads)
    : threads_(std::make_unique<ThreadPool>(
          num_threads > 0 ? num_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency())))) {}

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
  if (device != 0)
    return absl::InvalidArgumentError(absl::StrCat("cpu has device 0 only (got ", device, ")"));
  return HostMemory();
}

absl::StatusOr<std::unique_ptr<KvPool>> CpuBackend::AllocatePool(const CacheGeometry& g) {
  const int64_t bytes_each = g.TotalBytes() / 2;
  try {
    auto pool = std::make_unique<CpuPool>(static_cast<size_t>(bytes_each));
    // Touch the memory now so that a pool that does not fit fails here, not mid-Forward,
    // and so MemAvailable reflects it for the next CreateCache.
    std::fill_n(pool->k.get(), bytes_each, 0);
    std::fill_n(pool->v.get(), bytes_each, 0);
    return pool;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not allocate ", 2 * bytes_each, " bytes of host memory for the pool"));
  }
}

absl::Status CpuBackend::Forward(KvPool& pool_base, const CacheGeometry& g, const ForwardPlan& plan,
                                 const ForwardIO& io) {
  auto& pool = static_cast<CpuPool&>(pool_base);
  const int D = g.head_dim;
  const int Hq = g.num_q_heads;
  const int Hkv = g.num_kv_heads;
  const int group = Hq / Hkv;
  const int esize = DTypeSize(g.kv_dtype);
  const int64_t page_elems = g.PageElems();
  const int64_t layer_elems = g.num_pages * page_elems;
  char* k_layer = pool.k.get() + plan.layer * layer_elems * esize;
  char* v_layer = pool.v.get() + plan.layer * layer_elems * esize;

  // Element offset of (position, kv head) of a span within the layer.
  auto row_offset = [&](const SpanPlan& sp, int64_t pos, int kvh) {
    const int64_t page = plan.page_table[sp.page_table_offset + pos / g.page_size];
    return (page * Hkv + kvh) * g.page_size * D + (pos % g.page_size) * D;
  };

  // 1. Append: convert each new row to the cache dtype and store it in its page.
  if (plan.total_new_tokens > 0) {
    threads_->ParallelFor(static_cast<int64_t>(plan.spans.size()), [&](int64_t si) {
      const SpanPlan& sp = plan.spans[si];
      for (int32_t t = 0; t < sp.num_new_tokens; ++t) {
        for (int kvh = 0; kvh < Hkv; ++kvh) {
          const int64_t src = ((sp.kv_offset + t) * Hkv + kvh) * D;
          const int64_t dst = row_offset(sp, sp.start + t, kvh);
          const int in_size = DTypeSize(io.kv_dtype);
          ConvertElements(io.kv_dtype, static_cast<const char*>(io.k) + src * in_size, g.kv_dtype,
                          k_layer + dst * esize, D);
          ConvertElements(io.kv_dtype, static_cast<const char*>(io.v) + src * in_size, g.kv_dtype,
                          v_layer + dst * esize, D);
        }
      }
    });
  }

  // 2. Attention.
  std::vector<WorkItem> items;
  for (int32_t si = 0; si < static_cast<int32_t>(plan.spans.size()); ++si) {
    const SpanPlan& sp = plan.spans[si];
    for (int32_t q0 = 0; q0 < sp.num_queries; q0 += kQueryBlock) {
      for (int kvh = 0; kvh < Hkv; ++kvh) {
        items.push_back({si, kvh, q0, std::min(sp.num_queries, q0 + kQueryBlock)});
      }
    }
  }
  threads_->ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t ii) {
    const WorkItem& w = items[ii];
    const SpanPlan& sp = plan.spans[w.span];
    const int64_t first_pos = sp.kv_len - sp.num_queries;  // Position of query 0.
    // Positions any query of the block can see.
    const int64_t visible_max = plan.causal ? first_pos + w.q_end : sp.kv_len;
    std::vector<float> k(static_cast<size_t>(visible_max) * D);
    std::vector<float> v(static_cast<size_t>(visible_max) * D);
    for (int64_t j = 0; j < visible_max; ++j) {
      const int64_t off = row_offset(sp, j, w.kv_head);
      for (int d = 0; d < D; ++d) {
        k[j * D + d] = LoadAsFloat(g.kv_dtype, k_layer, off + d);
        v[j * D + d] = LoadAsFloat(g.kv_dtype, v_layer, off + d);
      }
    }
    std::vector<float> q(D), scores(static_cast<size_t>(visible_max)), acc(D);
    for (int32_t qi = w.q_begin; qi < w.q_end; ++qi) {
      const int64_t visible = plan.causal ? first_pos + qi + 1 : sp.kv_len;
      for (int hg = 0; hg < group; ++hg) {
        const int h = w.kv_head * group + hg;
        const int64_t qrow = (sp.q_offset + qi) * Hq + h;
        for (int d = 0; d < D; ++d) q[d] = LoadAsFloat(io.q_dtype, io.q, qrow * D + d);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          const float* kj = &k[j * D];
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += q[d] * kj[d];
          scores[j] = s * plan.sm_scale;
          m = std::max(m, scores[j]);
        }
        float denom = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < visible; ++j) {
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
  return absl::OkStatus();
}

}  // namespace pagedattn
