// StopToken: whether the caller still wants an operation — not cancelled, not past its
// deadline, the server not shutting down — polled by long operations between pieces of work.
#pragma once

#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pagedattn {

class StopToken {
 public:
  // Never stops.
  StopToken() = default;
  // Stops once cancelled() returns true (it is polled; it must be cheap and thread-safe) or
  // once deadline has passed.
  StopToken(std::function<bool()> cancelled, absl::Time deadline)
      : cancelled_(std::move(cancelled)), deadline_(deadline) {}

  // OK while the work should go on; CANCELLED or DEADLINE_EXCEEDED once it should stop.
  absl::Status Check() const {
    if (cancelled_ && cancelled_()) {
      return absl::CancelledError(
          "the call was cancelled (by the caller, or the server is shutting down); nothing was "
          "changed");
    }
    if (deadline_ != absl::InfiniteFuture() && absl::Now() > deadline_) {
      return absl::DeadlineExceededError(
          "the call's deadline passed before it finished; nothing was changed");
    }
    return absl::OkStatus();
  }

 private:
  std::function<bool()> cancelled_;
  absl::Time deadline_ = absl::InfiniteFuture();
};

}  // namespace pagedattn
