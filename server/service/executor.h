// Executor: a fixed set of threads running posted tasks in order of posting (FIFO), for work
// that must not block gRPC's own threads (the layers of a Step stream). The destructor runs
// the tasks already posted, then joins.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pagedattn {

class Executor {
 public:
  explicit Executor(int num_threads) {
    for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~Executor() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !tasks_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (tasks_.empty()) return;  // stopping, and nothing left to run
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace pagedattn
