// The host side of the kernel library, without a GPU: the split-KV planner (tiles, chunks, the
// separate merge, first pages, the prefill schedule) and AttentionPlan's slots, staging and params.
#include "kernels/attention_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/capabilities.h"
#include "kernels/attention_work.h"
#include "kernels/dispatch.h"

namespace pagedattn {
namespace {

// The split-KV planner needs no GPU: every (tile, position) is covered exactly once.
TEST(AttentionPlan, CoversEveryPositionOnce) {
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 1, 10000}, {1, 700, 3, 5}, {4, 701, 200, 900}, {204, 800, 0, 50}};
  for (bool causal : {true, false}) {
    for (int target : {1, 132, 264, 5000}) {
      kernels::AttentionWork work;
      kernels::PlanAttentionWork(spans.data(), 4, 32, 8, causal, /*window=*/0,
                                 {.target_blocks = target, .min_chunk = 64}, &work);
      // coverage[span][row_start] -> positions covered
      std::map<std::pair<int, int>, int64_t> covered;
      for (const auto* list : {&work.decode_items, &work.decode_wide_items, &work.prefill_items}) {
        for (const auto& it : *list) {
          EXPECT_LT(it.kv_start, it.kv_end);
          covered[{it.span, it.row_start}] += it.kv_end - it.kv_start;
        }
      }
      for (const auto& [key, n] : covered) {
        const auto& sp = spans[key.first];
        const int group = 4;
        const int rows = sp.num_queries * group;
        const int tile = rows <= kernels::kDecodeTileRows       ? kernels::kDecodeTileRows
                         : rows <= kernels::kDecodeWideTileRows ? kernels::kDecodeWideTileRows
                                                                : kernels::kPrefillTileRows;
        const int last_row = std::min(key.second + tile, rows) - 1;
        const int64_t want = causal ? sp.kv_len - sp.num_queries + last_row / group + 1 : sp.kv_len;
        EXPECT_EQ(n, want) << "span " << key.first << " row " << key.second;
      }
      EXPECT_EQ(covered.count({3, 0}), 0u);  // no queries, no work
    }
  }
}

// A sliding window: each tile's range starts where its first query's window does (a decode tile
// exactly, a prefill tile on the KV tile boundary below) and is covered once, up to its end.
TEST(AttentionPlan, WindowStartsEachTileAtItsWindow) {
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 1, 10000}, {1, 700, 3, 5}, {4, 701, 200, 900}, {204, 800, 8, 4100}};
  constexpr int kWindow = 300, kGroup = 4;
  for (bool causal : {true, false}) {
    for (int target : {1, 264, 5000}) {
      kernels::AttentionWork work;
      kernels::PlanAttentionWork(spans.data(), 4, 32, 8, causal, kWindow,
                                 {.target_blocks = target, .min_chunk = 64}, &work);
      std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> ranges;
      for (const auto* list : {&work.decode_items, &work.decode_wide_items, &work.prefill_items}) {
        for (const auto& it : *list) ranges[{it.span, it.row_start}].push_back({it.kv_start, it.kv_end});
      }
      ASSERT_EQ(ranges.size(), 1u + 1u + 7u + 1u) << "tiles: 16, 16, 7 x 128 (800 rows), 32";
      for (auto& [key, parts] : ranges) {
        const auto& sp = spans[key.first];
        const int rows = sp.num_queries * kGroup;
        const bool prefill = rows > kernels::kDecodeWideTileRows;
        const int tile = prefill ? kernels::kPrefillTileRows : rows;
        const int first_pos = sp.kv_len - sp.num_queries;
        int begin = std::max(0, first_pos + key.second / kGroup - kWindow + 1);
        if (prefill) begin -= begin % kernels::kKvTileRows;
        const int last_row = std::min(key.second + tile, rows) - 1;
        const int end = causal ? first_pos + last_row / kGroup + 1 : sp.kv_len;
        std::sort(parts.begin(), parts.end());
        int at = begin;
        for (const auto& [s, e] : parts) {
          EXPECT_EQ(s, at) << "span " << key.first << " row " << key.second;
          EXPECT_LT(s, e);
          at = e;
        }
        EXPECT_EQ(at, end) << "span " << key.first << " row " << key.second;
      }
    }
  }
}

// One long decode on 8 kv heads fills the 264 block slots with equal splits cut at any position
// (not only at 64-position tiles), each position in exactly one split, the splits contiguous.
TEST(AttentionPlan, OneWaveOfEqualUnalignedSplits) {
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 32768}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 1, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  ASSERT_EQ(work.decode_items.size(), 33u) << "kv_chunk " << work.kv_chunk;
  EXPECT_EQ(work.kv_chunk, 993);
  int32_t next = 0;
  for (const auto& it : work.decode_items) {
    EXPECT_EQ(it.kv_start, next);
    EXPECT_LE(it.kv_end - it.kv_start, 993);
    next = it.kv_end;
  }
  EXPECT_EQ(next, 32768);
  // A prefill tile in the plan keeps chunks at whole KV tiles.
  // (Without that rule this plan would cut 334-position chunks.)
  std::vector<kernels::AttentionSpan> mixed = {{0, 0, 1, 2000}, {1, 2048, 100, 1000}};
  kernels::PlanAttentionWork(mixed.data(), 2, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  EXPECT_LT(work.kv_chunk, 2000) << "the plan splits";
  EXPECT_EQ(work.kv_chunk % kernels::kKvTileRows, 0) << "kv_chunk " << work.kv_chunk;
}

