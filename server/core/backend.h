// The backend interface: where a cache's K/V pool lives and how Forward runs on it.
// The CPU backend (cpu_backend.h) is the reference; the CUDA backend plugs in the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/capabilities.h"
#include "server/core/stop_token.h"

namespace pagedattn {

struct ForwardTimings;  // server/core/cache.h
class ForwardBuffers;   // below

// One layer's attention variant (CacheConfig.layers), validated. All unset: plain attention.
struct LayerAttention {
  int32_t sliding_window = 0;  // 0: none; else a query at p attends p - sliding_window + 1 .. p.
  float logit_softcap = 0.f;   // 0: none; else scores become cap * tanh(score / cap).
  std::vector<float> sinks;    // Empty: none; else one logit per q head in the denominator.

  bool plain() const { return sliding_window == 0 && logit_softcap == 0.f && sinks.empty(); }
};

// A validated, resolved cache configuration: every field is in range and num_pages is set.
struct CacheGeometry {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  DType kv_dtype = DType::kUnspecified;
  int32_t device = 0;
  int64_t num_pages = 0;
  // The softmax scale of a Forward that sets none: 1/sqrt(head_dim) rounded once to float, as a
  // client writes it (Python's head_dim ** -0.5; float32 1.0f / sqrtf rounds twice, and is 1 ulp
  // off for 96 and 241 other head dims up to 1024).
  float default_sm_scale() const {
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  }
  // Each layer's variant: empty when every layer is plain, else num_layers entries.
  std::vector<LayerAttention> layers;
  // An FP8 cache's scaling (kPerToken or kStatic; kUnspecified for 16/32-bit caches), and with
  // kStatic each layer's K and V scales (layer l's at 2l, 2l + 1).
  KvScaling kv_scaling = KvScaling::kUnspecified;
  std::vector<float> kv_scales;

  // Layer l's variant; null when plain.
  const LayerAttention* attention(int32_t layer) const {
    if (layers.empty() || layers[static_cast<size_t>(layer)].plain()) return nullptr;
    return &layers[static_cast<size_t>(layer)];
  }

  // Elements of one page of K (or V) in one layer: [num_kv_heads][page_size][head_dim].
  int64_t PageElems() const { return int64_t{num_kv_heads} * page_size * head_dim; }
  // Bytes of the per-row scales of one page, K and V, across all layers (kPerToken: a float
  // per (position, kv head)).
  int64_t ScaleBytesPerPage() const {
    return kv_scaling == KvScaling::kPerToken
               ? 2 * int64_t{num_layers} * num_kv_heads * page_size * int64_t{sizeof(float)}
               : 0;
  }
  // Bytes of K plus V (and their scales) for one page across all layers.
  int64_t BytesPerPage() const {
    return 2 * int64_t{num_layers} * PageElems() * DTypeSize(kv_dtype) + ScaleBytesPerPage();
  }
  int64_t TotalBytes() const { return BytesPerPage() * num_pages; }
  int32_t GqaRatio() const { return num_q_heads / num_kv_heads; }
};

// Memory the backend can give to pools on one device.
struct MemoryInfo {
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
};

// One span of a Forward, resolved against the sequence table. Positions are token indices.
struct SpanPlan {
  int64_t start = 0;              // First new position.
  int32_t num_new_tokens = 0;     // K/V rows to write at start..start+num_new_tokens-1.
  int32_t num_queries = 0;        // Queries at positions kv_len-num_queries..kv_len-1.
  int64_t kv_len = 0;             // Positions attended: 0..kv_len-1.
  int64_t q_offset = 0;           // Row of the span's first query in q / out / lse.
  int64_t kv_offset = 0;          // Row of the span's first new token in k / v.
  int64_t page_table_offset = 0;  // Index into ForwardPlan::page_table of the span's first page.
  int32_t num_pages = 0;          // Pages covering 0..kv_len-1 (ceil(kv_len / page_size)).
  // The layer's committed length before this Forward. New rows below it overwrite committed
  // ones (a rewind): a backend that stops must put those back (Backend::Forward).
  int64_t committed_len = 0;

