// PeriodicTask: runs a function every interval on a thread of its own until destroyed (the
// server's sweep of idle caches, the memory registry's of expired leases).
#pragma once

#include <functional>
#include <thread>
#include <utility>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace pagedattn {

class PeriodicTask {
 public:
  PeriodicTask(absl::Duration interval, std::function<void()> fn)
      : thread_([this, interval, fn = std::move(fn)] {
          while (!stop_.WaitForNotificationWithTimeout(interval)) fn();
        }) {}
  // Waits for a run in progress to end.
  ~PeriodicTask() {
    stop_.Notify();
    thread_.join();
  }
  PeriodicTask(const PeriodicTask&) = delete;
  PeriodicTask& operator=(const PeriodicTask&) = delete;

 private:
  absl::Notification stop_;  // before thread_: it exists when the thread starts
  std::thread thread_;
};

}  // namespace pagedattn