// A plan without splits has no merge, so its waves count every resident block (unsplit_blocks);
// a split plan's count only those that leave room for a merge block (target_blocks): at head_dim
// 64 on 132 SMs, 396 and 528.
TEST(AttentionPlan, UnsplitPlanCountsWavesInAllResidentBlocks) {
  std::vector<kernels::AttentionSpan> batch;
  for (int i = 0; i < 64; ++i) batch.push_back({i, i * 256, 1, 4096});
  kernels::AttentionWork work;
  // 512 (sequence, kv head) blocks: two waves of 396, so the plan splits...
  kernels::PlanAttentionWork(batch.data(), 64, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 396},
                             &work);
  EXPECT_LT(work.kv_chunk, 4096);
  // ...but one wave of 528: no split, no merge.
  kernels::PlanAttentionWork(batch.data(), 64, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 396, .unsplit_blocks = 528}, &work);
  EXPECT_EQ(work.kv_chunk, 4096);
  EXPECT_EQ(work.decode_items.size(), 64u);
  EXPECT_TRUE(work.merge_tasks.empty());
  // A plan that splits either way is planned in waves of target_blocks alone.
  std::vector<kernels::AttentionSpan> one = {{0, 0, 1, 32768}};
  kernels::PlanAttentionWork(one.data(), 1, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 396}, &work);
  const int32_t chunk = work.kv_chunk;
  const size_t items = work.decode_items.size();
  EXPECT_LT(chunk, 32768);
  kernels::PlanAttentionWork(one.data(), 1, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 396, .unsplit_blocks = 528}, &work);
  EXPECT_EQ(work.kv_chunk, chunk);
  EXPECT_EQ(work.decode_items.size(), items);
  // So is a plan with a prefill tile (the prefill kernels' residency is not the decode tile's):
  // 56 decode tiles and one of 32 queries x 4 heads, 456 blocks, split as with 396 alone.
  std::vector<kernels::AttentionSpan> mixed(batch.begin(), batch.begin() + 56);
  mixed.push_back({56, 56 * 256, 32, 4096});
  kernels::PlanAttentionWork(mixed.data(), 57, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 396},
                             &work);
  const int32_t mixed_chunk = work.kv_chunk;
  EXPECT_LT(mixed_chunk, 4096);
  kernels::PlanAttentionWork(mixed.data(), 57, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 396, .unsplit_blocks = 528}, &work);
  EXPECT_EQ(work.kv_chunk, mixed_chunk);
}

// Where tiles whose blocks run fewer an SM keep most of their rate (FP8's 0.85 at two of three),
// an unsplit plan whose last wave would hold few blocks asks for one block an SM fewer: on 132
// SMs, 512 blocks (1.29 waves of 396) run as two waves of 264; 1024 and 2048 (2.59 and 5.17
// waves) and a split plan keep every block; without a measured rate nothing changes.
TEST(AttentionPlan, ShortLastWaveRunsOneBlockAnSmFewer) {
  const kernels::AttentionPlanLimits fp8 = {.target_blocks = 264,
                                            .unsplit_blocks = 396,
                                            .decode_blocks_per_sm = 3,
                                            .fewer_blocks_rate = 0.85};
  auto blocks_per_sm = [](int seqs, int ctx, const kernels::AttentionPlanLimits& limits) {
    std::vector<kernels::AttentionSpan> batch;
    for (int i = 0; i < seqs; ++i) batch.push_back({i, i * 256, 1, ctx});
    kernels::AttentionWork work;
    kernels::PlanAttentionWork(batch.data(), seqs, 32, 8, /*causal=*/true, /*window=*/0, limits,
                               &work);
    EXPECT_TRUE(seqs * 8 < 264 || work.merge_tasks.empty()) << seqs << " x " << ctx;
    return work.decode_blocks_per_sm;
  };
  EXPECT_EQ(blocks_per_sm(64, 4096, fp8), 2);
  EXPECT_EQ(blocks_per_sm(128, 8192, fp8), 0);
  EXPECT_EQ(blocks_per_sm(256, 2048, fp8), 0);
  EXPECT_EQ(blocks_per_sm(1, 32768, fp8), 0);  // split: a merge block needs its room
  EXPECT_EQ(blocks_per_sm(16, 4096, fp8), 0);
  kernels::AttentionPlanLimits unmeasured = fp8;
  unmeasured.fewer_blocks_rate = 0;
  EXPECT_EQ(blocks_per_sm(64, 4096, unmeasured), 0);
  // A rate at which two an SM cannot gain: 2 waves x 2/3 / 0.6 > 2.
  kernels::AttentionPlanLimits slow = fp8;
  slow.fewer_blocks_rate = 0.6;
  EXPECT_EQ(blocks_per_sm(64, 4096, slow), 0);
}

// A launch runs the narrow decode tile only where every 16-row tile holds at most 8 rows (its
// transposed step holds 8: the mma's n8), for an FP8 cache up to head_dim 128, either scaling,
// split or not.
TEST(AttentionPlan, NarrowDecodeWhereEverySixteenRowTileHoldsAtMostEight) {
  auto narrow = [](int q_heads, int kv_heads, std::vector<kernels::AttentionSpan> spans) {
    kernels::AttentionWork work;
    kernels::PlanAttentionWork(spans.data(), static_cast<int>(spans.size()), q_heads, kv_heads,
                               /*causal=*/true, /*window=*/0, {.target_blocks = 264}, &work);
    return work.narrow_decode;
  };
  EXPECT_TRUE(narrow(32, 8, {{0, 0, 1, 4096}, {1, 256, 1, 100}}));    // 4 rows each
  EXPECT_TRUE(narrow(64, 8, {{0, 0, 1, 4096}}));                      // GQA 8: 8 rows
  EXPECT_TRUE(narrow(32, 8, {{0, 0, 2, 4096}}));                      // 2 queries x 4
  EXPECT_FALSE(narrow(32, 8, {{0, 0, 1, 4096}, {1, 256, 3, 900}}));   // 12 rows beside 4
  EXPECT_FALSE(narrow(40, 8, {{0, 0, 2, 4096}}));                     // GQA 5: 10 rows
  EXPECT_TRUE(narrow(32, 8, {{0, 0, 1, 4096}, {1, 256, 600, 600}}));  // prefill tiles beside
  EXPECT_TRUE(narrow(32, 8, {{0, 0, 8, 4096}}));  // 32 rows: a wide tile, no 16-row tile

  kernels::PagedAttentionParams p;
  p.narrow_decode = true;
  p.kv_dtype = DType::kFloat8E4M3;
  float row_scales = 1.f;  // PER_TOKEN: rows carry their scales
  for (int d : {64, 80, 96, 128, 192, 256}) {
    p.head_dim = d;
    p.scales.k_rows = &row_scales;
    EXPECT_EQ(kernels::RunsNarrowDecode(p), d <= 128) << "PER_TOKEN, head_dim " << d;
    p.num_merge_tasks = 1;
    EXPECT_EQ(kernels::RunsNarrowDecode(p), d <= 128) << "PER_TOKEN, split, head_dim " << d;
    p.num_merge_tasks = 0;
    p.scales.k_rows = nullptr;
    EXPECT_EQ(kernels::RunsNarrowDecode(p), d <= 128) << "STATIC, head_dim " << d;
    p.num_merge_tasks = 1;
    EXPECT_EQ(kernels::RunsNarrowDecode(p), d <= 128) << "STATIC, split, head_dim " << d;
    p.num_merge_tasks = 0;
  }
  p.head_dim = 64;
  p.narrow_decode = false;
  EXPECT_FALSE(kernels::RunsNarrowDecode(p)) << "a tile of more than 8 rows in the launch";
  p.narrow_decode = true;
  p.kv_dtype = DType::kBFloat16;
  EXPECT_FALSE(kernels::RunsNarrowDecode(p)) << "16-bit caches have no narrow tile";
}

