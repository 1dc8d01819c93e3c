// CudaBackend: pools in device memory and Forward as one H2D copy, the append and attention
// kernels, one D2H copy and one stream synchronization, on a workspace taken from a free list.
#include "server/core/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn {
namespace {

namespace k = ::pagedattn::kernels;

absl::Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::Status FromLaunch(const k::LaunchStatus& st) {
  switch (st.code()) {
    case k::LaunchStatus::Code::kOk:
      return absl::OkStatus();
    case k::LaunchStatus::Code::kUnsupported:
      return absl::InvalidArgumentError(st.message());
    case k::LaunchStatus::Code::kCudaError:
      return absl::InternalError(st.message());
  }
  return absl::InternalError(st.message());
}

#define PAGEDATTN_CUDA_RETURN(expr, what)                                     \
  do {                                                                        \
    if (absl::Status _st = CudaStatus((expr), (what)); !_st.ok()) return _st; \
  } while (0)
#define PAGEDATTN_LAUNCH_RETURN(expr)                               \
  do {                                                              \
    if (absl::Status _st = FromLaunch(expr); !_st.ok()) return _st; \
  } while (0)

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

class CudaKvPool final : public KvPool {
 public:
  CudaKvPool(int device, char* base, int64_t layer_bytes, int target_blocks, int unsplit_blocks,
             int prefill_blocks)
      : device_(device),
        base_(base),
        layer_bytes_(layer_bytes),
        target_blocks_(target_blocks),
        unsplit_blocks_(unsplit_blocks),
        prefill_blocks_(prefill_blocks) {}
  ~CudaKvPool() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device_);
    cudaFree(base_);
    cudaSetDevice(current);
  }
  // Layer l's K pool then its V pool, each [num_pages][num_kv_heads][page_size][head_dim].
  void* k(int layer) const { return base_ + 2 * layer * layer_bytes_; }
  void* v(int layer) const { return base_ + (2 * layer + 1) * layer_bytes_; }
  // AttentionPlanLimits' target_blocks and unsplit_blocks (AttentionTargetBlocks).
  int target_blocks() const { return target_blocks_; }
  int unsplit_blocks() const { return unsplit_blocks_; }
  // Persistent blocks of the Hopper prefill kernel (0: the portable kernel runs).
  int prefill_blocks() const { return prefill_blocks_; }

 private:
  int device_;
  char* base_;
  int64_t layer_bytes_;
  int target_blocks_;
  int unsplit_blocks_;
  int prefill_blocks_;
};

// A stream with pinned host and device scratch buffers that grow to the largest Forward seen.
// One Forward uses one workspace at a time; concurrent Forwards take different ones.
struct Workspace {
  int device = 0;
  cudaStream_t stream = nullptr;
  char* host = nullptr;
  size_t host_bytes = 0;
  char* dev = nullptr;
  size_t dev_bytes = 0;
  // Split-KV counters: zeroed once, and every launch leaves them zero again.
  int32_t* counters = nullptr;
  size_t num_counters = 0;

  ~Workspace() {
    cudaSetDevice(device);
    if (stream) cudaStreamDestroy(stream);
    if (host) cudaFreeHost(host);
    if (dev) cudaFree(dev);
    if (counters) cudaFree(counters);
  }

  absl::Status ReserveCounters(size_t want) {
    if (want <= num_counters) return absl::OkStatus();
    const size_t n = std::max(want, 2 * num_counters);
    if (counters) PAGEDATTN_CUDA_RETURN(cudaFree(counters), "cudaFree");
    counters = nullptr;
    num_counters = 0;
    PAGEDATTN_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&counters), n * sizeof(int32_t)),
                          "cudaMalloc(split-KV counters)");
    PAGEDATTN_CUDA_RETURN(cudaMemsetAsync(counters, 0, n * sizeof(int32_t), stream),
                          "cudaMemsetAsync(split-KV counters)");
    num_counters = n;
    return absl::OkStatus();
  }

  absl::Status Reserve(size_t want_host, size_t want_dev) {
    if (want_host > host_bytes) {
      const size_t bytes = std::max(want_host, 2 * host_bytes);  // amortize growth
      if (host) PAGEDATTN_CUDA_RETURN(cudaFreeHost(host), "cudaFreeHost");
      host = nullptr;
      host_bytes = 0;
      PAGEDATTN_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&host), bytes),
                            absl::StrCat("cudaMallocHost(", bytes, " bytes)"));
      host_bytes = bytes;
    }
    if (want_dev > dev_bytes) {
      const size_t bytes = std::max(want_dev, 2 * dev_bytes);
      if (dev) PAGEDATTN_CUDA_RETURN(cudaFree(dev), "cudaFree");
      dev = nullptr;
      dev_bytes = 0;
      PAGEDATTN_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&dev), bytes),
                            absl::StrCat("cudaMalloc(", bytes, " bytes of Forward scratch)"));
      dev_bytes = bytes;
    }
    return absl::OkStatus();
  }
};

