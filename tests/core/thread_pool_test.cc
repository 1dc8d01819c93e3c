// ThreadPool: every index runs exactly once, also with concurrent callers.
#include "server/core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace pagedattn {
namespace {

TEST(ThreadPoolTest, EachIndexRunsOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1000);
  pool.ParallelFor(1000, [&](int64_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
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

}  // namespace
}  // namespace pagedattn