// Pairs (AttentionWork::pair_merge): every 16-row tile in exactly two splits merged in the tiles,
// each tile's items side by side in split order, on a device that launches clusters.
TEST(AttentionPlan, PairMergeWhereEveryTileSplitsInTwo) {
  auto plan = [](std::vector<kernels::AttentionSpan> spans, bool clusters) {
    kernels::AttentionWork work;
    kernels::AttentionPlanLimits limits = {.target_blocks = 264};
    limits.cluster_launch = clusters;
    kernels::PlanAttentionWork(spans.data(), static_cast<int>(spans.size()), 32, 8,
                               /*causal=*/true, /*window=*/0, limits, &work);
    return work;
  };
  std::vector<kernels::AttentionSpan> sixteen;  // 16 x 4096 on 8 kv heads: 128 tile units
  for (int i = 0; i < 16; ++i) sixteen.push_back({i, i, 1, 4097});
  const kernels::AttentionWork pairs = plan(sixteen, true);
  ASSERT_TRUE(pairs.pair_merge);
  ASSERT_EQ(pairs.decode_items.size(), 32u);
  for (size_t i = 0; i < pairs.decode_items.size(); i += 2) {
    const kernels::AttentionWorkItem &a = pairs.decode_items[i], &b = pairs.decode_items[i + 1];
    EXPECT_EQ(a.span, b.span) << "items " << i << ", " << i + 1;
    EXPECT_EQ(a.merge_task, b.merge_task);
    EXPECT_EQ(a.kv_end, b.kv_start) << "a tile's first split, then its second";
  }
  EXPECT_FALSE(plan(sixteen, false).pair_merge) << "no clusters on the device";
  std::vector<kernels::AttentionSpan> mixed = sixteen;
  mixed.back().kv_len = 100;  // one tile left whole
  EXPECT_FALSE(plan(mixed, true).pair_merge) << "a tile in one split";
  EXPECT_FALSE(plan({{0, 0, 1, 32768}}, true).pair_merge) << "1 x 32768: 33 splits a tile";
  EXPECT_FALSE(plan({{0, 0, 1, 4097}, {1, 1, 3, 4099}}, true).pair_merge)
      << "a 12-row tile: not narrow";
}

// A plan of prefill tiles alone is estimated against the prefill tiles that run at once, with no
// wave boundary (blocks start as others end). 1 x 16384 on 8 kv heads is 4096 tile blocks: in
// whole waves of head_dim 64's 396 decode blocks a split in two looked 1.6% better; against its
// 264 prefill blocks nothing is split. A prefill too short to fill them is still split.
TEST(AttentionPlan, PrefillAlonePlansAgainstPrefillTileBlocks) {
  const std::vector<kernels::AttentionSpan> one = {{0, 0, 16384, 16384}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(one.data(), 1, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 396}, &work);
  EXPECT_EQ(work.kv_chunk, 8192) << "whole waves of target_blocks when prefill_tile_blocks is 0";
  kernels::PlanAttentionWork(one.data(), 1, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 396, .prefill_tile_blocks = 264}, &work);
  EXPECT_EQ(work.kv_chunk, 16384);
  EXPECT_EQ(work.prefill_items.size(), 512u);
  EXPECT_TRUE(work.merge_tasks.empty());
  // 1 x 1024, 4 q heads on 1 kv head, not causal: 32 tile blocks for 264 slots, each the whole
  // launch unless split.
  const std::vector<kernels::AttentionSpan> narrow = {{0, 0, 1024, 1024}};
  kernels::PlanAttentionWork(narrow.data(), 1, 4, 1, /*causal=*/false, /*window=*/0,
                             {.target_blocks = 396, .prefill_tile_blocks = 264}, &work);
  EXPECT_LT(work.kv_chunk, 1024);
  EXPECT_FALSE(work.merge_tasks.empty());
  // A decode tile in the plan: whole waves of target_blocks, as before.
  const std::vector<kernels::AttentionSpan> mixed = {{0, 0, 16384, 16384}, {16384, 1024, 1, 4096}};
  kernels::PlanAttentionWork(mixed.data(), 2, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 396, .prefill_tile_blocks = 264}, &work);
  EXPECT_EQ(work.kv_chunk, 8192);
}

// Beside each decode item go the page ids of its first kItemPages pages (from the page holding
// kv_start), 0 past its span's last page.
TEST(AttentionPlan, AttachFirstPagesCopiesEachItemsFirstPages) {
  constexpr int kPage = 16;
  // Span 0: 1000 positions (63 pages) from table entry 0; span 1: 40 positions (3 pages) from
  // entry 63; span 2: a prefill of 200 queries (13 pages) from entry 66.
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 1000}, {1, 63, 1, 40}, {2, 66, 200, 200}};
  std::vector<int32_t> table(79);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(1000 + 7 * i);
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 3, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 264, .min_chunk = 64}, &work);
  ASSERT_GT(work.decode_items.size(), 2u) << "span 0 no longer splits";
  ASSERT_FALSE(work.prefill_items.empty());
  EXPECT_TRUE(work.decode_first_pages.empty()) << "attached only when asked";
  kernels::AttachFirstPages(table.data(), kPage, &work);
  ASSERT_EQ(work.decode_first_pages.size(), work.decode_items.size());
  ASSERT_EQ(work.decode_wide_first_pages.size(), work.decode_wide_items.size());
  for (size_t i = 0; i < work.decode_items.size(); ++i) {
    const auto& it = work.decode_items[i];
    const auto& sp = spans[it.span];
    const int64_t span_pages = (sp.kv_len + kPage - 1) / kPage;
    for (int j = 0; j < kernels::kItemPages; ++j) {
      const int64_t page = it.kv_start / kPage + j;
      const int32_t want = page < span_pages ? table[sp.page_table_offset + page] : 0;
      EXPECT_EQ(work.decode_first_pages[i].ids[j], want)
          << "span " << it.span << " kv_start " << it.kv_start << " page " << j;
    }
  }
  kernels::PlanAttentionWork(spans.data(), 3, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 264, .min_chunk = 64}, &work);
  EXPECT_TRUE(work.decode_first_pages.empty()) << "a new plan drops the last one's pages";
}

