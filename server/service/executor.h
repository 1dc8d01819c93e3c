// Executor: a fixed set of threads running posted tasks, for work that must not block gRPC's own
// threads (the layers of a Step stream). Tasks are posted by owner (a tenant) and the threads
// take the owners in turn, one task each, each owner's tasks in the order posted: a tenant with
// a hundred tasks queued delays another's next task by one task's turn, not by the hundred. The
// destructor runs the tasks already posted, then joins.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
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

  void Post(std::function<void()> task, absl::string_view owner = {}) {
    absl::MutexLock lock(&mu_);
    auto [it, first] = tasks_.try_emplace(owner);
    it->second.push_back(std::move(task));
    if (first) turns_.emplace_back(owner);  // an owner with no task waiting joins the turns
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !turns_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (turns_.empty()) return;  // stopping, and nothing left to run
        // The next owner's oldest task; the owner goes to the back of the turns if it has more.
        std::string owner = std::move(turns_.front());
        turns_.pop_front();
        auto it = tasks_.find(owner);
        task = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) {
          tasks_.erase(it);
        } else {
          turns_.push_back(std::move(owner));
        }
      }
      task();
    }
  }

  absl::Mutex mu_;
  // Each owner's tasks not yet taken, and the owners that have some, in the order of their turns.
  absl::flat_hash_map<std::string, std::deque<std::function<void()>>> tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> turns_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace pagedattn
