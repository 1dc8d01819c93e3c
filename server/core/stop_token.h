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
  // Stops once cancelled() returns true (it is polled; it must be cheap and thread-safe), once
  // deadline has passed, or once shutting_down() returns true (polled likewise).
  StopToken(std::function<bool()> cancelled, absl::Time deadline,
            std::function<bool()> shutting_down = {})
      : cancelled_(std::move(cancelled)),
        shutting_down_(std::move(shutting_down)),
        deadline_(deadline) {}

  // OK while the work should go on; UNAVAILABLE (the server stopped it: a retry elsewhere
  // works), CANCELLED or DEADLINE_EXCEEDED once it should stop.
  absl::Status Check() const {
    if (shutting_down_ && shutting_down_()) {
      return absl::UnavailableError(
          "the server is shutting down and stopped the call before it finished; nothing was "
          "changed: retry (on another replica)");
    }
    // The deadline first: gRPC cancels a call whose deadline passed too, and that call is
    // DEADLINE_EXCEEDED (logged and counted so: the server too slow, not a caller giving up).
    if (deadline_ != absl::InfiniteFuture() && absl::Now() > deadline_) {
      return absl::DeadlineExceededError(
          "the call's deadline passed before it finished; nothing was changed");
    }
    if (cancelled_ && cancelled_()) {
      return absl::CancelledError("the call was cancelled by its caller; nothing was changed");
    }
    return absl::OkStatus();
  }

 private:
  std::function<bool()> cancelled_;
  std::function<bool()> shutting_down_;
  absl::Time deadline_ = absl::InfiniteFuture();
};

}  // namespace pagedattn