// The tile grid is one block per (work item, kv head) in one dimension: its size, and a refusal
// naming both numbers once it would pass the 2^31 - 1 blocks of a grid dimension.
TEST(AttentionPlan, TileGridBlocksFitOneDimension) {
  unsigned blocks = 0;
  ASSERT_TRUE(kernels::TileGridBlocks(33, 8, &blocks).ok());
  EXPECT_EQ(blocks, 264u);
  ASSERT_TRUE(kernels::TileGridBlocks(int64_t{1} << 21, 1023, &blocks).ok());
  EXPECT_EQ(blocks, (1u << 21) * 1023u);
  const kernels::LaunchStatus over = kernels::TileGridBlocks(int64_t{1} << 21, 1024, &blocks);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.message().find("2097152 tiles x 1024 kv heads"), std::string::npos)
      << over.message();
}

// Wide tiles on few kv heads (32 q / 1 kv head) are cut in enough splits to fill the GPU, and
// their merge moves to the separate kernel; the usual decode shape keeps the in-kernel merge.
TEST(AttentionPlan, SeparateMergeOnlyForLargeMerges) {
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 131072}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 1, 32, 1, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  EXPECT_TRUE(work.separate_merge);
  EXPECT_GE(work.decode_wide_items.size(), 200u) << "kv_chunk " << work.kv_chunk;
  EXPECT_EQ(work.merge_rows, 32);
  ASSERT_EQ(work.merge_tasks.size(), 1u);
  EXPECT_EQ(work.merge_tasks[0].num_splits, static_cast<int>(work.decode_wide_items.size()));

  // 33 splits of 4 rows (one decode on 8 kv heads) merge separately; 2 splits of 4 rows (16
  // decodes) in the tile kernel.
  spans = {{7, 0, 1, 32768}};
  kernels::PlanAttentionWork(spans.data(), 1, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  EXPECT_TRUE(work.separate_merge);
  EXPECT_EQ(work.merge_rows, 4);
  ASSERT_FALSE(work.merge_tasks.empty());
  EXPECT_EQ(work.merge_tasks[0].q_offset, 7);
  EXPECT_EQ(work.merge_tasks[0].num_splits, 33);
  spans.clear();
  for (int i = 0; i < 16; ++i) spans.push_back({i, i * 256, 1, 4096});
  kernels::PlanAttentionWork(spans.data(), 16, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  ASSERT_FALSE(work.merge_tasks.empty());
  EXPECT_EQ(work.merge_tasks[0].num_splits, 2);
  EXPECT_FALSE(work.separate_merge);

  // A split prefill tile keeps the in-kernel merge (the separate one is measured for decode
  // tiles only), even beside a wide decode tile that would want the separate one.
  spans = {{0, 0, 300, 10000}, {300, 700, 1, 131072}};
  kernels::PlanAttentionWork(spans.data(), 2, 32, 1, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  bool prefill_split = false;
  for (const auto& it : work.prefill_items) prefill_split |= it.partial_row >= 0;
  ASSERT_TRUE(prefill_split) << "kv_chunk " << work.kv_chunk;
  EXPECT_FALSE(work.separate_merge);
}

// Prefill blocks run span by span, the span with the longest block first, and longest first
// within a span (load balance and L2 reuse of a span's K/V prefix; kernels/attention_plan.cc).
TEST(AttentionPlan, PrefillItemsBySpanLongestFirst) {
  // Span 1 is the longest; span 0 and 2 tie on their longest block (span order decides).
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 300, 300}, {300, 100, 900, 900}, {1200, 300, 300, 300}, {1500, 400, 1, 700}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 4, 32, 8, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 100000, .min_chunk = 64}, &work);
  ASSERT_FALSE(work.prefill_items.empty());
  std::vector<int> span_order;
  for (size_t i = 0; i < work.prefill_items.size(); ++i) {
    const auto& it = work.prefill_items[i];
    EXPECT_NE(it.span, 3) << "a one-query span is a decode tile";
    if (span_order.empty() || span_order.back() != it.span) span_order.push_back(it.span);
    if (i > 0 && work.prefill_items[i - 1].span == it.span) {
      const auto& prev = work.prefill_items[i - 1];
      EXPECT_GE(prev.kv_end - prev.kv_start, it.kv_end - it.kv_start) << "item " << i;
    }
  }
  EXPECT_EQ(span_order, (std::vector<int>{1, 0, 2})) << "each span once, longest span first";
}

