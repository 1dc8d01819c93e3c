// RpcGate: the AttentionService calls in flight, so that shutdown can refuse new ones, wait for
// the rest, and finally tell those still running to stop (their StopTokens fire).
#pragma once

#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pagedattn {

class RpcGate {
 public:
  // True when the call may run (then Leave() must follow); false once draining.
  bool Enter() {
    absl::MutexLock lock(&mu_);
    if (draining_) return false;
    ++in_flight_;
    return true;
  }
  void Leave() {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  // From now on Enter() refuses.
  void StartDraining() {
    absl::MutexLock lock(&mu_);
    draining_ = true;
  }
  // Waits until no call is in flight or the deadline passes; true when none is.
  bool WaitIdle(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  // Calls still in flight should stop now (read by their StopTokens).
  void StopAll() {
    absl::MutexLock lock(&mu_);
    stop_all_ = true;
  }
  bool stopping() const {
    absl::MutexLock lock(&mu_);
    return stop_all_;
  }
  int64_t in_flight() const {
    absl::MutexLock lock(&mu_);
    return in_flight_;
  }

 private:
  mutable absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_all_ ABSL_GUARDED_BY(mu_) = false;
};

// Bytes of request and response data held by calls in flight, against a budget: a call that
// would go over it is refused (RESOURCE_EXHAUSTED, retry later) instead of growing the process.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  int64_t limit() const { return limit_; }
  // Takes n bytes if they fit (always, when nothing else is held: one call must be able to
  // run); false otherwise.
  bool TryAcquire(int64_t n) {
    absl::MutexLock lock(&mu_);
    if (used_ > 0 && used_ + n > limit_) return false;
    used_ += n;
    return true;
  }
  void Release(int64_t n) {
    absl::MutexLock lock(&mu_);
    used_ -= n;
  }
  int64_t used() const {
    absl::MutexLock lock(&mu_);
    return used_;
  }

 private:
  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pagedattn
