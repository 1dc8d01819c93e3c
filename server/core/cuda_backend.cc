// CudaBackend: pools in device memory, and Forward as the kernel library's plan, one H2D copy, the
// append and attention kernels, one D2H copy and one synchronization, on a pooled workspace.
#include "server/core/cuda_backend.h"

#include <cuda.h>  // driver types only: entry points come through the runtime
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/attention_plan.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"
#include "kernels/submission.h"
#include "kernels/workspace.h"
#include "server/core/cache.h"

namespace pagedattn {
namespace {

namespace k = ::pagedattn::kernels;

absl::Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

// The errors CUDA documents as leaving the process's context unusable: "any further CUDA work
// will return the same error" until the process restarts.
bool ContextLost(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

absl::Status FromLaunch(const k::LaunchStatus& st) {
  switch (st.code()) {
    case k::LaunchStatus::Code::kOk:
      return absl::OkStatus();
    case k::LaunchStatus::Code::kUnsupported:
      return absl::InvalidArgumentError(st.message());
    case k::LaunchStatus::Code::kOutOfMemory:
      return absl::ResourceExhaustedError(st.message());
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

class CudaKvPool final : public KvPool {
 public:
  // sinks: num_layers x num_q_heads floats on the device (layers without sinks unused), or null
  // when no layer has sinks.
  // layer_bytes: one layer's K (or V). An FP8 cache's scales: static_scales (STATIC: K's and V's
  // per layer) or, PER_TOKEN, row_scales floats per layer for K then as many for V, after every
  // layer's K and V.
  CudaKvPool(int device, char* base, int64_t layer_bytes, const k::AttentionPlanLimits& limits,
             std::vector<cudaEvent_t> layer_done, float* sinks, int32_t num_q_heads,
             std::vector<float> static_scales, int64_t row_scales)
      : device_(device),
        base_(base),
        layer_bytes_(layer_bytes),
        static_scales_(std::move(static_scales)),
        row_scales_(row_scales),
        limits_(limits),
        layer_done_(std::move(layer_done)),
        sinks_(sinks),
        num_q_heads_(num_q_heads) {}
  ~CudaKvPool() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device_);
    cudaFree(base_);  // waits for the work still using it
    if (sinks_ != nullptr) cudaFree(sinks_);
    for (cudaEvent_t e : layer_done_) cudaEventDestroy(e);
    cudaSetDevice(current);
  }
  // Layer l's sinks on the device (num_q_heads logits); null when it has none.
  const float* sinks(const LayerAttention* attention, int layer) const {
    if (attention == nullptr || attention->sinks.empty()) return nullptr;
    return sinks_ + int64_t{layer} * num_q_heads_;
  }
  // Recorded after each Forward's work on a layer, waited for by the next Forward's: Forwards
  // of one layer run on the GPU in the order the cache admitted them, whichever streams they
  // take, also when the server answers before the work is done (ForwardIO::done_event).
  cudaEvent_t layer_done(int layer) const { return layer_done_[layer]; }
  // Layer l's K pool then its V pool, each [num_pages][num_kv_heads][page_size][head_dim].
  void* k(int layer) const { return base_ + 2 * layer * layer_bytes_; }
  void* v(int layer) const { return base_ + (2 * layer + 1) * layer_bytes_; }
  // Layer l's FP8 scales (KvScales); unit static scales for a 16-bit cache (never read).
  k::KvScales scales(int layer) const {
    k::KvScales s;
    if (row_scales_ > 0) {
      float* first = reinterpret_cast<float*>(base_ + 2 * int64_t{num_layers()} * layer_bytes_);
      s.k_rows = first + 2 * layer * row_scales_;
      s.v_rows = s.k_rows + row_scales_;
    } else if (!static_scales_.empty()) {
      s.k = static_scales_[2 * static_cast<size_t>(layer)];
      s.v = static_scales_[2 * static_cast<size_t>(layer) + 1];
    }
    return s;
  }
  // How a Forward's plan may spread its work over this pool's device (QueryPlanLimits).
  const k::AttentionPlanLimits& limits() const { return limits_; }

 private:
  int device_;
  char* base_;
  int num_layers() const { return static_cast<int>(layer_done_.size()); }

  int64_t layer_bytes_;
  std::vector<float> static_scales_;
  int64_t row_scales_;
  k::AttentionPlanLimits limits_;
  std::vector<cudaEvent_t> layer_done_;
  float* sinks_;
  int32_t num_q_heads_;
};

// Another process's allocation mapped here by cudaIpcOpenMemHandle.
class CudaImportedMemory final : public ImportedMemory {
 public:
  CudaImportedMemory(int device, char* base) : device_(device), base_(base) {}
  ~CudaImportedMemory() override {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device_);
    // Forwards answered before their work was done may still read or write it.
    cudaDeviceSynchronize();
    cudaIpcCloseMemHandle(base_);
    cudaSetDevice(current);
  }
  char* base() const override { return base_; }
  int64_t size() const override { return size_; }
  void set_size(int64_t size) { size_ = size; }

 private:
  int device_;
  char* base_;
  int64_t size_ = 0;
};

// Another process's event opened by cudaIpcOpenEventHandle.
class CudaImportedEvent final : public ImportedEvent {
 public:
  explicit CudaImportedEvent(cudaEvent_t event) : event_(event) {}
  ~CudaImportedEvent() override { cudaEventDestroy(event_); }
  void* handle() const override { return event_; }