// The persistent prefill kernel's schedule: every (item, kv head) exactly once, the first jobs
// on blocks 0, 1, ... in PrefillJobOf's order (item-major over every kv head, or a group of kv
// heads at a time), each block's jobs in that order, and the blocks' estimated work within one
// job of each other (greedy list scheduling).
TEST(AttentionPlan, PrefillScheduleDealsEveryJobOnce) {
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 4096, 4096}, {4096, 256, 4096, 4096}, {8192, 512, 1000, 9000}, {9192, 1200, 1, 700}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 4, 32, 8, /*causal=*/true, /*window=*/0, {.target_blocks = 264},
                             &work);
  ASSERT_FALSE(work.prefill_items.empty());
  constexpr int kHeads = 8, kBlocks = 132;
  const uint32_t num_items = static_cast<uint32_t>(work.prefill_items.size());
  const size_t num_jobs = work.prefill_items.size() * kHeads;
  for (int head_group : {0, 2, 1}) {
    SCOPED_TRACE(head_group);
    work.prefill_head_group = head_group;
    kernels::SchedulePrefillJobs(kHeads, kBlocks, &work);
    ASSERT_EQ(work.prefill_jobs.size(), num_jobs);
    ASSERT_EQ(work.prefill_job_start.size(), static_cast<size_t>(kBlocks + 1));
    EXPECT_EQ(work.prefill_job_start.front(), 0);
    EXPECT_EQ(work.prefill_job_start.back(), static_cast<int32_t>(num_jobs));

    // Job (item i, head h) is PrefillJobOf's unit k; find each in the schedule.
    auto key = [](const kernels::AttentionWorkItem& it, int h) {
      return std::make_tuple(it.span, it.row_start, it.kv_start, h);
    };
    std::map<std::tuple<int, int, int, int>, int> order;
    for (uint32_t k = 0; k < num_jobs; ++k) {
      const kernels::PrefillJobIndex at =
          kernels::PrefillJobOf(k, num_items, head_group > 0 ? head_group : kHeads);
      ASSERT_LT(at.item, num_items);
      ASSERT_LT(at.kv_head, kHeads);
      if (head_group > 0) {
        EXPECT_EQ(at.kv_head / head_group, static_cast<int>(k / (num_items * head_group)))
            << "unit " << k << ": group by group";
      } else {
        EXPECT_EQ(at.item, k / kHeads) << "unit " << k << ": item-major";
      }
      order[key(work.prefill_items[at.item], at.kv_head)] = static_cast<int>(k);
    }
    ASSERT_EQ(order.size(), num_jobs) << "every (item, kv head) once";
    std::vector<int> seen(num_jobs, 0);
    int64_t min_load = INT64_MAX, max_load = 0, longest_job = 0;
    for (int b = 0; b < kBlocks; ++b) {
      int64_t load = 0;
      int prev = -1;
      for (int j = work.prefill_job_start[b]; j < work.prefill_job_start[b + 1]; ++j) {
        const kernels::AttentionPrefillJob& job = work.prefill_jobs[j];
        ASSERT_TRUE(order.count(key(job.item, job.kv_head)));
        const int k = order[key(job.item, job.kv_head)];
        ++seen[k];
        if (j == work.prefill_job_start[b]) {
          EXPECT_EQ(k, b) << "block " << b << "'s first job";
        }
        EXPECT_GT(k, prev) << "block " << b << " runs its jobs in the planner's order";
        prev = k;
        const int64_t cost = job.item.kv_end - job.item.kv_start + 128;  // the planner's estimate
        load += cost;
        longest_job = std::max(longest_job, cost);
      }
      min_load = std::min(min_load, load);
      max_load = std::max(max_load, load);
    }
    for (size_t k = 0; k < num_jobs; ++k) EXPECT_EQ(seen[k], 1) << "job " << k;
    // A job goes to the block with the least estimated work (positions + 128 per job), so no
    // block ends more than one job after the least loaded one.
    EXPECT_LE(max_load - min_load, longest_job);
  }

  // Fewer jobs than blocks: one block per job; no blocks: no schedule.
  kernels::SchedulePrefillJobs(kHeads, 100000, &work);
  EXPECT_EQ(work.prefill_job_start.size(), num_jobs + 1);
  kernels::SchedulePrefillJobs(kHeads, 0, &work);
  EXPECT_TRUE(work.prefill_jobs.empty());
  EXPECT_TRUE(work.prefill_job_start.empty());
}

// The kv heads whose prefill jobs run together: all of them while a span's K/V for every kv
// head fits half the L2, else the largest divisor of the kv heads whose K/V fits it.
TEST(AttentionPlan, PrefillHeadGroupsFitHalfTheL2) {
  constexpr int64_t kMiB = 1 << 20;
  const kernels::AttentionPlanLimits h200 = {.target_blocks = 264, .l2_bytes = 50 * kMiB};
  auto group = [&](std::vector<kernels::AttentionSpan> spans, int heads, int head_dim,
                   const kernels::AttentionPlanLimits& limits) {
    return kernels::PrefillHeadGroup(spans.data(), static_cast<int>(spans.size()), heads,
                                     2 * head_dim * 2, limits);
  };
  const kernels::AttentionSpan s32k = {0, 0, 32768, 32768}, s16k = {0, 0, 16384, 16384};
  // 1 x 32768 at head_dim 64: 8 MiB a kv head, 64 for 8; 2 heads (16 MiB) fit 25, 4 do not.
  EXPECT_EQ(group({s32k}, 8, 64, h200), 2);
  // 4 x 4096 at 128: a span's 8 heads take 16 MiB: every head together.
  EXPECT_EQ(group({{0, 0, 4096, 4096},
                   {4096, 256, 4096, 4096},
                   {8192, 512, 4096, 4096},
                   {12288, 768, 4096, 4096}},
                  8, 128, h200),
            8);
  // 1 x 16384 at 128 on 6 kv heads: 8 MiB each; 3 (24 MiB) is the largest divisor that fits.
  EXPECT_EQ(group({s16k}, 6, 128, h200), 3);
  // One head over the budget (1 x 131072 at 128: 64 MiB): one at a time.
  EXPECT_EQ(group({{0, 0, 131072, 131072}}, 8, 128, h200), 1);
  // The L2 unknown: every head.
  EXPECT_EQ(group({s32k}, 8, 64, {.target_blocks = 264}), 8);
}

// ---- AttentionPlan: one Forward's plan, slots and staging --------------------------------

// A Forward of three spans on 2 kv heads x 4 (head_dim 64, pages of 16): a decode that appends
// one row to 40, a prefill of 20 new rows, and a span that only appends 5 rows.
struct SmallForward {
  std::vector<kernels::ForwardSpan> spans = {{.q_offset = 0,
                                              .kv_offset = 0,
                                              .page_table_offset = 0,
                                              .first_new_position = 39,
                                              .num_new_tokens = 1,
                                              .num_queries = 1,
                                              .kv_len = 40},
                                             {.q_offset = 1,
                                              .kv_offset = 1,
                                              .page_table_offset = 3,
                                              .first_new_position = 0,
                                              .num_new_tokens = 20,
                                              .num_queries = 20,
                                              .kv_len = 20},
                                             {.q_offset = 21,
                                              .kv_offset = 21,
                                              .page_table_offset = 5,
                                              .first_new_position = 30,
                                              .num_new_tokens = 5,
                                              .num_queries = 0,
                                              .kv_len = 35}};
  std::vector<int32_t> page_table = {7, 2, 9, 4, 11, 0, 3, 5};
  kernels::ForwardBatch Batch(DType q_dtype) const {
    return {.spans = spans,
            .page_table = page_table,
            .total_queries = 21,
            .total_new_tokens = 26,
            .num_q_heads = 8,
            .num_kv_heads = 2,
            .head_dim = 64,
            .page_size = 16,
            .kv_dtype = DType::kBFloat16,
            .q_dtype = q_dtype,
            .kv_wire_dtype = DType::kFloat32,
            .causal = true,
            .sm_scale = 0.125f,
            .return_lse = true};
  }
};

