// ThreadPool: a fixed set of workers and a blocking ParallelFor in which the calling thread
// also works. Several callers may run ParallelFor at once; each waits only for its own items.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pagedattn {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for i in [0, n) across the workers and the caller; returns when all are done.
  // An exception from fn (std::bad_alloc where memory runs out) ends the items not yet begun
  // and is rethrown here, in the caller, once every item under way has finished.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Job {
    const std::function<void(int64_t)>* fn;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int workers = 0;  // Workers holding a pointer to this job; guarded by mu_.
    std::atomic<bool> failed{false};
    std::exception_ptr error;  // The first item's exception; written by whoever set failed.
  };
  void WorkerLoop();
  static void RunItems(Job& job);

  absl::Mutex mu_;
  std::vector<Job*> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace pagedattn
