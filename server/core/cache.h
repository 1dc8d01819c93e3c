// Cache: one paged KV cache — its geometry, its pool on a backend, its sequence table — and
// the Forward operation: validate everything, reserve pages, write K/V, attend, commit.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/core/backend.h"
#include "server/core/sequence_table.h"
#include "server/core/tensor.h"

namespace pagedattn {

struct SpanRequest {
  uint64_t seq_id = 0;
  int64_t start = 0;
  int32_t num_new_tokens = 0;
  int32_t num_queries = 0;
};

struct ForwardArgs {
  int32_t layer = 0;
  std::vector<SpanRequest> spans;
  TensorView q;  // [total_queries, num_q_heads, head_dim]
  TensorView k;  // [total_new_tokens, num_kv_heads, head_dim]; empty when nothing is appended.
  TensorView v;
  std::optional<bool> causal;     // Default true.
  std::optional<float> sm_scale;  // Default 1/sqrt(head_dim).
  bool return_lse = false;
  // When set, q, k and v lie in these backend buffers and the answer is left in them
  // (ForwardResult::out and lse stay empty). From the backend's AcquireForwardBuffers.
  ForwardBuffers* buffers = nullptr;
  // q, k and v are device tensors (their data: addresses on the cache's device, or null while
  // only being checked), and the answer is written to out and lse, which then are required:
  // out as q (dtype and shape), lse [total_queries, num_q_heads] FLOAT32 iff return_lse.
  bool device_tensors = false;
  TensorView out;
  TensorView lse;
  // Device tensors only: ForwardIO::wait_event / done_event (ImportedEvent handles).
  void* wait_event = nullptr;
  void* done_event = nullptr;
};

struct ForwardResult {
  DType out_dtype = DType::kUnspecified;
  std::vector<int64_t> out_shape;  // [total_queries, num_q_heads, head_dim]
  std::string out;                 // Raw bytes in out_dtype (empty when ForwardArgs::buffers).
  std::vector<int64_t> lse_shape;  // [total_queries, num_q_heads] when asked.
  std::string lse;                 // Raw float32 bytes when asked.
};

// Where one Forward's time went, microseconds: for the phase metrics and the caller's timing.
struct ForwardTimings {
  double validate_us = 0;  // Request checks, the wait for the layer, reserving pages, the plan.
  double stage_us = 0;     // Host-side preparation in the backend (work plan, staging copies).
  double submit_us = 0;    // CUDA: host time queuing the copies, event waits and kernels.
  double h2d_us = 0;       // CUDA: the copy to the device.
  double kernel_us = 0;    // CUDA: the kernels' GPU time; CPU: the append and attention.
  double d2h_us = 0;       // CUDA: the copy back.
  double commit_us = 0;    // Committing (or rolling back) the sequence table.
  // Answered once queued (ForwardIO::done_event): h2d, kernel and d2h were not measured.
  bool queued = false;
};

struct CacheStats {
  int64_t free_pages = 0;
  int64_t used_pages = 0;
  int64_t live_sequences = 0;
  int64_t forward_calls = 0;
  // Since the last Forward, release or truncate (its creation before any): how long the cache
  // has gone unused.
  int64_t idle_ms = 0;
};

struct TruncateResult {
  int64_t truncated = 0;
  int64_t freed_pages = 0;
  std::vector<uint64_t> unknown_seq_ids;
};

struct ReleaseResult {
  int64_t released = 0;
  int64_t freed_pages = 0;
  std::vector<uint64_t> unknown_seq_ids;
};

// Forward requests larger than these are refused (per request): INVALID_ARGUMENT for spans
// and tokens, RESOURCE_EXHAUSTED for an answer larger than the transport may send.
struct ForwardLimits {
  int64_t max_spans = 65536;
  int64_t max_tokens = 1 << 20;    // Queries plus new tokens.
  int64_t max_response_bytes = 0;  // The server's largest message; 0: no limit.
};

// Bytes a Forward's response holds beside its tensors' data (field tags, shapes, dtypes),
// rounded up: what the response-size check adds to out and lse.
inline constexpr int64_t kResponseFramingBytes = 256;

// The dtype of a Forward's out: q's; with q unset (an append-only Forward, its out empty) the
// cache's, or bfloat16 for an FP8 cache (FP8 is a cache's storage, never a tensor's dtype).
DType ForwardOutDType(const CacheGeometry& geometry, const ForwardArgs& args);

// Bytes of a Forward's out (in ForwardOutDType) and of its lse (float32; 0 unless asked).
struct ForwardOutputBytes {
  int64_t out = 0;
  int64_t lse = 0;
};
ForwardOutputBytes ForwardOutputSizes(const CacheGeometry& geometry, const ForwardArgs& args);

// Bytes of a Forward's answer: out, lse when asked, and kResponseFramingBytes.
int64_t ForwardResponseBytes(const CacheGeometry& geometry, const ForwardArgs& args);

class Cache {
 public:
  Cache(std::string id, std::string name, std::string owner, const CacheGeometry& geometry,
        std::unique_ptr<KvPool> pool, Backend* backend, int64_t created_unix_ms,
        ForwardLimits limits = {}, uint64_t serial = 0);