// Each new row's slot is its page (through its span's pages) times the page size plus its row.
TEST(AttentionPlan, SlotsFollowEachSpansPages) {
  const SmallForward f;
  const kernels::AttentionPlan plan =
      kernels::AttentionPlan::Make(f.Batch(DType::kBFloat16), {.target_blocks = 132});
  ASSERT_EQ(plan.slots().size(), 26u);
  EXPECT_EQ(plan.slots()[0], 9 * 16 + 7);  // position 39: the span's third page (id 9), row 7
  for (int t = 0; t < 20; ++t) {
    EXPECT_EQ(plan.slots()[1 + t], int64_t{f.page_table[3 + t / 16]} * 16 + t % 16) << t;
  }
  for (int t = 0; t < 5; ++t) {
    const int pos = 30 + t;
    EXPECT_EQ(plan.slots()[21 + t], int64_t{f.page_table[5 + pos / 16]} * 16 + pos % 16) << t;
  }
}

// The sections are aligned and in order (q, k and v first), none overlaps the next, the inputs
// end where the results begin, and the device scratch comes last.
TEST(AttentionPlan, StagingSectionsAreAlignedAndDisjoint) {
  const SmallForward f;
  for (DType q_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const kernels::AttentionPlan plan =
        kernels::AttentionPlan::Make(f.Batch(q_dtype), {.target_blocks = 132, .min_chunk = 64});
    const kernels::ForwardStaging& st = plan.staging();
    const kernels::AttentionWork& w = plan.work();
    const size_t q_bytes = size_t{21} * 8 * 64 * DTypeSize(q_dtype);
    const size_t kv_bytes = size_t{26} * 2 * 64 * 4;
    struct Section {
      size_t at, bytes;
    };
    const Section sections[] = {
        {st.q, q_bytes},
        {st.k, kv_bytes},
        {st.v, kv_bytes},
        {st.page_table, f.page_table.size() * 4},
        {st.slots, 26 * 8},
        {st.decode_items, w.decode_items.size() * sizeof(kernels::AttentionWorkItem)},
        {st.decode_wide_items, w.decode_wide_items.size() * sizeof(kernels::AttentionWorkItem)},
        {st.decode_first_pages, w.decode_first_pages.size() * sizeof(kernels::ItemFirstPages)},
        {st.decode_wide_first_pages,
         w.decode_wide_first_pages.size() * sizeof(kernels::ItemFirstPages)},
        {st.prefill_items, w.prefill_items.size() * sizeof(kernels::AttentionWorkItem)},
        {st.prefill_jobs, w.prefill_jobs.size() * sizeof(kernels::AttentionPrefillJob)},
        {st.prefill_job_start, w.prefill_job_start.size() * 4},
        {st.merge_tasks, w.merge_tasks.size() * sizeof(kernels::AttentionMergeTask)},
        {st.out, q_bytes},
        {st.lse, size_t{21} * 8 * 4},
        {st.q_f32, plan.converts_q() ? size_t{21} * 8 * 64 * 4 : 0},
        {st.out_f32, plan.converts_q() ? size_t{21} * 8 * 64 * 4 : 0},
        {st.partial_out, static_cast<size_t>(w.partial_rows) * 2 * 64 * 4},
        {st.partial_lse, static_cast<size_t>(w.partial_rows) * 2 * 4}};
    size_t end = 0;
    for (const Section& s : sections) {
      EXPECT_EQ(s.at % kernels::kStagingAlign, 0u) << "at " << s.at;
      EXPECT_GE(s.at, end) << "overlaps the section before it";
      end = s.at + s.bytes;
    }
    EXPECT_LE(end, st.device_bytes);
    EXPECT_EQ(st.upload_bytes, st.out) << "the results follow the inputs";
    // q, k and v lie first, where InputsLayout says before the Forward is planned.
    const kernels::InputsLayout inputs = kernels::InputsLayout::Of(q_bytes, kv_bytes);
    EXPECT_EQ(inputs.q, st.q);
    EXPECT_EQ(inputs.k, st.k);
    EXPECT_EQ(inputs.v, st.v);
    EXPECT_LE(st.v + kv_bytes, st.upload_bytes);
    EXPECT_EQ(st.out_bytes, q_bytes);
    EXPECT_EQ(st.lse_bytes, size_t{21} * 8 * 4);
    EXPECT_EQ(st.results_end, st.lse + kernels::kStagingAlign * ((st.lse_bytes + 255) / 256));
    EXPECT_EQ(st.merge_counters, w.merge_tasks.size() * 2);
    EXPECT_FALSE(w.prefill_items.empty());
    EXPECT_FALSE(w.decode_items.empty());
    EXPECT_EQ(w.decode_first_pages.size(), w.decode_items.size()) << "first pages attached";
  }
}

// The image holds every input at its offset, bit for bit.
TEST(AttentionPlan, WriteStagingPutsEachInputAtItsOffset) {
  const SmallForward f;
  const kernels::AttentionPlan plan =
      kernels::AttentionPlan::Make(f.Batch(DType::kBFloat16), {.target_blocks = 132});
  const kernels::ForwardStaging& st = plan.staging();
  std::vector<uint16_t> q(21 * 8 * 64);
  std::vector<float> k(26 * 2 * 64), v(26 * 2 * 64);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint16_t>(i * 7 + 1);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i) * 0.5f;
    v[i] = -static_cast<float>(i);
  }
  std::vector<char> image(st.upload_bytes, 0x5a);
  plan.WriteStaging(image.data(), q.data(), k.data(), v.data());
  auto same = [&](size_t at, const void* want, size_t bytes) {
    return std::memcmp(image.data() + at, want, bytes) == 0;
  };
  const kernels::AttentionWork& w = plan.work();
  EXPECT_TRUE(same(st.page_table, f.page_table.data(), f.page_table.size() * 4));
  EXPECT_TRUE(same(st.slots, plan.slots().data(), plan.slots().size() * 8));
  EXPECT_TRUE(same(st.decode_items, w.decode_items.data(),
                   w.decode_items.size() * sizeof(kernels::AttentionWorkItem)));
  EXPECT_TRUE(same(st.decode_first_pages, w.decode_first_pages.data(),
                   w.decode_first_pages.size() * sizeof(kernels::ItemFirstPages)));
  EXPECT_TRUE(same(st.prefill_items, w.prefill_items.data(),
                   w.prefill_items.size() * sizeof(kernels::AttentionWorkItem)));
  EXPECT_TRUE(same(st.q, q.data(), q.size() * 2));
  EXPECT_TRUE(same(st.k, k.data(), k.size() * 4));
  EXPECT_TRUE(same(st.v, v.data(), v.size() * 4));
}

