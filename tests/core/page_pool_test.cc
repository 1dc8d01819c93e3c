// PagePool: allocation, exhaustion without side effects, reuse.
#include "server/core/page_pool.h"

#include <gtest/gtest.h>

#include <set>

namespace pagedattn {
namespace {

TEST(PagePoolTest, AllocatesDistinctPagesUntilFull) {
  PagePool pool(10);
  std::set<int32_t> seen;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<std::vector<int32_t>> p = pool.Allocate(2);
    ASSERT_TRUE(p.ok());
    for (int32_t x : *p) {
      EXPECT_GE(x, 0);
      EXPECT_LT(x, 10);
      EXPECT_TRUE(seen.insert(x).second) << "page handed out twice: " << x;
    }
  }
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_EQ(pool.num_used(), 10);
}

TEST(PagePoolTest, ExhaustionTakesNothing) {
  PagePool pool(4);
  ASSERT_TRUE(pool.Allocate(3).ok());
  absl::StatusOr<std::vector<int32_t>> p = pool.Allocate(2);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_TRUE(pool.Allocate(1).ok());
}

TEST(PagePoolTest, FreedPagesAreReused) {
  PagePool pool(3);
  std::vector<int32_t> a = *pool.Allocate(3);
  pool.Free({a[1]});
  EXPECT_EQ(pool.num_free(), 1);
  std::vector<int32_t> b = *pool.Allocate(1);
  EXPECT_EQ(b[0], a[1]);
  pool.Free({a[0], a[2]});
  pool.Free(b);
  EXPECT_EQ(pool.num_free(), 3);
  std::vector<int32_t> c = *pool.Allocate(3);
  EXPECT_EQ(std::set<int32_t>(c.begin(), c.end()), (std::set<int32_t>{0, 1, 2}));
}

TEST(PagePoolTest, HugePoolCostsNothingUpFront) {
  PagePool pool(int64_t{1} << 31);
  EXPECT_EQ(pool.num_free(), int64_t{1} << 31);
  EXPECT_EQ((*pool.Allocate(3)).size(), 3u);
}

}  // namespace
}  // namespace pagedattn