  // Rows [start, overwrite_end()) hold committed K/V that this Forward overwrites.
  int64_t overwrite_end() const { return std::min(committed_len, start + int64_t{num_new_tokens}); }
};

// Everything a backend needs to run one Forward. Pages are already reserved.
struct ForwardPlan {
  int32_t layer = 0;
  std::vector<SpanPlan> spans;
  std::vector<int32_t> page_table;  // Concatenated per-span page lists (pool page indices).
  int64_t total_queries = 0;
  int64_t total_new_tokens = 0;
  int32_t max_queries_per_span = 0;
  int64_t max_kv_len = 0;
  bool causal = true;
  float sm_scale = 0.f;
  bool return_lse = false;
  // The layer's variant (CacheGeometry::attention); null: plain attention.
  const LayerAttention* attention = nullptr;
  // Polled between pieces of work and once more before the backend returns OK.
  StopToken stop;
};

// Host buffers of one Forward. Inputs are the request's raw bytes (validated shapes).
struct ForwardIO {
  DType q_dtype = DType::kUnspecified;
  const void* q = nullptr;               // [total_queries, num_q_heads, head_dim]
  DType kv_dtype = DType::kUnspecified;  // Wire dtype of k and v (may differ from the cache's).
  const void* k = nullptr;  // [total_new_tokens, num_kv_heads, head_dim]; null when none.
  const void* v = nullptr;
  void* out = nullptr;   // [total_queries, num_q_heads, head_dim] in q_dtype.
  float* lse = nullptr;  // [total_queries, num_q_heads]; null unless return_lse.
  // Filled with the backend's phases (stage, h2d, kernel, d2h) when set.
  ForwardTimings* timings = nullptr;
  // When set (by the backend's own AcquireForwardBuffers): q, k and v lie in these (the caller
  // wrote them there), out and lse are null, and the backend leaves the answer in
  // buffers->out() and lse().
  ForwardBuffers* buffers = nullptr;
  // q, k, v, out and lse are addresses on the cache's device (memory a client registered,
  // ImportMemory): read and written there in place. Only where SupportsDeviceTensors.
  bool device_tensors = false;
  // Device tensors only, events of the client (ImportEvent's handle()): the work waits on the
  // GPU for wait_event before it reads q/k/v, and records done_event once out/lse are written;
  // with done_event the backend returns once the work is queued, without waiting for it.
  void* wait_event = nullptr;
  void* done_event = nullptr;
};

// An event of another process opened in this one (Backend::ImportEvent); closed when destroyed.
class ImportedEvent {
 public:
  virtual ~ImportedEvent() = default;
  virtual void* handle() const = 0;  // What ForwardIO::wait_event / done_event take.
};

// A device allocation of another process, mapped into this one (Backend::ImportMemory).
// Unmapped when destroyed.
class ImportedMemory {
 public:
  virtual ~ImportedMemory() = default;
  virtual char* base() const = 0;
  virtual int64_t size() const = 0;  // The whole allocation's bytes, as the driver knows it.
};

// The host memory of one Forward, from the backend that runs it: the caller writes the request's
// tensors into q(), k() and v() before Forward (on the CUDA backend this is pinned memory the
// copy to the device reads directly: the one host copy of a Forward's inputs), and reads the
// answer from out() and lse() after it (where the copy from the device lands: no further copy).
// Held until the answer has been sent; destroying it gives the memory back to the backend.
class ForwardBuffers {
 public:
  virtual ~ForwardBuffers() = default;
  // Input areas, sized as asked (AcquireForwardBuffers).
  virtual char* q() = 0;
  virtual char* k() = 0;
  virtual char* v() = 0;
  // The answer, after a Forward that was given these buffers returned OK.
  virtual const char* out() const = 0;
  virtual const float* lse() const = 0;  // null unless return_lse
};

// ForwardBuffers in plain heap memory: the default, for backends that compute on the host.
class HeapForwardBuffers final : public ForwardBuffers {
 public:
  HeapForwardBuffers(size_t q_bytes, size_t kv_bytes, size_t out_bytes, size_t lse_bytes)
      : q_(q_bytes), k_(kv_bytes), v_(kv_bytes), out_(out_bytes), lse_(lse_bytes / sizeof(float)) {}
  char* q() override { return q_.data(); }
  char* k() override { return k_.data(); }
  char* v() override { return v_.data(); }
  const char* out() const override { return out_.data(); }
  const float* lse() const override { return lse_.empty() ? nullptr : lse_.data(); }
  // Where the backend writes the answer.
  char* mutable_out() { return out_.data(); }
  float* mutable_lse() { return lse_.empty() ? nullptr : lse_.data(); }