// Byte offsets of one Forward's sections in the staging buffers. Inputs (metadata then
// tensors) are laid out identically in host and device memory and move in one copy.
struct Layout {
  size_t page_table = 0, slots = 0, decode_items = 0, decode_wide_items = 0, decode_first_pages = 0,
         decode_wide_first_pages = 0, prefill_items = 0, prefill_jobs = 0, prefill_job_start = 0,
         merge_tasks = 0, q = 0, k = 0, v = 0, input_end = 0;
  // Device only.
  size_t q_f32 = 0, out_f32 = 0, out = 0, lse = 0, partial_out = 0, partial_lse = 0, dev_end = 0;
  // Host only, after the inputs: the results.
  size_t host_out = 0, host_lse = 0, host_end = 0;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device_count, bool portable_prefill)
      : device_count_(device_count), portable_prefill_(portable_prefill) {}

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string name() const override { return "cuda"; }
  std::string device_name() const override {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
      cudaGetLastError();
      return "unknown CUDA device";
    }
    return device_count_ > 1 ? absl::StrCat(prop.name, " x", device_count_) : prop.name;
  }
  int device_count() const override { return device_count_; }

  absl::StatusOr<MemoryInfo> memory(int device) const override {
    if (absl::Status st = SetDevice(device); !st.ok()) return st;
    size_t free_bytes = 0, total_bytes = 0;
    PAGEDATTN_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    return MemoryInfo{static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes)};
  }

  absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry& g) override {
    if (!IsSupportedKvDType(BackendKind::kCuda, g.kv_dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_dtype must be FLOAT16 or BFLOAT16 on the CUDA backend (got ",
                       DTypeName(g.kv_dtype), ")"));
    }
    if (absl::Status st = SetDevice(g.device); !st.ok()) return st;
    int target_blocks = 0, unsplit_blocks = 0;
    PAGEDATTN_LAUNCH_RETURN(
        k::AttentionTargetBlocks(g.kv_dtype, g.head_dim, &target_blocks, &unsplit_blocks));
    int prefill_blocks = 0;
    PAGEDATTN_LAUNCH_RETURN(
        k::PrefillScheduleBlocks(g.kv_dtype, g.head_dim, prefill_path(), &prefill_blocks));
    size_t free_bytes = 0, total_bytes = 0;
    PAGEDATTN_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    const int64_t want = g.TotalBytes();
    if (want <= 0 || static_cast<uint64_t>(want) > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the K/V pool needs ", want, " bytes (", g.num_pages, " pages of ", g.BytesPerPage(),
          ") but GPU ", g.device, " has ", free_bytes, " bytes free of ", total_bytes));
    }
    char* base = nullptr;
    if (cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&base), want); err != cudaSuccess) {
      cudaGetLastError();
      if (err == cudaErrorMemoryAllocation) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cudaMalloc of the K/V pool (", want, " bytes) failed on GPU ", g.device));
      }
      return CudaStatus(err, "cudaMalloc(K/V pool)");
    }
    const int64_t layer_bytes = g.num_pages * g.PageElems() * DTypeSize(g.kv_dtype);
    return std::unique_ptr<KvPool>(
        new CudaKvPool(g.device, base, layer_bytes, target_blocks, unsplit_blocks, prefill_blocks));
  }

  absl::Status Forward(KvPool& pool_base, const CacheGeometry& g, const ForwardPlan& plan,
                       const ForwardIO& io) override {
    auto& pool = static_cast<CudaKvPool&>(pool_base);
    if (absl::Status st = SetDevice(g.device); !st.ok()) return st;
    absl::StatusOr<std::unique_ptr<Workspace>> ws = Acquire(g.device);
    if (!ws.ok()) return ws.status();
    absl::Status st = Run(pool, g, plan, io, **ws);
    // Whatever happened, nothing may still be in flight on a workspace that is reused.
    const cudaError_t sync_err = cudaStreamSynchronize((*ws)->stream);
    if (st.ok()) st = CudaStatus(sync_err, "cudaStreamSynchronize(Forward)");
    Release(std::move(*ws));
    return st;
  }

 private:
  static absl::Status SetDevice(int device) {
    return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }

  absl::StatusOr<std::unique_ptr<Workspace>> Acquire(int device) {
    {
      absl::MutexLock lock(&mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if ((*it)->device == device) {
          std::unique_ptr<Workspace> ws = std::move(*it);
          free_.erase(it);
          return ws;
        }
      }
    }
    auto ws = std::make_unique<Workspace>();
    ws->device = device;
    PAGEDATTN_CUDA_RETURN(cudaStreamCreateWithFlags(&ws->stream, cudaStreamNonBlocking),
                          "cudaStreamCreate");
    return ws;
  }

  void Release(std::unique_ptr<Workspace> ws) {
    absl::MutexLock lock(&mu_);
    free_.push_back(std::move(ws));
  }

  absl::Status Run(CudaKvPool& pool, const CacheGeometry& g, const ForwardPlan& plan,
                   const ForwardIO& io, Workspace& ws) {
    const int D = g.head_dim, Hq = g.num_q_heads, Hkv = g.num_kv_heads;
    const int64_t num_spans = static_cast<int64_t>(plan.spans.size());

    // Host-side metadata: spans, slots of the new rows, the split-KV work plan.
    std::vector<k::AttentionSpan> spans(num_spans);
    std::vector<int64_t> slots(plan.total_new_tokens);
    for (int64_t i = 0; i < num_spans; ++i) {
      const SpanPlan& sp = plan.spans[i];
      spans[i] = {sp.q_offset, sp.page_table_offset, sp.num_queries,
                  static_cast<int32_t>(sp.kv_len)};
      for (int32_t t = 0; t < sp.num_new_tokens; ++t) {
        const int64_t pos = sp.start + t;
        const int64_t page = plan.page_table[sp.page_table_offset + pos / g.page_size];
        slots[sp.kv_offset + t] = page * g.page_size + pos % g.page_size;
      }
    }
    k::AttentionWork work;
    if (plan.total_queries > 0) {
      k::PlanAttentionWork(
          spans.data(), static_cast<int>(num_spans), Hq, Hkv, plan.causal,
          {.target_blocks = pool.target_blocks(), .unsplit_blocks = pool.unsplit_blocks()}, &work);
      k::SchedulePrefillJobs(Hkv, pool.prefill_blocks(), &work);
      k::AttachFirstPages(plan.page_table.data(), g.page_size, &work);
    }

    const size_t q_elems = static_cast<size_t>(plan.total_queries) * Hq * D;
    const size_t kv_elems = static_cast<size_t>(plan.total_new_tokens) * Hkv * D;
    const size_t q_bytes = q_elems * DTypeSize(io.q_dtype);
    const size_t kv_bytes = kv_elems * DTypeSize(io.kv_dtype);
    const size_t lse_bytes = plan.return_lse ? static_cast<size_t>(plan.total_queries) * Hq * 4 : 0;
    const bool q_is_f32 = io.q_dtype == DType::kFloat32;

    Layout L;
    size_t at = 0;
    auto take = [&at](size_t bytes) {
      const size_t off = at;
      at += AlignUp(bytes);
      return off;
    };
    L.page_table = take(plan.page_table.size() * sizeof(int32_t));
    L.slots = take(slots.size() * sizeof(int64_t));
    L.decode_items = take(work.decode_items.size() * sizeof(k::AttentionWorkItem));
    L.decode_wide_items = take(work.decode_wide_items.size() * sizeof(k::AttentionWorkItem));
    L.decode_first_pages = take(work.decode_first_pages.size() * sizeof(k::ItemFirstPages));
    L.decode_wide_first_pages =
        take(work.decode_wide_first_pages.size() * sizeof(k::ItemFirstPages));
    L.prefill_items = take(work.prefill_items.size() * sizeof(k::AttentionWorkItem));
    L.prefill_jobs = take(work.prefill_jobs.size() * sizeof(k::AttentionPrefillJob));
    L.prefill_job_start = take(work.prefill_job_start.size() * sizeof(int32_t));
    L.merge_tasks = take(work.merge_tasks.size() * sizeof(k::AttentionMergeTask));
    L.q = take(q_bytes);
    L.k = take(kv_bytes);
    L.v = take(kv_bytes);
    L.input_end = at;
    const size_t host_at = at;
    L.q_f32 = take(q_is_f32 ? 0 : q_elems * 4);
    L.out_f32 = take(q_is_f32 ? 0 : q_elems * 4);
    L.out = take(q_bytes);
    L.lse = take(lse_bytes);
    L.partial_out = take(static_cast<size_t>(work.partial_rows) * Hkv * D * 4);
    L.partial_lse = take(static_cast<size_t>(work.partial_rows) * Hkv * 4);
    L.dev_end = at;
    at = host_at;
    L.host_out = take(q_bytes);
    L.host_lse = take(lse_bytes);
    L.host_end = at;
    if (absl::Status st = ws.Reserve(L.host_end, L.dev_end); !st.ok()) return st;
    if (absl::Status st = ws.ReserveCounters(work.merge_tasks.size() * Hkv); !st.ok()) return st;

    // Stage everything the device needs into pinned memory, then one copy.
    char* h = ws.host;
    auto put = [h](size_t off, const void* src, size_t bytes) {
      if (bytes > 0) std::memcpy(h + off, src, bytes);
    };
    put(L.page_table, plan.page_table.data(), plan.page_table.size() * sizeof(int32_t));
    put(L.slots, slots.data(), slots.size() * sizeof(int64_t));
    put(L.decode_items, work.decode_items.data(),
        work.decode_items.size() * sizeof(k::AttentionWorkItem));
    put(L.decode_wide_items, work.decode_wide_items.data(),
        work.decode_wide_items.size() * sizeof(k::AttentionWorkItem));
    put(L.decode_first_pages, work.decode_first_pages.data(),
        work.decode_first_pages.size() * sizeof(k::ItemFirstPages));
    put(L.decode_wide_first_pages, work.decode_wide_first_pages.data(),
        work.decode_wide_first_pages.size() * sizeof(k::ItemFirstPages));
    put(L.prefill_items, work.prefill_items.data(),
        work.prefill_items.size() * sizeof(k::AttentionWorkItem));
    put(L.prefill_jobs, work.prefill_jobs.data(),
        work.prefill_jobs.size() * sizeof(k::AttentionPrefillJob));
    put(L.prefill_job_start, work.prefill_job_start.data(),
        work.prefill_job_start.size() * sizeof(int32_t));
    put(L.merge_tasks, work.merge_tasks.data(),
        work.merge_tasks.size() * sizeof(k::AttentionMergeTask));
    if (q_bytes > 0) put(L.q, io.q, q_bytes);
    if (kv_bytes > 0) {
      put(L.k, io.k, kv_bytes);
      put(L.v, io.v, kv_bytes);
    }
    char* d = ws.dev;
    PAGEDATTN_CUDA_RETURN(cudaMemcpyAsync(d, h, L.input_end, cudaMemcpyHostToDevice, ws.stream),
                          "cudaMemcpyAsync(Forward inputs)");

    if (plan.total_new_tokens > 0) {
      k::AppendParams ap;
      ap.k = d + L.k;
      ap.v = d + L.v;
      ap.src_dtype = io.kv_dtype;
      ap.k_cache = pool.k(plan.layer);
      ap.v_cache = pool.v(plan.layer);
      ap.cache_dtype = g.kv_dtype;
      ap.slots = reinterpret_cast<const int64_t*>(d + L.slots);
      ap.num_tokens = plan.total_new_tokens;
      ap.num_kv_heads = Hkv;
      ap.head_dim = D;
      ap.page_size = g.page_size;
      PAGEDATTN_LAUNCH_RETURN(k::LaunchAppendKv(ap, ws.stream));
    }

    if (plan.total_queries > 0) {
      float* q_f32 = reinterpret_cast<float*>(d + (q_is_f32 ? L.q : L.q_f32));
      float* out_f32 = reinterpret_cast<float*>(d + (q_is_f32 ? L.out : L.out_f32));
      if (!q_is_f32) {
        PAGEDATTN_LAUNCH_RETURN(k::LaunchConvert(d + L.q, io.q_dtype, q_f32, DType::kFloat32,
                                                 static_cast<int64_t>(q_elems), ws.stream));
      }
      k::PagedAttentionParams p;
      p.kv_dtype = g.kv_dtype;
      p.num_q_heads = Hq;
      p.num_kv_heads = Hkv;
      p.head_dim = D;
      p.page_size = g.page_size;
      p.causal = plan.causal;
      p.sm_scale = plan.sm_scale;
      p.prefill_path = prefill_path();
      p.k_cache = pool.k(plan.layer);
      p.v_cache = pool.v(plan.layer);
      p.page_table = reinterpret_cast<const int32_t*>(d + L.page_table);
      p.q = q_f32;
      p.out = out_f32;
      p.lse = plan.return_lse ? reinterpret_cast<float*>(d + L.lse) : nullptr;
      p.decode_items = reinterpret_cast<const k::AttentionWorkItem*>(d + L.decode_items);
      p.num_decode_items = static_cast<int32_t>(work.decode_items.size());
      p.decode_wide_items = reinterpret_cast<const k::AttentionWorkItem*>(d + L.decode_wide_items);
      p.num_decode_wide_items = static_cast<int32_t>(work.decode_wide_items.size());
      if (!work.decode_first_pages.empty()) {
        p.decode_first_pages = reinterpret_cast<const k::ItemFirstPages*>(d + L.decode_first_pages);
      }
      if (!work.decode_wide_first_pages.empty()) {
        p.decode_wide_first_pages =
            reinterpret_cast<const k::ItemFirstPages*>(d + L.decode_wide_first_pages);
      }
      p.prefill_items = reinterpret_cast<const k::AttentionWorkItem*>(d + L.prefill_items);
      p.num_prefill_items = static_cast<int32_t>(work.prefill_items.size());
      p.prefill_jobs = reinterpret_cast<const k::AttentionPrefillJob*>(d + L.prefill_jobs);
      p.prefill_job_start = reinterpret_cast<const int32_t*>(d + L.prefill_job_start);
      p.num_prefill_blocks = work.num_prefill_blocks();
      p.merge_tasks = reinterpret_cast<const k::AttentionMergeTask*>(d + L.merge_tasks);
      p.num_merge_tasks = static_cast<int32_t>(work.merge_tasks.size());
      p.separate_merge = work.separate_merge;
      p.merge_rows = work.merge_rows;
      p.partial_out = reinterpret_cast<float*>(d + L.partial_out);
      p.partial_lse = reinterpret_cast<float*>(d + L.partial_lse);
      p.partial_rows = work.partial_rows;
      p.merge_counters = ws.counters;
      PAGEDATTN_LAUNCH_RETURN(k::LaunchPagedAttention(p, ws.stream));
      if (!q_is_f32) {
        PAGEDATTN_LAUNCH_RETURN(k::LaunchConvert(out_f32, DType::kFloat32, d + L.out, io.q_dtype,
                                                 static_cast<int64_t>(q_elems), ws.stream));
      }
      PAGEDATTN_CUDA_RETURN(
          cudaMemcpyAsync(h + L.host_out, d + L.out, q_bytes, cudaMemcpyDeviceToHost, ws.stream),
          "cudaMemcpyAsync(out)");
      if (lse_bytes > 0) {
        PAGEDATTN_CUDA_RETURN(cudaMemcpyAsync(h + L.host_lse, d + L.lse, lse_bytes,
                                              cudaMemcpyDeviceToHost, ws.stream),
                              "cudaMemcpyAsync(lse)");
      }
    }
    PAGEDATTN_CUDA_RETURN(cudaStreamSynchronize(ws.stream), "Forward on the GPU");
    if (plan.total_queries > 0) {
      std::memcpy(io.out, h + L.host_out, q_bytes);
      if (lse_bytes > 0 && io.lse) std::memcpy(io.lse, h + L.host_lse, lse_bytes);
    }
    return absl::OkStatus();
  }

  const int device_count_;
  k::PrefillPath prefill_path() const {
    return portable_prefill_ ? k::PrefillPath::kPortable : k::PrefillPath::kAuto;
  }

  const bool portable_prefill_;  // --prefill_kernel=portable
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Workspace>> free_;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear: "no driver" must not leak into later calls
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options) {
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError("no CUDA GPU is visible (cudaGetDeviceCount found none)");
  }
  k::SetGraphLaunch(options.graph_launch);
  return std::unique_ptr<Backend>(new CudaBackend(count, options.portable_prefill));
}

}  // namespace pagedattn
