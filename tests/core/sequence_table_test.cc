// SequenceTable: creation, growth, rewind, gaps, unknown sequences, release, and
// all-or-nothing reservations.
#include "server/core/sequence_table.h"

#include <gtest/gtest.h>

namespace pagedattn {
namespace {

TEST(SequenceTableTest, FirstWriteCreatesAndAllocatesCeilPages) {
  SequenceTable t(/*layers=*/2, /*page_size=*/16, /*pages=*/10);
  absl::StatusOr<Reservation> r = t.Reserve(0, {{7, 0, 17}});
  ASSERT_TRUE(r.ok()) << r.status();
  t.Commit(*r);
  const Sequence* s = t.Find(7);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->pages.size(), 2u);
  EXPECT_EQ(s->layer_len[0], 17);
  EXPECT_EQ(s->layer_len[1], 0);
  EXPECT_EQ(t.pool().num_free(), 8);
  // Layer 1 reuses the pages of layer 0.
  r = t.Reserve(1, {{7, 0, 20}});
  ASSERT_TRUE(r.ok());
  t.Commit(*r);
  EXPECT_EQ(t.Find(7)->pages.size(), 2u);
  EXPECT_EQ(t.pool().num_free(), 8);
}

TEST(SequenceTableTest, RewindShrinksOnlyPastEveryLayer) {
  SequenceTable t(2, 4, 10);
  t.Commit(*t.Reserve(0, {{1, 0, 12}}));  // 3 pages
  t.Commit(*t.Reserve(1, {{1, 0, 5}}));
  t.Commit(*t.Reserve(0, {{1, 2, 1}}));  // layer 0 rewinds to 3 tokens; layer 1 keeps 5
  EXPECT_EQ(t.Find(1)->layer_len[0], 3);
  EXPECT_EQ(t.Find(1)->pages.size(), 2u);
  EXPECT_EQ(t.pool().num_free(), 8);
}

TEST(SequenceTableTest, GapIsFailedPrecondition) {
  SequenceTable t(1, 4, 10);
  t.Commit(*t.Reserve(0, {{1, 0, 3}}));
  absl::StatusOr<Reservation> r = t.Reserve(0, {{1, 4, 1}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("start=4"), std::string::npos);
  r = t.Reserve(0, {{2, 1, 1}});  // new sequence must start at 0
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Find(2), nullptr);
}

TEST(SequenceTableTest, AttendOnlyOnUnknownSequenceIsNotFound) {
  SequenceTable t(1, 4, 10);
  EXPECT_EQ(t.Reserve(0, {{9, 0, 0}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.num_sequences(), 0);
}

TEST(SequenceTableTest, ExhaustionChangesNothing) {
  SequenceTable t(1, 4, 5);
  t.Commit(*t.Reserve(0, {{1, 0, 8}}));  // 2 pages used, 3 free
  // First span fits (1 more page), second needs 3: together 4 > 3.
  absl::StatusOr<Reservation> r = t.Reserve(0, {{1, 8, 4}, {2, 0, 12}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("needs 4 more pages"), std::string::npos);
  EXPECT_EQ(t.Find(1)->layer_len[0], 8);
  EXPECT_EQ(t.Find(1)->pages.size(), 2u);
  EXPECT_EQ(t.Find(2), nullptr);
  EXPECT_EQ(t.pool().num_free(), 3);
}

TEST(SequenceTableTest, RollbackRestoresEverything) {
  SequenceTable t(1, 4, 10);
  t.Commit(*t.Reserve(0, {{1, 0, 8}}));
  const std::vector<int32_t> pages_before = t.Find(1)->pages;
  absl::StatusOr<Reservation> r = t.Reserve(0, {{1, 8, 5}, {2, 0, 3}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(t.pool().num_free(), 5);
  t.Rollback(*r);
  EXPECT_EQ(t.Find(1)->layer_len[0], 8);
  EXPECT_EQ(t.Find(1)->pages, pages_before);
  EXPECT_EQ(t.Find(2), nullptr);
  EXPECT_EQ(t.pool().num_free(), 8);
}

TEST(SequenceTableTest, ReleaseFreesAllLayers) {
  SequenceTable t(2, 4, 10);
  t.Commit(*t.Reserve(0, {{1, 0, 9}}));
  t.Commit(*t.Reserve(1, {{1, 0, 2}}));
  EXPECT_EQ(t.Release(1), 3);
  EXPECT_EQ(t.Release(1), -1);
  EXPECT_EQ(t.pool().num_free(), 10);
  EXPECT_EQ(t.num_sequences(), 0);
}

TEST(SequenceTableTest, AttendOnlySpanKeepsLength) {
  SequenceTable t(1, 4, 10);
  t.Commit(*t.Reserve(0, {{1, 0, 9}}));
  absl::StatusOr<Reservation> r = t.Reserve(0, {{1, 5, 0}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->entries[0].kv_len, 5);
  t.Commit(*r);
  EXPECT_EQ(t.Find(1)->layer_len[0], 9);  // attending a prefix rewinds nothing
}

}  // namespace
}  // namespace pagedattn
