// RpcGate: the AttentionService calls in flight, so that shutdown can refuse new ones, wait for
// the rest, and finally tell those still running to stop (their StopTokens fire).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

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
  bool draining() const {
    absl::MutexLock lock(&mu_);
    return draining_;
  }
  // Waits until no call is in flight (but_waiting, or once StopAll: none but Step streams
  // waiting for a message, which have nothing to stop) or the deadline passes; true when none is.
  bool WaitIdle(absl::Time deadline, bool but_waiting = false) {
    absl::MutexLock lock(&mu_);
    auto idle = [this, but_waiting]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return in_flight_ - (but_waiting || stop_all_ ? waiting_ : 0) == 0;
    };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  // A Step stream in flight that waits for its next message (nothing of its own running or
  // unwritten) or no longer does: a drain's log names these apart from calls that did not stop,
  // and once the grace period is over they end at once.
  void SetWaiting(bool waiting) {
    absl::MutexLock lock(&mu_);
    waiting_ += waiting ? 1 : -1;
  }
  int64_t waiting() const {
    absl::MutexLock lock(&mu_);
    return waiting_;
  }
  // The calls in flight that are not waiting Step streams.
  int64_t busy() const {
    absl::MutexLock lock(&mu_);
    return in_flight_ - waiting_;
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
  int64_t waiting_ ABSL_GUARDED_BY(mu_) = 0;  // of in_flight_
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_all_ ABSL_GUARDED_BY(mu_) = false;
};

// Bytes of request and response data held by calls in flight, against a budget: a call that
// would go over it is refused (RESOURCE_EXHAUSTED, retry later) instead of growing the process.
class ByteBudget {
 public:
  // Bytes taken from a budget, given back when the Hold is destroyed.
  class Hold {
   public:
    Hold() = default;  // holds nothing
    Hold(Hold&& o) noexcept : budget_(std::exchange(o.budget_, nullptr)), bytes_(o.bytes_) {}
    Hold& operator=(Hold&& o) noexcept {
      if (this != &o) {
        Reset();
        budget_ = std::exchange(o.budget_, nullptr);
        bytes_ = o.bytes_;
      }
      return *this;
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { Reset(); }
    // Gives back what is held past `bytes` (a parse's bound, once the message's size is known).
    void ShrinkTo(int64_t bytes) {
      if (budget_ == nullptr || bytes >= bytes_) return;
      budget_->Release(bytes_ - std::max<int64_t>(bytes, 0));
      bytes_ = std::max<int64_t>(bytes, 0);
    }

   private:
    friend class ByteBudget;
    Hold(ByteBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
    void Reset() {
      if (budget_ != nullptr) budget_->Release(bytes_);
      budget_ = nullptr;
    }
    ByteBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  int64_t limit() const { return limit_; }
  // Takes n bytes if they fit (always, when nothing else is held: one call must be able to
  // run); nothing otherwise.
  std::optional<Hold> TryHold(int64_t n) {
    absl::MutexLock lock(&mu_);
    if (used_ > 0 && used_ + n > limit_) return std::nullopt;
    used_ += n;
    return Hold(this, n);
  }
  int64_t used() const {
    absl::MutexLock lock(&mu_);
    return used_;
  }

 private:
  void Release(int64_t n) {
    absl::MutexLock lock(&mu_);
    used_ -= n;
  }

  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pagedattn