// The bound params point into the device image at the plan's offsets, and carry the batch's
// shapes, the plan's work and the caller's pools and counters.
TEST(AttentionPlan, BindPointsIntoTheDeviceImage) {
  const SmallForward f;
  const kernels::AttentionPlan plan =
      kernels::AttentionPlan::Make(f.Batch(DType::kBFloat16), {.target_blocks = 132});
  const kernels::ForwardStaging& st = plan.staging();
  std::vector<char> device(st.device_bytes);
  char* d = device.data();
  int32_t counters[4];
  char k_pool[16], v_pool[16];
  const kernels::ForwardLaunch launch = plan.Bind(d, counters, k_pool, v_pool);
  const kernels::AppendParams& a = launch.append;
  EXPECT_EQ(a.k, d + st.k);
  EXPECT_EQ(a.v, d + st.v);
  EXPECT_EQ(static_cast<const void*>(a.slots), d + st.slots);
  EXPECT_EQ(a.num_tokens, 26);
  EXPECT_EQ(a.src_dtype, DType::kFloat32);
  EXPECT_EQ(a.cache_dtype, DType::kBFloat16);
  EXPECT_EQ(a.k_cache, k_pool);
  const kernels::PagedAttentionParams& p = launch.attention;
  EXPECT_EQ(static_cast<const void*>(p.page_table), d + st.page_table);
  EXPECT_EQ(static_cast<const void*>(p.decode_items), d + st.decode_items);
  EXPECT_EQ(static_cast<const void*>(p.decode_first_pages), d + st.decode_first_pages);
  EXPECT_EQ(static_cast<const void*>(p.prefill_items), d + st.prefill_items);
  EXPECT_EQ(static_cast<const void*>(p.merge_tasks), d + st.merge_tasks);
  EXPECT_EQ(static_cast<const void*>(p.lse), d + st.lse);
  EXPECT_EQ(static_cast<const void*>(p.partial_out), d + st.partial_out);
  EXPECT_EQ(p.merge_counters, counters);
  EXPECT_EQ(p.k_cache, k_pool);
  EXPECT_EQ(p.v_cache, v_pool);
  EXPECT_EQ(p.num_decode_items, static_cast<int32_t>(plan.work().decode_items.size()));
  EXPECT_EQ(p.num_prefill_items, static_cast<int32_t>(plan.work().prefill_items.size()));
  EXPECT_EQ(p.num_q_heads, 8);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.sm_scale, 0.125f);
  // No lse asked for: none written.
  kernels::ForwardBatch no_lse = f.Batch(DType::kBFloat16);
  no_lse.return_lse = false;
  const kernels::AttentionPlan plain = kernels::AttentionPlan::Make(no_lse, {.target_blocks = 132});
  EXPECT_EQ(plain.staging().lse_bytes, 0u);
  EXPECT_EQ(plain.Bind(d, counters, k_pool, v_pool).attention.lse, nullptr);
}

// An FP8 cache: the decode tiles read the pool; the prefill tiles a bfloat16 copy of the pages
// their spans attend, renumbered in a page table of their own (the other spans' entries as they
// are); q in bfloat16 (the tiles' type) is read in place; the layer's scales reach both kernels.
TEST(AttentionPlan, Fp8PrefillReadsItsPagesCopy) {
  const SmallForward f;
  kernels::ForwardBatch batch = f.Batch(DType::kBFloat16);
  batch.kv_dtype = DType::kFloat8E4M3;
  float k_rows[1], v_rows[1];
  batch.kv_scales = {.k_rows = k_rows, .v_rows = v_rows};
  const kernels::AttentionPlan plan = kernels::AttentionPlan::Make(batch, {.target_blocks = 132});
  ASSERT_FALSE(plan.work().prefill_items.empty());
  ASSERT_FALSE(plan.work().decode_items.empty());
  EXPECT_FALSE(plan.converts_q());
  // The prefill span (span 1) holds entries 3 and 4 of the page table: pool pages 4 and 11.
  EXPECT_EQ(plan.dequant_pages(), (std::vector<int32_t>{4, 11}));
  EXPECT_EQ(plan.prefill_page_table(), (std::vector<int32_t>{7, 2, 9, 0, 1, 0, 3, 5}));
  const kernels::ForwardStaging& st = plan.staging();
  EXPECT_EQ(st.dequant_v - st.dequant_k, 2u * 2 * 16 * 64 * 2);  // 2 pages of bfloat16
  std::vector<char> device(st.device_bytes);
  std::vector<char> image(st.upload_bytes);
  std::vector<uint16_t> q(21 * 8 * 64);
  std::vector<float> kv(26 * 2 * 64);
  plan.WriteStaging(image.data(), q.data(), kv.data(), kv.data());
  EXPECT_EQ(std::memcmp(image.data() + st.prefill_page_table, plan.prefill_page_table().data(),
                        8 * sizeof(int32_t)),
            0);
  EXPECT_EQ(std::memcmp(image.data() + st.dequant_pages, plan.dequant_pages().data(),
                        2 * sizeof(int32_t)),
            0);
  char* d = device.data();
  char k_pool[16], v_pool[16];
  const kernels::ForwardLaunch launch = plan.Bind(d, nullptr, k_pool, v_pool);
  const kernels::PagedAttentionParams& p = launch.attention;
  EXPECT_EQ(p.kv_dtype, DType::kFloat8E4M3);
  EXPECT_EQ(p.q_dtype, DType::kBFloat16);
  EXPECT_EQ(p.k_cache, k_pool);
  EXPECT_EQ(static_cast<const void*>(p.page_table), d + st.page_table);
  EXPECT_EQ(static_cast<const void*>(p.prefill_page_table), d + st.prefill_page_table);
  EXPECT_EQ(static_cast<const void*>(p.dequant_pages), d + st.dequant_pages);
  EXPECT_EQ(p.num_dequant_pages, 2);
  EXPECT_EQ(p.dequant_k, d + st.dequant_k);
  EXPECT_EQ(p.dequant_v, d + st.dequant_v);
  EXPECT_EQ(p.scales.k_rows, k_rows);
  EXPECT_EQ(launch.append.scales.v_rows, v_rows);
  // q in float16 crosses an FP8 cache's (bfloat16) tiles as a float copy.
  kernels::ForwardBatch half_q = batch;
  half_q.q_dtype = DType::kFloat16;
  EXPECT_TRUE(kernels::AttentionPlan::Make(half_q, {.target_blocks = 132}).converts_q());
  // A 16-bit cache's prefill reads the pool: no copies.
  const kernels::AttentionPlan bf16 =
      kernels::AttentionPlan::Make(f.Batch(DType::kBFloat16), {.target_blocks = 132});
  EXPECT_TRUE(bf16.dequant_pages().empty());
  EXPECT_EQ(bf16.Bind(d, nullptr, k_pool, v_pool).attention.num_dequant_pages, 0);
}