 private:
  cudaEvent_t event_;
};

// The size of the allocation holding `ptr`, from the driver's cuMemGetAddressRange, looked up
// through the runtime (the server does not link libcuda, so it starts where there is no driver).
absl::StatusOr<int64_t> AllocationSize(void* ptr) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetAddressRange fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<GetAddressRange>(f);
  }();
  if (fn == nullptr) return absl::InternalError("the driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (CUresult r = fn(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed (CUresult ", r, ")"));
  }
  // The handle names an allocation's start (cudaIpcGetMemHandle); what lies before ptr is not
  // the caller's to use.
  return static_cast<int64_t>(size) -
         static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(ptr) - base);
}

// A stream and the buffers of the Forwards that run on it. One Forward uses one workspace at a
// time; concurrent Forwards take different ones.
struct Workspace {
  int device = 0;
  cudaStream_t stream = nullptr;
  k::ForwardWorkspace buffers;  // freed after the destructor's body: on `device`
  // A Forward's operations, recorded before they are submitted (--forward_graph: each as a
  // graph): the upload, then the kernels and the download.
  k::Submission upload, work;
  k::SubmissionGraphs upload_graphs, work_graphs;
  // Recorded after the upload of a Forward answered before its work was done: until it has
  // passed, the pinned image is still to be read and the workspace is not handed out.
  cudaEvent_t uploaded = nullptr;
  // buffers.generation() when the graphs above were last checked: a reallocated buffer drops
  // them (SubmissionGraphs::Clear). A graph node given a buffer at its old address again is not
  // updated and keeps the freed allocation's state: with the device scratch freed before it was
  // regrown (so that it came back at the same address), e2e_test's RandomRequests crashed inside
  // cudaGraphLaunch in 2 of 225 runs on an H100 (6 of 60 on an H200); with the graphs dropped,
  // 0 of 225.
  uint64_t graphs_generation = 0;

  bool Busy() const {
    if (uploaded == nullptr) return false;
    const cudaError_t err = cudaEventQuery(uploaded);
    if (err == cudaErrorNotReady) cudaGetLastError();
    return err == cudaErrorNotReady;
  }

  ~Workspace() {
    cudaSetDevice(device);
    if (uploaded) cudaEventDestroy(uploaded);
    if (stream) cudaStreamDestroy(stream);
  }
};

class CudaBackend;

