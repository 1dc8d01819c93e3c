// SequenceTable: creation, growth, rewind, gaps, unknown sequences, release, and
// all-or-nothing reservations.
#include "server/core/sequence_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

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
  // One page short is said as one.
  t.Commit(*t.Reserve(0, {{3, 0, 12}}));  // 3 more used, none free
  r = t.Reserve(0, {{1, 8, 4}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("needs 1 more page of 4 tokens"), std::string::npos)
      << r.status().message();
}

TEST(SequenceTableTest, ExhaustionNamesThePagesRewindsWouldFree) {
  SequenceTable t(2, 4, 6);
  t.Commit(*t.Reserve(0, {{1, 0, 16}}));  // 4 pages
  t.Commit(*t.Reserve(1, {{1, 0, 6}}));   // layer 1 keeps 2 of them
  t.Commit(*t.Reserve(0, {{2, 0, 8}}));   // 2 pages: none free
  // Sequence 1's layer 0 rewinds to 5 tokens (its layers then need 2 pages, 2 unused) while
  // sequence 2 grows by a page: refused, since the rewind's pages are freed only at commit.
  absl::StatusOr<Reservation> r = t.Reserve(0, {{1, 4, 1}, {2, 8, 1}});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("its rewinds leave 2 pages unused"), std::string::npos)
      << r.status();
  EXPECT_EQ(t.Find(1)->layer_len[0], 16);
  // Without a rewind the message says nothing of one; attending (no new tokens) rewinds nothing.
  r = t.Reserve(0, {{1, 4, 0}, {2, 8, 1}});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message().find("rewind"), std::string::npos) << r.status();
  // As the message says: the truncate frees them, and the same Forward then fits.
  EXPECT_EQ(t.Truncate(0, 1, 4), 2);
  EXPECT_TRUE(t.Reserve(0, {{1, 4, 1}, {2, 8, 1}}).ok());
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