// The tiles read q (and write out) in float and in the cache's dtype as they are, in place in
// the image; q in the other 16-bit type crosses them as a float copy: converted into q_f32 before
// them, their out_f32 converted back into out after them.
TEST(AttentionPlan, QInTheOther16BitTypeIsConvertedThroughFloat) {
  const SmallForward f;  // a bf16 cache
  std::vector<char> device(1 << 20);
  char* d = device.data();
  for (DType read : {DType::kFloat32, DType::kBFloat16}) {
    const kernels::AttentionPlan plan =
        kernels::AttentionPlan::Make(f.Batch(read), {.target_blocks = 132});
    EXPECT_FALSE(plan.converts_q()) << DTypeName(read);
    const kernels::ForwardLaunch launch = plan.Bind(d, nullptr, nullptr, nullptr);
    EXPECT_EQ(launch.wire_dtype, DType::kUnspecified);
    EXPECT_EQ(launch.attention.q_dtype, read);
    EXPECT_EQ(launch.attention.q, d + plan.staging().q);
    EXPECT_EQ(launch.attention.out, d + plan.staging().out);
    EXPECT_EQ(plan.staging().q_f32, plan.staging().out_f32) << "no float copies";
  }
  const kernels::AttentionPlan plan =
      kernels::AttentionPlan::Make(f.Batch(DType::kFloat16), {.target_blocks = 132});
  ASSERT_TRUE(plan.converts_q());
  const kernels::ForwardLaunch launch = plan.Bind(d, nullptr, nullptr, nullptr);
  EXPECT_EQ(launch.wire_dtype, DType::kFloat16);
  EXPECT_EQ(launch.wire_q, d + plan.staging().q);
  EXPECT_EQ(launch.wire_out, d + plan.staging().out);
  EXPECT_EQ(launch.wire_elems, 21 * 8 * 64);
  EXPECT_EQ(launch.attention.q_dtype, DType::kFloat32);
  EXPECT_EQ(launch.attention.q, d + plan.staging().q_f32);
  EXPECT_EQ(launch.attention.out, d + plan.staging().out_f32);
  EXPECT_GE(plan.staging().out_f32 - plan.staging().q_f32, size_t{21} * 8 * 64 * 4);
}

// The tiles' q dtype picks their instantiation: float32, or the cache's dtype; the other 16-bit
// type is refused with a message naming both (the plan converts it before it gets there).
TEST(AttentionDispatch, QDtypeIsFloatOrTheCaches) {
  auto picked = [](DType q, DType cache) {
    std::string name;
    const kernels::LaunchStatus st = kernels::DispatchKvDType(cache, [&](auto tag) {
      using T = typename decltype(tag)::type;
      return kernels::DispatchQDType<T>(q, cache, [&](auto q_tag) {
        using TIO = typename decltype(q_tag)::type;
        name = std::is_same_v<TIO, float> ? "float" : (std::is_same_v<TIO, T> ? "cache" : "?");
        return kernels::LaunchStatus::Ok();
      });
    });
    return st.ok() ? name : st.message();
  };
  EXPECT_EQ(picked(DType::kFloat32, DType::kBFloat16), "float");
  EXPECT_EQ(picked(DType::kBFloat16, DType::kBFloat16), "cache");
  EXPECT_EQ(picked(DType::kFloat16, DType::kFloat16), "cache");
  EXPECT_EQ(picked(DType::kFloat16, DType::kBFloat16),
            "q dtype FLOAT16 on a BFLOAT16 cache: the tiles read FLOAT32 or the cache's dtype");
}


// A wide head (head_dim 512) without decode tiles (an FP8 cache): decode and prefill spans alike
// run on prefill tiles; a split tile merges in the separate merge kernel even where the
// in-kernel merge would be cheaper, and its partial rows are its span's rows (8 for a decode
// span), not a whole tile's.
TEST(AttentionPlan, WideHeadWithoutDecodeTilesRunsEverySpanOnPrefillTiles) {
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 32768}, {1, 2048, 100, 1000}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 2, 16, 2, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 66, .wide_head = true, .decode_tiles = false},
                             &work);
  EXPECT_TRUE(work.decode_items.empty());
  EXPECT_TRUE(work.decode_wide_items.empty());
  ASSERT_FALSE(work.merge_tasks.empty()) << "the long decode no longer splits";
  EXPECT_TRUE(work.separate_merge);
  const kernels::AttentionMergeTask& task = work.merge_tasks[0];
  EXPECT_EQ(task.span, 0);
  EXPECT_EQ(task.num_rows, 8);
  EXPECT_EQ(task.row_stride, 8);
  int64_t decode_rows = 0;
  for (const auto& it : work.prefill_items) {
    if (it.span == 0) {
      ASSERT_GE(it.partial_row, 0);
      EXPECT_EQ((it.partial_row - task.partial_row) % 8, 0);
      decode_rows += 8;
    }
  }
  EXPECT_EQ(decode_rows, int64_t{task.num_splits} * 8);
  // With decode tiles (a 16-bit cache): the long decode is a decode tile's, still merged apart.
  kernels::PlanAttentionWork(spans.data(), 2, 16, 2, /*causal=*/true, /*window=*/0,
                             {.target_blocks = 66, .wide_head = true}, &work);
  EXPECT_FALSE(work.decode_items.empty());
  EXPECT_TRUE(work.separate_merge);
}

}  // namespace
}  // namespace pagedattn