// ForwardBuffers of the CUDA backend: a workspace taken for one Forward, its inputs written by
// the caller straight into the pinned image the upload reads, and the answer left where the
// download puts it. The workspace goes back to the backend's free list when this is destroyed
// (once the answer has been sent).
class CudaForwardBuffers final : public ForwardBuffers {
 public:
  CudaForwardBuffers(CudaBackend* backend, std::unique_ptr<Workspace> ws,
                     const k::InputsLayout& inputs)
      : backend_(backend), ws_(std::move(ws)), inputs_(inputs) {}
  ~CudaForwardBuffers() override;

  char* q() override { return ws_->buffers.host() + inputs_.q; }
  char* k() override { return ws_->buffers.host() + inputs_.k; }
  char* v() override { return ws_->buffers.host() + inputs_.v; }
  const char* out() const override { return ws_->buffers.host() + out_; }
  const float* lse() const override {
    return has_lse_ ? reinterpret_cast<const float*>(ws_->buffers.host() + lse_) : nullptr;
  }

  Workspace& workspace() { return *ws_; }
  // Where the answer lies once the Forward's download is done.
  void SetResults(size_t out, size_t lse, bool has_lse) {
    out_ = out;
    lse_ = lse;
    has_lse_ = has_lse;
  }

 private:
  CudaBackend* backend_;
  std::unique_ptr<Workspace> ws_;
  k::InputsLayout inputs_;
  size_t out_ = 0, lse_ = 0;
  bool has_lse_ = false;
};

// The kernel library's view of a Forward: its spans, page table, shapes and dtypes.
k::ForwardBatch BatchOf(const CacheGeometry& g, const ForwardPlan& plan, const ForwardIO& io,
                        const float* sinks, const k::KvScales& scales,
                        std::vector<k::ForwardSpan>& spans) {
  spans.resize(plan.spans.size());
  for (size_t i = 0; i < plan.spans.size(); ++i) {
    const SpanPlan& sp = plan.spans[i];
    spans[i] = {.q_offset = sp.q_offset,
                .kv_offset = sp.kv_offset,
                .page_table_offset = sp.page_table_offset,
                .first_new_position = sp.start,
                .num_new_tokens = sp.num_new_tokens,
                .num_queries = sp.num_queries,
                .kv_len = static_cast<int32_t>(sp.kv_len)};
  }
  return {.spans = spans,
          .page_table = plan.page_table,
          .total_queries = plan.total_queries,
          .total_new_tokens = plan.total_new_tokens,
          .num_q_heads = g.num_q_heads,
          .num_kv_heads = g.num_kv_heads,
          .head_dim = g.head_dim,
          .page_size = g.page_size,
          .kv_dtype = g.kv_dtype,
          .q_dtype = io.q_dtype,
          .kv_wire_dtype = io.kv_dtype,
          .causal = plan.causal,
          .sm_scale = plan.sm_scale,
          .return_lse = plan.return_lse,
          .external_tensors = io.device_tensors,
          .window = plan.attention != nullptr ? plan.attention->sliding_window : 0,
          .softcap = plan.attention != nullptr ? plan.attention->logit_softcap : 0.f,
          .sinks = sinks,
          .kv_scales = scales};
}