// A reservation that rewinds a layer keeps the old length's pages until it ends: other layers'
// commits, rollbacks and truncations in the meantime (their Forwards run at once) must not
// free them, or its rollback would restore a length whose pages other sequences now hold.
TEST(SequenceTableTest, RewindInFlightKeepsItsPagesWhileOtherLayersShrink) {
  for (int other : {0, 1, 2}) {  // another layer's rewind committed, rolled back; a truncation
    SCOPED_TRACE(other);
    SequenceTable t(3, 16, 12);
    for (int32_t l = 0; l < 3; ++l) t.Commit(*t.Reserve(l, {{1, 0, 64}}));  // 4 pages
    const std::vector<int32_t> pages = t.Find(1)->pages;
    absl::StatusOr<Reservation> rewind = t.Reserve(0, {{1, 0, 16}});  // layer 0 -> 16 tokens
    ASSERT_TRUE(rewind.ok());
    if (other == 2) {
      EXPECT_EQ(t.Truncate(1, 1, 16), 0);
      EXPECT_EQ(t.Truncate(2, 1, 16), 0);
    } else {
      for (int32_t l : {1, 2}) {
        absl::StatusOr<Reservation> r = t.Reserve(l, {{1, 0, 16}});
        ASSERT_TRUE(r.ok());
        if (other == 0)
          t.Commit(*r);
        else
          t.Rollback(*r);
      }
    }
    EXPECT_EQ(t.Find(1)->pages, pages);
    EXPECT_EQ(t.pool().num_free(), 8);
    // No other sequence can take them, and the rollback finds the old length covered.
    EXPECT_FALSE(t.Reserve(1, {{2, 0, 9 * 16}}).ok());
    t.Rollback(*rewind);
    EXPECT_EQ(t.Find(1)->layer_len[0], 64);
    EXPECT_EQ(t.Find(1)->pages, pages);
    EXPECT_EQ(t.pool().num_free(), 8);
    // Committed instead, the rewind frees what no layer needs any more.
    rewind = t.Reserve(0, {{1, 0, 16}});
    ASSERT_TRUE(rewind.ok());
    t.Commit(*rewind);
    EXPECT_EQ(t.Find(1)->pages.size(), other == 1 ? 4u : 1u);
    EXPECT_EQ(t.pool().num_free(), other == 1 ? 8 : 11);
  }
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

// Random writes, rewinds, attend-only spans, rollbacks, truncations and releases on several
// layers against a model of the lengths: after each, every sequence holds exactly the pages of
// its longest layer, the pool's count agrees, and a reservation fails for want of pages exactly
// when the model says it needs more than are free.
TEST(SequenceTableTest, PagesAlwaysCoverTheLongestLayerExactly) {
  constexpr int kLayers = 3, kPageSize = 4, kPages = 40;
  SequenceTable t(kLayers, kPageSize, kPages);
  std::map<uint64_t, std::vector<int64_t>> model;  // seq -> length per layer
  std::mt19937 rng(7);
  auto pages_for = [](int64_t n) { return (n + kPageSize - 1) / kPageSize; };
  auto longest = [](const std::vector<int64_t>& l) {
    return *std::max_element(l.begin(), l.end());
  };
  for (int op = 0; op < 3000; ++op) {
    const int32_t layer = static_cast<int32_t>(rng() % kLayers);
    const int kind = static_cast<int>(rng() % 10);
    if (kind == 0) {  // release
      const uint64_t id = 1 + rng() % 4;
      EXPECT_EQ(t.Release(id) >= 0, model.erase(id) == 1);
    } else if (kind == 1) {  // truncate
      const uint64_t id = 1 + rng() % 4;
      const int64_t to = static_cast<int64_t>(rng() % 30);
      t.Truncate(layer, id, to);
      if (auto it = model.find(id); it != model.end()) {
        it->second[layer] = std::min(it->second[layer], to);
        if (longest(it->second) == 0) model.erase(it);
      }
    } else {  // a Forward of one or two sequences: reserve, then commit or roll back
      std::vector<SpanWrite> spans;
      const uint64_t first = 1 + rng() % 4;
      for (uint64_t id : {first, first % 4 + 1}) {
        if (!spans.empty() && rng() % 2) break;
        auto it = model.find(id);
        const int64_t len = it == model.end() ? 0 : it->second[layer];
        const int64_t start = len == 0 ? 0 : static_cast<int64_t>(rng() % (len + 1));
        const int32_t n = static_cast<int32_t>(rng() % 3 == 0 ? 0 : 1 + rng() % 23);
        if (it == model.end() && n == 0) continue;  // would be NOT_FOUND: covered elsewhere
        spans.push_back({id, start, n});
      }
      if (spans.empty()) continue;
      int64_t needed = 0;
      for (const SpanWrite& s : spans) {
        if (s.num_new_tokens == 0) continue;
        auto it = model.find(s.seq_id);
        const int64_t have = it == model.end() ? 0 : pages_for(longest(it->second));
        needed += std::max<int64_t>(0, pages_for(s.start + s.num_new_tokens) - have);
      }
      const int64_t free_before = t.pool().num_free();
      absl::StatusOr<Reservation> r = t.Reserve(layer, spans);
      ASSERT_EQ(r.ok(), needed <= free_before) << "op " << op << ": " << r.status();
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      if (rng() % 4 == 0) {
        t.Rollback(*r);
        continue;
      }
      t.Commit(*r);
      for (const SpanWrite& s : spans) {
        if (s.num_new_tokens == 0) continue;  // attend-only: the length stays
        auto [it, created] = model.try_emplace(s.seq_id, std::vector<int64_t>(kLayers, 0));
        it->second[layer] = s.start + s.num_new_tokens;
        if (longest(it->second) == 0) model.erase(it);
      }
    }
    int64_t used = 0;
    for (const auto& [id, lens] : model) {
      const Sequence* seq = t.Find(id);
      ASSERT_NE(seq, nullptr) << "op " << op << ": sequence " << id;
      EXPECT_EQ(seq->layer_len, lens) << "op " << op;
      EXPECT_EQ(static_cast<int64_t>(seq->pages.size()), pages_for(longest(lens)))
          << "op " << op << ": sequence " << id;
      used += static_cast<int64_t>(seq->pages.size());
    }
    ASSERT_EQ(t.num_sequences(), static_cast<int64_t>(model.size())) << "op " << op;
    ASSERT_EQ(t.pool().num_free(), kPages - used) << "op " << op;
  }
}

}  // namespace
}  // namespace pagedattn
