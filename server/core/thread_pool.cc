// ThreadPool: workers pick items of the oldest unfinished job by an atomic counter.
#include "server/core/thread_pool.h"

#include <algorithm>

namespace pagedattn {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i)
    workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunItems(Job& job) {
  for (int64_t i = job.next.fetch_add(1); i < job.n; i = job.next.fetch_add(1)) {
    if (!job.failed.load(std::memory_order_relaxed)) {
      try {
        (*job.fn)(i);
      } catch (...) {  // not past a worker (std::terminate) nor the caller (the job's frame)
        if (!job.failed.exchange(true)) job.error = std::current_exception();
      }
    }
    job.done.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);  // an exception leaves from here as it is
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(&job);
  }
  RunItems(job);
  {
    // Wait until every claimed item has finished, then unpublish the job.
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Job* j) { return j->done.load(std::memory_order_acquire) == j->n && j->workers == 0; },
        &job));
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
  }
  if (job.error) std::rethrow_exception(job.error);
}

void ThreadPool::WorkerLoop() {
  while (true) {
    Job* job = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stop_) return true;
        for (Job* j : jobs_) {
          if (j->next.load() < j->n) return true;
        }
        return false;
      };
      mu_.Await(absl::Condition(&has_work));
      if (stop_) return;
      for (Job* j : jobs_) {
        if (j->next.load() < j->n) {
          job = j;
          ++job->workers;  // The owner may not free the job until this drops to zero.
          break;
        }
      }
    }
    if (job != nullptr) {
      RunItems(*job);
      // Releasing mu_ wakes the job's owner (Await re-evaluates its condition).
      absl::MutexLock lock(&mu_);
      --job->workers;
    }
  }
}

}  // namespace pagedattn