// Every layer's sinks in one device array (num_layers x num_q_heads floats, a layer without sinks
// left zero and never read); null when no layer has sinks.
absl::StatusOr<float*> UploadSinks(const CacheGeometry& g) {
  bool any = false;
  for (int32_t l = 0; l < g.num_layers; ++l) {
    if (const LayerAttention* a = g.attention(l); a != nullptr && !a->sinks.empty()) any = true;
  }
  if (!any) return nullptr;
  std::vector<float> host(static_cast<size_t>(g.num_layers) * g.num_q_heads, 0.f);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    if (const LayerAttention* a = g.attention(l); a != nullptr && !a->sinks.empty()) {
      std::copy(a->sinks.begin(), a->sinks.end(), host.begin() + int64_t{l} * g.num_q_heads);
    }
  }
  float* sinks = nullptr;
  PAGEDATTN_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&sinks), host.size() * sizeof(float)),
                        "cudaMalloc(sinks)");
  cudaError_t err =
      cudaMemcpy(sinks, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  // From pageable memory the copy returns once staged, not landed, and the Forwards'
  // (non-blocking) streams do not wait for the default stream: landed before the cache answers.
  if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamLegacy);
  if (err != cudaSuccess) {
    cudaFree(sinks);
    return CudaStatus(err, "cudaMemcpy(sinks)");
  }
  return sinks;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device_count, const CudaBackendOptions& options)
      : device_count_(device_count),
        portable_prefill_(options.portable_prefill),
        forward_graph_(options.graph_launch && options.forward_graph),
        launcher_(options.graph_launch) {}

  const k::Launcher& launcher() const { return launcher_; }
  int64_t forward_graphs() const { return forward_graphs_.load(); }

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
  std::string compute_capability(int device) const override { return ComputeCapability(device); }

  // Asks each device the backend has used (never one it has not: that would make a context
  // there) whether its context still works; a lost one answers every call with its error.
  std::string Unrecoverable() const override {
    const uint64_t used = used_devices_.load();
    for (int d = 0; d < 64 && d < device_count_; ++d) {
      if ((used >> d & 1) == 0) continue;
      cudaError_t err = cudaSetDevice(d);
      if (err == cudaSuccess) err = cudaStreamQuery(nullptr);
      if (ContextLost(err)) {
        return absl::StrCat("GPU ", d, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
                            "), which leaves the GPU unusable until the process restarts");
      }
    }
    return "";
  }

  // The kernels' limits on this device (QueryPlanLimits: each tile's shared memory a block):
  // what AllocatePool would otherwise fail on, asked at validation.
  absl::Status RunsHeadDim(int device, DType kv_dtype, int head_dim) const override {
    if (absl::Status st = SetDevice(device); !st.ok()) return st;
    k::AttentionPlanLimits limits;
    const k::LaunchStatus st = k::QueryPlanLimits(kv_dtype, head_dim, prefill_path(), &limits);
    if (st.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("compute capability ", ComputeCapability(device), ": ", st.message()));
  }

  absl::StatusOr<MemoryInfo> memory(int device) const override {
    if (absl::Status st = SetDevice(device); !st.ok()) return st;
    size_t free_bytes = 0, total_bytes = 0;
    PAGEDATTN_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    return MemoryInfo{static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes)};
  }

  absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry& g,
                                                       const StopToken& /*stop*/) override {
    if (!IsSupportedKvDType(BackendKind::kCuda, g.kv_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_dtype must be FLOAT16, BFLOAT16 or FLOAT8_E4M3 on the CUDA backend (got ",
          DTypeName(g.kv_dtype), ")"));
    }
    if (absl::Status st = SetDevice(g.device); !st.ok()) return st;
    k::AttentionPlanLimits limits;
    PAGEDATTN_LAUNCH_RETURN(k::QueryPlanLimits(g.kv_dtype, g.head_dim, prefill_path(), &limits));
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
    // Every row of the pool finite from the start (writes are AttentionValue's): the prefill
    // kernel reads a range's last page whole, rows past the range's end weighing zero, and a
    // NaN there would not (0 * NaN). Once per cache, at the memory's speed, and finished before
    // the cache is answered: a memset of device memory returns before it is done, and the
    // Forwards' streams (non-blocking) do not wait for the default stream, so a first append
    // could land before the zeros (70 GB at the H200's ~3 TB/s of writes: over 20 ms).
    cudaError_t err = cudaMemsetAsync(base, 0, want, cudaStreamLegacy);
    if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamLegacy);
    if (err != cudaSuccess) {
      cudaFree(base);
      return CudaStatus(err, "zeroing the K/V pool");
    }
    const int64_t layer_bytes = g.num_pages * g.PageElems() * DTypeSize(g.kv_dtype);
    absl::StatusOr<float*> sinks = UploadSinks(g);
    if (!sinks.ok()) {
      cudaFree(base);
      return sinks.status();
    }
    std::vector<cudaEvent_t> layer_done(static_cast<size_t>(g.num_layers));
    for (cudaEvent_t& e : layer_done) {
      if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
          err != cudaSuccess) {
        for (cudaEvent_t made : layer_done) {
          if (made != nullptr) cudaEventDestroy(made);
        }
        cudaFree(base);
        if (*sinks != nullptr) cudaFree(*sinks);
        return CudaStatus(err, "cudaEventCreate(layer order)");
      }
    }
    const int64_t row_scales =
        g.kv_scaling == KvScaling::kPerToken ? g.num_pages * g.num_kv_heads * g.page_size : 0;
    std::vector<float> static_scales =
        g.kv_scaling == KvScaling::kStatic ? g.kv_scales : std::vector<float>{};
    return std::unique_ptr<KvPool>(new CudaKvPool(g.device, base, layer_bytes, limits,
                                                  std::move(layer_done), *sinks, g.num_q_heads,
                                                  std::move(static_scales), row_scales));
  }

  absl::StatusOr<std::unique_ptr<ImportedMemory>> ImportMemory(int device,
                                                               const std::string& handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc_handle must be the ", sizeof(cudaIpcMemHandle_t),
                       " bytes of a cudaIpcMemHandle_t (got ", handle.size(), " bytes)"));
    }
    if (absl::Status st = SetDevice(device); !st.ok()) return st;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* ptr = nullptr;
    if (cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc_handle could not be opened on GPU ", device, ": ",
                       cudaGetErrorName(err), " (", cudaGetErrorString(err),
                       "); it must come from cudaIpcGetMemHandle in a live process "
                       "on this node, not the server's own"));
    }
    // Closed again on any error below.
    auto mem = std::make_unique<CudaImportedMemory>(device, static_cast<char*>(ptr));
    cudaPointerAttributes attr = {};
    PAGEDATTN_CUDA_RETURN(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
    if (attr.device != device) {
      return absl::InvalidArgumentError(
          absl::StrCat("the allocation lies on GPU ", attr.device, ", the cache on GPU ", device));
    }
    absl::StatusOr<int64_t> size = AllocationSize(ptr);
    if (!size.ok()) return size.status();
    mem->set_size(*size);
    return std::unique_ptr<ImportedMemory>(std::move(mem));
  }

  absl::StatusOr<std::unique_ptr<ImportedEvent>> ImportEvent(int device,
                                                             const std::string& handle) override {
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("a cuda_ipc_events entry must be the ", sizeof(cudaIpcEventHandle_t),
                       " bytes of a cudaIpcEventHandle_t (got ", handle.size(), " bytes)"));
    }
    if (absl::Status st = SetDevice(device); !st.ok()) return st;
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t event = nullptr;
    if (cudaError_t err = cudaIpcOpenEventHandle(&event, h); err != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          "a cuda_ipc_events entry could not be opened: ", cudaGetErrorName(err), " (",
          cudaGetErrorString(err),
          "); it must come from cudaIpcGetEventHandle of an event "
          "created with cudaEventInterprocess | cudaEventDisableTiming in a live process"));
    }
    return std::unique_ptr<ImportedEvent>(new CudaImportedEvent(event));
  }

  absl::StatusOr<std::unique_ptr<ForwardBuffers>> AcquireForwardBuffers(
      int device, size_t q_bytes, size_t kv_bytes, size_t /*out_bytes*/,
      size_t /*lse_bytes*/) override {
    if (absl::Status st = SetDevice(device); !st.ok()) return st;
    absl::StatusOr<std::unique_ptr<Workspace>> ws = Acquire(device);
    if (!ws.ok()) return ws.status();
    const k::InputsLayout inputs = k::InputsLayout::Of(q_bytes, kv_bytes);
    if (k::LaunchStatus st = (*ws)->buffers.ReserveInputs(inputs); !st.ok()) {
      Release(*std::move(ws));
      return FromLaunch(st);
    }
    return std::unique_ptr<ForwardBuffers>(new CudaForwardBuffers(this, *std::move(ws), inputs));
  }

  absl::Status Forward(KvPool& pool_base, const CacheGeometry& g, const ForwardPlan& plan,
                       const ForwardIO& io) override {
    auto& pool = static_cast<CudaKvPool&>(pool_base);
    // The kernels take milliseconds and cannot be interrupted: the stop token is read before
    // anything is written.
    if (absl::Status st = plan.stop.Check(); !st.ok()) return st;
    if (absl::Status st = SetDevice(g.device); !st.ok()) return st;
    auto* buffers = static_cast<CudaForwardBuffers*>(io.buffers);  // this backend's own
    std::unique_ptr<Workspace> own;
    if (buffers == nullptr) {
      absl::StatusOr<std::unique_ptr<Workspace>> ws = Acquire(g.device);
      if (!ws.ok()) return ws.status();
      own = *std::move(ws);
    }
    Workspace& ws = buffers != nullptr ? buffers->workspace() : *own;
    absl::Status st = Run(pool, g, plan, io, ws, buffers);
    // Whatever happened, nothing may still be in flight on a workspace that is reused; but a
    // Forward with a done event is answered once queued (the stream orders what reuses it).
    if (!st.ok() || io.done_event == nullptr) {
      const cudaError_t sync_err = cudaStreamSynchronize(ws.stream);
      if (st.ok()) st = CudaStatus(sync_err, "cudaStreamSynchronize(Forward)");
    }
    if (own != nullptr) Release(std::move(own));
    return st;
  }

  void Release(std::unique_ptr<Workspace> ws) {
    absl::MutexLock lock(&mu_);
    free_.push_back(std::move(ws));
  }

 private:
  absl::Status SetDevice(int device) const {
    // Written once a device (a load otherwise): SetDevice is on every Forward's path.
    const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
    if ((used_devices_.load(std::memory_order_relaxed) & bit) != bit) used_devices_.fetch_or(bit);
    return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }

  absl::StatusOr<std::unique_ptr<Workspace>> Acquire(int device) {
    {
      absl::MutexLock lock(&mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if ((*it)->device == device && !(*it)->Busy()) {
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

  // Plan, stage, one H2D copy, append, attention, one D2H copy, one synchronization. With
  // buffers, q, k and v are already in the workspace's image and the answer stays there. The
  // GPU's part is recorded first and submitted as two cached graphs (or op by op: Submit).
  absl::Status Run(CudaKvPool& pool, const CacheGeometry& g, const ForwardPlan& plan,
                   const ForwardIO& io, Workspace& ws, CudaForwardBuffers* buffers) {
    using k::ForwardWorkspace;
    const absl::Time start = absl::Now();
    std::vector<k::ForwardSpan> spans;
    const k::AttentionPlan attention =
        k::AttentionPlan::Make(BatchOf(g, plan, io, pool.sinks(plan.attention, plan.layer),
                                       pool.scales(plan.layer), spans),
                               pool.limits());
    PAGEDATTN_LAUNCH_RETURN(ws.buffers.Reserve(attention, ws.stream));
    if (ws.graphs_generation != ws.buffers.generation()) {
      ws.upload_graphs.Clear();
      ws.work_graphs.Clear();
      ws.graphs_generation = ws.buffers.generation();
    }
    if (io.device_tensors) {
      ws.buffers.StageInputs(attention, nullptr, nullptr, nullptr);  // the metadata only
    } else if (buffers != nullptr) {
      ws.buffers.StageInputs(attention, buffers->q(), buffers->k(), buffers->v());
    } else {
      ws.buffers.StageInputs(attention, io.q, io.k, io.v);
    }
    // Answered once queued: no timings (they need the work done).
    const bool detached = io.done_event != nullptr;
    const bool timed = io.timings != nullptr && !detached;
    if (io.timings != nullptr) io.timings->queued = detached;
    if (detached && ws.uploaded == nullptr) {  // the image is read later: Acquire waits for it
      PAGEDATTN_CUDA_RETURN(cudaEventCreateWithFlags(&ws.uploaded, cudaEventDisableTiming),
                            "cudaEventCreate(upload)");
    }
    // The workspace's copies, marks and kernels as two submissions (graphs, Submit): the upload,
    // so that it starts while the rest is submitted, then the kernels and the download. The
    // events of the pool and the caller go between them, as graphs must not hold events that
    // may die before them.
    k::Submission& upload = ws.upload;
    upload.Clear();
    if (timed) PAGEDATTN_LAUNCH_RETURN(ws.buffers.Mark(ForwardWorkspace::kBeforeUpload, upload));
    ws.buffers.Upload(attention, upload);
    if (timed) PAGEDATTN_LAUNCH_RETURN(ws.buffers.Mark(ForwardWorkspace::kAfterUpload, upload));
    if (detached) upload.Record(ws.uploaded);
    k::Submission& work = ws.work;
    work.Clear();
    const k::ForwardLaunch launch =
        ws.buffers.Bind(attention, pool.k(plan.layer), pool.v(plan.layer),
                        {.q = io.q, .k = io.k, .v = io.v, .out = io.out, .lse = io.lse});
    k::Launcher record(&work);
    PAGEDATTN_LAUNCH_RETURN(k::LaunchAppendKv(launch.append, ws.stream, record));
    PAGEDATTN_LAUNCH_RETURN(k::LaunchForwardAttention(launch, ws.stream, record));
    if (!detached) {
      if (timed) PAGEDATTN_LAUNCH_RETURN(ws.buffers.Mark(ForwardWorkspace::kAfterKernels, work));
      ws.buffers.Download(attention, work);
      if (timed) PAGEDATTN_LAUNCH_RETURN(ws.buffers.Mark(ForwardWorkspace::kAfterDownload, work));
    }
    const absl::Time submit_start = absl::Now();
    if (io.timings != nullptr)
      io.timings->stage_us = absl::ToDoubleMicroseconds(submit_start - start);
    if (absl::Status st = Submit(ws.upload_graphs, upload, ws.stream); !st.ok()) return st;
    if (io.wait_event != nullptr) {  // the caller's q/k/v writes
      PAGEDATTN_CUDA_RETURN(
          cudaStreamWaitEvent(ws.stream, static_cast<cudaEvent_t>(io.wait_event), 0),
          "cudaStreamWaitEvent(the caller's event)");
    }
    const cudaEvent_t layer_done = pool.layer_done(plan.layer);
    PAGEDATTN_CUDA_RETURN(cudaStreamWaitEvent(ws.stream, layer_done, 0),
                          "cudaStreamWaitEvent(layer order)");
    if (absl::Status st = Submit(ws.work_graphs, work, ws.stream); !st.ok()) return st;
    PAGEDATTN_CUDA_RETURN(cudaEventRecord(layer_done, ws.stream), "cudaEventRecord(layer order)");
    if (detached) {
      PAGEDATTN_CUDA_RETURN(cudaEventRecord(static_cast<cudaEvent_t>(io.done_event), ws.stream),
                            "cudaEventRecord(the caller's done event)");
    }
    if (forward_graph_) forward_graphs_.fetch_add(1, std::memory_order_relaxed);
    if (io.timings != nullptr)
      io.timings->submit_us = absl::ToDoubleMicroseconds(absl::Now() - submit_start);
    if (detached) return absl::OkStatus();
    PAGEDATTN_CUDA_RETURN(cudaStreamSynchronize(ws.stream), "Forward on the GPU");
    if (timed) {
      io.timings->h2d_us =
          1e3 * ws.buffers.Elapsed(ForwardWorkspace::kBeforeUpload, ForwardWorkspace::kAfterUpload);
      io.timings->kernel_us =
          1e3 * ws.buffers.Elapsed(ForwardWorkspace::kAfterUpload, ForwardWorkspace::kAfterKernels);
      io.timings->d2h_us = 1e3 * ws.buffers.Elapsed(ForwardWorkspace::kAfterKernels,
                                                    ForwardWorkspace::kAfterDownload);
    }
    const k::ForwardStaging& st = attention.staging();
    if (io.device_tensors) {
      // The answer is where the caller said.
    } else if (buffers != nullptr) {
      buffers->SetResults(st.out, st.lse, st.lse_bytes > 0);
    } else {
      ws.buffers.ReadResults(attention, io.out, io.lse);
    }
    return absl::OkStatus();
  }

  // Recorded work to a stream: as a cached graph (one runtime call), or each operation by
  // itself, kernels through the launcher (--forward_graph=false).
  absl::Status Submit(k::SubmissionGraphs& graphs, const k::Submission& work, cudaStream_t stream) {
    return FromLaunch(forward_graph_ ? graphs.Launch(work, stream)
                                     : k::SubmitOps(work, stream, &launcher_));
  }

  const int device_count_;
  k::PrefillPath prefill_path() const {
    return portable_prefill_ ? k::PrefillPath::kPortable : k::PrefillPath::kAuto;
  }

  const bool portable_prefill_;  // --prefill_kernel=portable
  const bool forward_graph_;     // --forward_graph: a Forward's upload and work as cached graphs
  k::Launcher launcher_;         // --graph_launch: the kernels through cached graphs
  std::atomic<int64_t> forward_graphs_{0};
  mutable std::atomic<uint64_t> used_devices_{0};  // bit d: SetDevice(d) was called (Unrecoverable)
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Workspace>> free_;
};

}  // namespace

CudaForwardBuffers::~CudaForwardBuffers() { backend_->Release(std::move(ws_)); }

int CudaDeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear: "no driver" must not leak into later calls
    count = 0;
  }
  if (count == 0 && why != nullptr) {
    *why =
        absl::StrCat("no CUDA GPU is visible to this process (",
                     err != cudaSuccess ? cudaGetErrorString(err) : "the driver lists none", ")");
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
      absl::StrAppend(why, "; CUDA_VISIBLE_DEVICES=\"", visible, "\"");
    }
  }
  return count;
}