 private:
  std::vector<char> q_, k_, v_, out_;
  std::vector<float> lse_;
};

// A pool of K/V pages owned by a backend. Layout per layer and per K/V:
// [num_pages][num_kv_heads][page_size][head_dim] in the cache's kv_dtype.
class KvPool {
 public:
  virtual ~KvPool() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;
  virtual std::string name() const = 0;         // "cpu" or "cuda".
  virtual std::string device_name() const = 0;  // CPU model or GPU name.
  virtual int device_count() const = 0;
  virtual absl::StatusOr<MemoryInfo> memory(int device) const = 0;
  // Compute capability of a device as "major.minor" ("9.0"); empty on the CPU backend.
  virtual std::string compute_capability(int /*device*/) const { return ""; }

  // Why the backend can serve nothing more until the process restarts (a CUDA error that leaves
  // a device's context unusable: every later call fails with it); empty while it can. Cheap
  // enough to poll: the server's health goes NOT_SERVING for good when it is not empty.
  virtual std::string Unrecoverable() const { return ""; }

  // Whether `device` runs a cache of this kv_dtype and head_dim (one its table lists): OK, or why
  // not (the device's shared memory a block, say). The default: every one.
  virtual absl::Status RunsHeadDim(int /*device*/, DType /*kv_dtype*/, int /*head_dim*/) const {
    return absl::OkStatus();
  }

  // Host memory for one Forward on `device` with inputs of these sizes (bytes of q, and of k and
  // of v each) and an answer of out_bytes (+ lse_bytes). The default: HeapForwardBuffers.
  virtual absl::StatusOr<std::unique_ptr<ForwardBuffers>> AcquireForwardBuffers(
      int /*device*/, size_t q_bytes, size_t kv_bytes, size_t out_bytes, size_t lse_bytes) {
    return std::make_unique<HeapForwardBuffers>(q_bytes, kv_bytes, out_bytes, lse_bytes);
  }

  // Maps another process's device allocation (handle: its cudaIpcMemHandle_t's bytes) on
  // `device`. INVALID_ARGUMENT for a handle that cannot be opened or lies on another device;
  // FAILED_PRECONDITION on a backend without device tensors (the default).
  virtual absl::StatusOr<std::unique_ptr<ImportedMemory>> ImportMemory(
      int /*device*/, const std::string& /*handle*/) {
    return absl::FailedPreconditionError(
        "device tensors (RegisterMemory, Tensor.device_buffer) need the CUDA backend; this server "
        "runs the " +
        name() + " backend: send the tensors' data instead");
  }

  // Opens another process's event (handle: its cudaIpcEventHandle_t's bytes) on `device`.
  virtual absl::StatusOr<std::unique_ptr<ImportedEvent>> ImportEvent(
      int /*device*/, const std::string& /*handle*/) {
    return absl::FailedPreconditionError("device events need the CUDA backend");
  }

  // Allocates the whole pool up front. RESOURCE_EXHAUSTED when it does not fit; the stop
  // token's status (and nothing held) when the caller gives up while it is being allocated.
  virtual absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry& geometry,
                                                               const StopToken& stop) = 0;

  // Writes each span's new K/V rows into its pages, then computes attention for its queries.
  // The plan and buffers are validated by the caller; a failure here is an internal error.
  // Concurrent calls on the same pool touch different layers (the cache serializes a layer).
  // Returns OK, after which the cache commits, or an error with every committed row of the
  // pool as it was: when plan.stop says stop (polled between pieces of work and once more just
  // before returning OK), the backend puts back the rows it overwrote (SpanPlan::committed_len)
  // and returns plan.stop's status.
  virtual absl::Status Forward(KvPool& pool, const CacheGeometry& geometry, const ForwardPlan& plan,
                               const ForwardIO& io) = 0;
};

}  // namespace pagedattn