  const std::string& id() const { return id_; }
  const std::string& name() const { return name_; }
  const std::string& owner() const { return owner_; }
  const CacheGeometry& geometry() const { return geometry_; }
  int64_t created_unix_ms() const { return created_unix_ms_; }
  // Its place in its CacheManager's creations (1, 2, ...): listings' order, exact where the
  // clock's milliseconds are not (two caches in one millisecond, a clock set back).
  uint64_t serial() const { return serial_; }

  // Appends and attends. On any error the cache is exactly as it was before the call; that
  // includes the stop token's status when the caller gives up before the Forward commits.
  absl::StatusOr<ForwardResult> Forward(const ForwardArgs& args, const StopToken& stop = {},
                                        ForwardTimings* timings = nullptr);
  // The checks of Forward that need no data: layer, spans, limits, tensor dtypes, shapes and
  // sizes (a tensor's data pointer may be null), sm_scale, the answer's size.
  absl::Status Check(const ForwardArgs& args) const { return ValidateForward(args); }
  // Frees the sequences' pages in every layer (an id given twice counts once). Waits for
  // in-flight Forwards.
  ReleaseResult Release(absl::Span<const uint64_t> seq_ids);
  // Shortens each (seq_id, length) in `layer` to at most length tokens. INVALID_ARGUMENT (and
  // nothing changed) for a layer out of range, a negative length or a seq_id given twice. Waits
  // for in-flight Forwards on the layer.
  absl::StatusOr<TruncateResult> Truncate(int32_t layer,
                                          absl::Span<const std::pair<uint64_t, int64_t>> lengths);
  CacheStats Stats() const;

  // When a Forward, release or truncate last came to the cache or ended (its creation before
  // any), on the monotonic clock: what an idle timeout measures from. Failed calls count: their
  // caller is alive.
  std::chrono::steady_clock::time_point last_used() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(last_used_.load(std::memory_order_relaxed)));
  }
  // Whether a Forward, release or truncate is running on the cache or waiting for it: a cache
  // in use is never idle, however long ago its calls began.
  bool in_use() const { return calls_in_flight_.load(std::memory_order_relaxed) > 0; }
  // Restarts the idle clock (a call's lookup: CacheManager::GetToUse).
  void MarkUsed() {
    last_used_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                     std::memory_order_relaxed);
  }

 private:
  // A call on the cache, from its start to its end (in_use(), last_used()).
  class Call {
   public:
    explicit Call(Cache* cache) : cache_(cache) {
      cache_->calls_in_flight_.fetch_add(1, std::memory_order_relaxed);
      cache_->MarkUsed();
    }
    ~Call() {
      cache_->MarkUsed();
      cache_->calls_in_flight_.fetch_sub(1, std::memory_order_relaxed);
    }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    Cache* const cache_;
  };

  // Checks a request against the geometry and limits without touching the cache.
  absl::Status ValidateForward(const ForwardArgs& args) const;

  // Builds the backend plan from a reservation: resolved spans and their page lists.
  ForwardPlan MakePlan(const ForwardArgs& args, const Reservation& r) const
      ABSL_SHARED_LOCKS_REQUIRED(meta_mu_);

  const std::string id_;
  const std::string name_;
  const std::string owner_;
  const CacheGeometry geometry_;
  const std::unique_ptr<KvPool> pool_;
  Backend* const backend_;
  const int64_t created_unix_ms_;
  const ForwardLimits limits_;
  const uint64_t serial_;

  // Lock order: structure_mu_ (shared for Forward, exclusive for Release), then the layer's
  // mutex (one Forward per layer at a time; different layers run concurrently), then meta_mu_
  // (sequence table, held only for bookkeeping, never during compute).
  absl::Mutex structure_mu_;
  std::vector<std::unique_ptr<absl::Mutex>> layer_mu_;
  mutable absl::Mutex meta_mu_;
  SequenceTable table_ ABSL_GUARDED_BY(meta_mu_);
  std::atomic<int64_t> forward_calls_{0};
  std::atomic<int> calls_in_flight_{0};
  std::atomic<std::chrono::steady_clock::rep> last_used_{
      std::chrono::steady_clock::now().time_since_epoch().count()};
};

}  // namespace pagedattn