std::string ComputeCapability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return absl::StrCat(major, ".", minor);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options) {
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError("no CUDA GPU is visible (cudaGetDeviceCount found none)");
  }
  // A GPU the build has no code for would accept caches and fail every Forward: refuse it now.
  for (int d = 0; d < count; ++d) {
    if (k::LaunchStatus st = k::CheckDeviceRunsKernels(d); !st.ok()) {
      cudaDeviceProp prop = {};
      (void)cudaGetDeviceProperties(&prop, d);
      return absl::FailedPreconditionError(absl::StrCat(
          st.message(), " (", prop.name, ", compute capability ", ComputeCapability(d),
          "); build with -DPAGEDATTN_CUDA_ARCHS naming its architecture, e.g. \"",
          ComputeCapability(d).empty() ? "80"
                                       : absl::StrReplaceAll(ComputeCapability(d), {{".", ""}}),
          "\""));
    }
  }
  return std::unique_ptr<Backend>(new CudaBackend(count, options));
}

std::vector<std::string> CudaBuildArchitectures() {
  return absl::StrSplit(k::CompiledArchitectures(), ' ', absl::SkipEmpty());
}

const kernels::Launcher* CudaLauncherOf(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? &cuda->launcher() : nullptr;
}

int64_t CudaForwardGraphsOf(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->forward_graphs() : -1;
}

}  // namespace pagedattn
