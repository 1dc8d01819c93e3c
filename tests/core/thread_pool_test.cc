// ThreadPool: every index runs exactly once, on several threads at once, also with concurrent
// callers; an item's exception reaches the caller.
#include "server/core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <new>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pagedattn {
namespace {

TEST(ThreadPoolTest, EachIndexRunsOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1000);
  pool.ParallelFor(1000, [&](int64_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

// The items run at once on the caller and the workers, not one after another: each of four
// items waits (5 s at most) until all four have started.
TEST(ThreadPoolTest, ItemsRunAtOnceOnEveryThread) {
  ThreadPool pool(4);
  absl::Mutex mu;
  int started = 0;
  std::vector<bool> met(4, false);
  auto all_started = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return started == 4; };
  pool.ParallelFor(4, [&](int64_t i) {
    absl::MutexLock lock(&mu);
    ++started;
    met[i] = mu.AwaitWithTimeout(absl::Condition(&all_started), absl::Seconds(5));
  });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(met[i]) << "item " << i << " ran alone";
}

TEST(ThreadPoolTest, ConcurrentCallersEachGetTheirOwnItems) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::vector<int64_t> sums(6, 0);
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&, c] {
      std::atomic<int64_t> sum{0};
      for (int rep = 0; rep < 50; ++rep) pool.ParallelFor(100, [&](int64_t i) { sum += i; });
      sums[c] = sum.load();
    });
  }
  for (auto& t : callers) t.join();
  for (int64_t s : sums) EXPECT_EQ(s, 50 * 4950);
}

// An item that throws (std::bad_alloc where memory ran out) neither ends the process (on a
// worker) nor leaves the job's frame while workers use it (on the caller): the caller gets the
// exception once the items under way have finished, and the pool works on.
TEST(ThreadPoolTest, AnItemsExceptionReachesTheCaller) {
  ThreadPool pool(4);
  for (int64_t bad : {0, 1, 500, 999}) {
    std::atomic<int> running{0}, max_after{0};
    std::atomic<bool> thrown{false};
    EXPECT_THROW(pool.ParallelFor(1000,
                                  [&](int64_t i) {
                                    running.fetch_add(1);
                                    if (i == bad) {
                                      thrown = true;
                                      running.fetch_sub(1);
                                      throw std::bad_alloc();
                                    }
                                    std::this_thread::yield();
                                    running.fetch_sub(1);
                                  }),
                 std::bad_alloc)
        << bad;
    EXPECT_TRUE(thrown);
    EXPECT_EQ(running.load(), 0) << "an item still ran after ParallelFor returned";
  }
  std::vector<std::atomic<int>> hits(100);
  pool.ParallelFor(100, [&](int64_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

}  // namespace
}  // namespace pagedattn
