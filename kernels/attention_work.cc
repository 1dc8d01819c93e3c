// The attention work planners: tiles of query rows and the split-KV chunk (PlanAttentionWork),
// each decode item's first pages, and the persistent Hopper prefill schedule.
#include "kernels/attention_work.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <string>
#include <utility>

namespace pagedattn::kernels {
namespace {

struct Tile {
  int32_t span;
  int32_t row_start;
  int32_t num_rows;
  int32_t kv_begin;  // First visible position over the tile's rows (0 without a window).
  int32_t kv_end;    // Last visible position + 1 over the tile's rows.
  int32_t tile_rows;
  int64_t length() const { return int64_t{kv_end} - kv_begin; }
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Costs in KV positions for the chunk estimate: a block's start-up (page ids, first copies,
// Q) and a split's share of the merge, each about this many positions of streaming
// (docs/PERFORMANCE.md#design-decisions).
constexpr int64_t kBlockStartCost = 128;
constexpr int64_t kMergeCost = 32;
// The split that finishes last merges its tile alone, reading num_splits * rows partial rows
// at the very end of the launch; each (split, row) costs about one position of streaming.
constexpr int64_t kMergeCostPerSplitRow = 1;
// The separate merge kernel (AttentionWork::separate_merge), launched with the tiles as one
// programmatically dependent pair, each block reading its row of every split with 8 warps.
// 96: the separate merge wins above ~28 splits of 4 rows (13 of 8)
// (docs/PERFORMANCE.md#design-decisions).
constexpr int64_t kSeparateMergeCost = 96;
constexpr int64_t kSeparateMergeSplitsPerPosition = 2;
// A persistent prefill block's cost per job beyond its K/V range, in positions: the job's first
// S and softmax (not overlapped), its output and the Q load of the next.
constexpr int64_t kPrefillJobCost = 128;

// Rows between a split tile's splits in the partial buffers: the tile's rows, or (wide_head,
// whose prefill tiles may also take decode spans) the rows it has.
int PartialRowStride(const Tile& tile, const AttentionPlanLimits& limits) {
  return limits.wide_head ? tile.num_rows : tile.tile_rows;
}

// AttentionWork::decode_blocks_per_sm for `units` unsplit decode tile blocks: one block an SM
// fewer than fit where its waves, each (k - 1) / k of a full one's work at fewer_blocks_rate,
// take 1% less time than the full waves (both counted whole: the last wave's blocks each run as
// long as any); 0 otherwise. At FP8's 0.85, 512 blocks of three an SM (1.29 waves on 132 SMs)
// run in two waves of two an SM; 1024 and 2048 (2.59 and 5.17 waves) keep three.
int32_t FewerDecodeBlocksPerSm(int64_t units, bool unsplit, const AttentionPlanLimits& limits) {
  const int64_t k = limits.decode_blocks_per_sm;
  if (!unsplit || limits.fewer_blocks_rate <= 0 || k < 2 || limits.unsplit_blocks <= 0) return 0;
  const int64_t full = limits.unsplit_blocks, fewer = limits.unsplit_blocks * (k - 1) / k;
  if (fewer <= 0) return 0;
  const double full_time = static_cast<double>(CeilDiv(units, full));
  const double fewer_time = static_cast<double>(CeilDiv(units, fewer)) * static_cast<double>(k - 1) /
                            (static_cast<double>(k) * limits.fewer_blocks_rate);
  return fewer_time < 0.99 * full_time ? static_cast<int32_t>(k - 1) : 0;
}

}  // namespace

void AttachFirstPages(const int32_t* page_table, int page_size, AttentionWork* work) {
  auto attach = [&](const std::vector<AttentionWorkItem>& items,
                    std::vector<ItemFirstPages>* first_pages) {
    first_pages->assign(items.size(), ItemFirstPages{});
    for (size_t i = 0; i < items.size(); ++i) {
      const AttentionSpan& span = items[i].span_info;
      const int64_t span_pages = (int64_t{span.kv_len} + page_size - 1) / page_size;
      const int64_t first = items[i].kv_start / page_size;
      for (int j = 0; j < kItemPages && first + j < span_pages; ++j) {
        (*first_pages)[i].ids[j] = page_table[span.page_table_offset + first + j];
      }
    }
  };
  attach(work->decode_items, &work->decode_first_pages);
  attach(work->decode_wide_items, &work->decode_wide_first_pages);
}

LaunchStatus TileGridBlocks(int64_t num_items, int num_kv_heads, unsigned* blocks) {
  const int64_t n = num_items * num_kv_heads;
  if (n > INT32_MAX) {
    return LaunchStatus::Unsupported("paged attention: " + std::to_string(num_items) + " tiles x " +
                                     std::to_string(num_kv_heads) +
                                     " kv heads is over 2^31 - 1 blocks; split the batch");
  }
  *blocks = static_cast<unsigned>(n);
  return LaunchStatus::Ok();
}

void PlanAttentionWork(const AttentionSpan* spans, int num_spans, int num_q_heads, int num_kv_heads,
                       bool causal, int32_t window, const AttentionPlanLimits& limits,
                       AttentionWork* work) {
  work->decode_items.clear();
  work->decode_wide_items.clear();
  work->decode_first_pages.clear();  // AttachFirstPages fills them for these items
  work->decode_wide_first_pages.clear();
  work->prefill_items.clear();
  work->merge_tasks.clear();
  work->prefill_jobs.clear();
  work->prefill_job_start.clear();
  work->prefill_head_group = 0;
  work->partial_rows = 0;
  work->separate_merge = false;
  work->decode_blocks_per_sm = 0;
  work->narrow_decode = false;
  work->pair_merge = false;
  work->merge_rows = 0;
  const int group = num_q_heads / num_kv_heads;

  std::vector<Tile> tiles;
  for (int i = 0; i < num_spans; ++i) {
    const AttentionSpan& span = spans[i];
    if (span.num_queries <= 0) continue;
    const int rows = span.num_queries * group;
    const int tile_rows = !limits.decode_tiles          ? kPrefillTileRows
                          : rows <= kDecodeTileRows       ? kDecodeTileRows
                          : rows <= kDecodeWideTileRows ? kDecodeWideTileRows
                                                        : kPrefillTileRows;
    for (int row_start = 0; row_start < rows; row_start += tile_rows) {
      const int num_rows = std::min(tile_rows, rows - row_start);
      const int first_pos = span.kv_len - span.num_queries;
      const int last_query = (row_start + num_rows - 1) / group;
      const int kv_end = causal ? first_pos + last_query + 1 : span.kv_len;
      // A window hides what lies before the tile's first query's window. The prefill tiles start
      // on a KV tile boundary (their masks cover the rest); the decode tiles start anywhere.
      int kv_begin = window > 0 ? std::max(0, first_pos + row_start / group - window + 1) : 0;
      if (tile_rows == kPrefillTileRows) kv_begin -= kv_begin % kKvTileRows;
      kv_begin = std::min(kv_begin, kv_end);
      tiles.push_back({i, row_start, num_rows, kv_begin, kv_end, tile_rows});
    }
  }

  // The split-KV chunk: blocks run in waves of target_blocks (of unsplit_blocks when a
  // decode-only plan splits nothing: no merge block needs room beside its tiles), so a launch
  // lasts about max(longest block, waves * mean block); each block also pays a fixed start-up
  // cost. Candidates are the longest range cut in k pieces (a multiple of the KV tile, at least
  // min_chunk so the merge stays small); the cheapest estimate wins, ties to fewer splits.
  const bool decode_only = std::all_of(
      tiles.begin(), tiles.end(), [](const Tile& t) { return t.tile_rows <= kDecodeWideTileRows; });
  const bool prefill_only =
      limits.prefill_tile_blocks > 0 && std::all_of(tiles.begin(), tiles.end(), [](const Tile& t) {
        return t.tile_rows == kPrefillTileRows;
      });
  const int64_t blocks = std::max(1, limits.target_blocks);
  const int64_t whole_blocks =
      limits.unsplit_blocks > 0 && decode_only ? limits.unsplit_blocks : blocks;
  const int64_t floor_chunk = std::max(limits.min_chunk, kKvTileRows);
  int64_t max_end = 1;  // the longest range
  for (const Tile& t : tiles) max_end = std::max<int64_t>(max_end, t.length());
  auto round_chunk = [&](int64_t c) {
    return std::max(floor_chunk, CeilDiv(std::max<int64_t>(c, 1), kKvTileRows) * kKvTileRows);
  };
  // The estimate of a chunk, and where its splits are merged: in the tile kernels (a tail of the
  // largest task's splits * rows) or in a kernel of its own (a fixed cost plus the most splits
  // any row has), whichever is cheaper. A plan that splits a prefill tile keeps the in-kernel
  // merge: the separate one is tuned for decode tiles (docs/PERFORMANCE.md#design-decisions).
  struct Estimate {
    double cost;
    bool separate_merge;
  };
  auto estimate = [&](int64_t chunk) {
    int64_t units = 0, max_cost = 0, in_kernel_merge = 0, most_splits = 0;
    bool prefill_split = false;
    double total_cost = 0;
    for (const Tile& t : tiles) {
      const int64_t n = CeilDiv(t.length(), chunk);
      units += n;
      total_cost +=
          static_cast<double>(t.length()) + n * (kBlockStartCost + (n > 1 ? kMergeCost : 0));
      max_cost =
          std::max<int64_t>(max_cost, std::min<int64_t>(chunk, t.length()) + kBlockStartCost);
      if (n > 1) {
        in_kernel_merge = std::max(in_kernel_merge, n * t.num_rows * kMergeCostPerSplitRow);
        most_splits = std::max(most_splits, n);
        prefill_split |= t.tile_rows == kPrefillTileRows;
      }
    }
    units *= num_kv_heads;
    total_cost *= num_kv_heads;
    const int64_t wave_blocks = most_splits > 0 ? blocks : whole_blocks;
    // Prefill tiles alone: as many waves as their work fills, not a whole one more. Whole waves
    // of the decode tiles' blocks split 1 x 16384 at head_dim 64 and 1 x 32768 at 128 in two for
    // a 1.5% better estimate, in 1.11x and 1.12x the time (docs/PERFORMANCE.md#design-decisions).
    const double waves = prefill_only ? static_cast<double>(units) / limits.prefill_tile_blocks
                                      : static_cast<double>(CeilDiv(units, wave_blocks));
    const int64_t separate_merge =
        kSeparateMergeCost + most_splits / kSeparateMergeSplitsPerPosition;
    const bool separate =
        most_splits > 0 &&
        (limits.wide_head || (!prefill_split && separate_merge < in_kernel_merge));
    return Estimate{
        std::max(static_cast<double>(max_cost), waves * total_cost / std::max<int64_t>(units, 1)) +
            static_cast<double>(separate ? separate_merge : in_kernel_merge),
        separate};
  };
  static constexpr int kPieces[] = {1,  2,  3,  4,  5,  6,  7,  8,  10,  12,  14,  16,  20,  24,
                                    28, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256, 384, 512};
  int64_t chunk = round_chunk(max_end);
  double best = estimate(chunk).cost;
  for (int k : kPieces) {
    const int64_t c = round_chunk(CeilDiv(max_end, k));
    if (c >= chunk) continue;
    const double e = estimate(c).cost;
    if (e < best * 0.99) {  // a split must buy at least 1%
      best = e;
      chunk = c;
    }
    if (c == floor_chunk) break;
  }
  // One wave exactly: a decode-only plan may also cut the longest range into as many equal
  // pieces as the blocks hold per tile, at any position (the decode tiles mask a split's ends),
  // so that 1 x 32768 on 8 kv heads runs 33 splits a kv head of 993 positions (264 blocks) rather
  // than 32 of 1024 (256) with 8 of the GPU's 264 block slots idle.
  const int64_t tile_units = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  if (decode_only && tile_units > 0 && blocks / tile_units >= 2) {
    const int64_t c = std::max(floor_chunk, CeilDiv(max_end, blocks / tile_units));
    if (c < chunk) {
      const double e = estimate(c).cost;
      if (e < best * 0.99) {
        best = e;
        chunk = c;
      }
    }
  }
  work->kv_chunk = static_cast<int32_t>(std::min<int64_t>(chunk, INT32_MAX));
  work->separate_merge = estimate(chunk).separate_merge;
  work->decode_blocks_per_sm =
      FewerDecodeBlocksPerSm(tile_units, chunk >= max_end && decode_only, limits);
  work->narrow_decode = std::all_of(tiles.begin(), tiles.end(), [](const Tile& t) {
    return t.tile_rows != kDecodeTileRows || t.num_rows <= kDecodeNarrowRows;
  });
  const auto splits_of = [&](const Tile& t) { return CeilDiv(t.length(), chunk); };
  work->pair_merge = limits.cluster_launch && work->narrow_decode && !work->separate_merge &&
                     std::any_of(tiles.begin(), tiles.end(),
                                 [](const Tile& t) { return t.tile_rows == kDecodeTileRows; }) &&
                     std::all_of(tiles.begin(), tiles.end(), [&](const Tile& t) {
                       return t.tile_rows != kDecodeTileRows || splits_of(t) == 2;
                     });

  // Items of one span are emitted split-major so that tiles reading the same KV chunk (the
  // tiles of a GQA group wider than 16 rows) run side by side and share it through L2.
  size_t first = 0;
  while (first < tiles.size()) {
    size_t last = first;
    while (last < tiles.size() && tiles[last].span == tiles[first].span) ++last;
    int64_t max_splits = 0;
    std::vector<int32_t> partial_base(last - first, -1), task_index(last - first, -1);
    for (size_t t = first; t < last; ++t) {
      const Tile& tile = tiles[t];
      const int64_t splits = CeilDiv(tile.length(), chunk);
      max_splits = std::max(max_splits, splits);
      if (splits > 1) {
        const int stride = PartialRowStride(tile, limits);
        partial_base[t - first] = static_cast<int32_t>(work->partial_rows);
        task_index[t - first] = static_cast<int32_t>(work->merge_tasks.size());
        work->merge_tasks.push_back({spans[tile.span].q_offset, tile.span, tile.row_start,
                                     tile.num_rows, static_cast<int32_t>(splits),
                                     static_cast<int32_t>(work->partial_rows), stride});
        work->merge_rows = std::max(work->merge_rows, tile.num_rows);
        work->partial_rows += splits * stride;
      }
    }
    for (int64_t s = 0; s < max_splits; ++s) {
      for (size_t t = first; t < last; ++t) {
        const Tile& tile = tiles[t];
        const int64_t kv_start = tile.kv_begin + s * chunk;
        if (kv_start >= tile.kv_end) continue;
        AttentionWorkItem item;
        item.span_info = spans[tile.span];
        item.span = tile.span;
        item.row_start = tile.row_start;
        item.kv_start = static_cast<int32_t>(kv_start);
        item.kv_end = static_cast<int32_t>(std::min<int64_t>(kv_start + chunk, tile.kv_end));
        const int tile_rows = tile.tile_rows;
        const int64_t stride = PartialRowStride(tile, limits);
        item.partial_row = partial_base[t - first] < 0
                               ? -1
                               : static_cast<int32_t>(partial_base[t - first] + s * stride);
        item.merge_task = task_index[t - first];
        (tile_rows == kDecodeTileRows       ? work->decode_items
         : tile_rows == kDecodeWideTileRows ? work->decode_wide_items
                                            : work->prefill_items)
            .push_back(item);
      }
    }
    first = last;
  }

  // Prefill blocks run span by span (the span with the longest block first), and longest
  // first within a span. Longest first, so the short (causal, early) tiles fill the last wave
  // instead of one long tile running alone at the end. Span by span, so that the blocks running
  // at once read the same K/V prefix and share it through L2: sorting all spans' blocks by
  // length together puts one block of each length of every span side by side, and at 4 x 4096
  // each wave then read four times as many distinct K/V bytes (DRAM-latency bound). Blocks are
  // scheduled as SMs free up, so there is no wave boundary between spans. The sorts are
  // stable: tiles of equal length stay split-major and side by side.
  auto length = [](const AttentionWorkItem& it) { return it.kv_end - it.kv_start; };
  std::vector<int32_t> span_longest(num_spans, 0);
  for (const AttentionWorkItem& it : work->prefill_items) {
    span_longest[it.span] = std::max(span_longest[it.span], length(it));
  }
  std::stable_sort(work->prefill_items.begin(), work->prefill_items.end(),
                   [&](const AttentionWorkItem& a, const AttentionWorkItem& b) {
                     if (a.span != b.span) {
                       if (span_longest[a.span] != span_longest[b.span]) {
                         return span_longest[a.span] > span_longest[b.span];
                       }
                       return a.span < b.span;
                     }
                     return length(a) > length(b);
                   });
}

int PrefillHeadGroup(const AttentionSpan* spans, int num_spans, int num_kv_heads,
                     int64_t position_bytes, const AttentionPlanLimits& limits) {
  int64_t longest = 0;
  for (int i = 0; i < num_spans; ++i) longest = std::max<int64_t>(longest, spans[i].kv_len);
  const int64_t budget = limits.l2_bytes / 2, head_bytes = longest * position_bytes;
  if (budget <= 0 || head_bytes * num_kv_heads <= budget) return num_kv_heads;
  int group = 1;
  for (int g = 2; g < num_kv_heads; ++g) {
    if (num_kv_heads % g == 0 && head_bytes * g <= budget) group = g;
  }
  return group;
}

void SchedulePrefillJobs(int num_kv_heads, int blocks, AttentionWork* work) {
  work->prefill_jobs.clear();
  work->prefill_job_start.clear();
  const int64_t num_jobs = static_cast<int64_t>(work->prefill_items.size()) * num_kv_heads;
  if (blocks <= 0 || num_jobs == 0) return;
  const int grid = static_cast<int>(std::min<int64_t>(blocks, num_jobs));
  // List scheduling in PrefillJobOf's order (the planner's, by span, longest first, a group of
  // kv heads at a time, the group's heads of an item side by side): what the hardware's block
  // scheduler did with one block per job, decided here so that every block knows its next job
  // while it runs the current one. Ties go to the lower block, so the first `grid` jobs start on
  // blocks 0, 1, ... in order.
  using Load = std::pair<int64_t, int>;  // (estimated end, block)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> free_at;
  for (int b = 0; b < grid; ++b) free_at.push({0, b});
  std::vector<int32_t> owner(num_jobs);  // job j (PrefillJobOf's unit j) -> its block
  std::vector<int32_t> start(grid + 1, 0);
  const uint32_t num_items = static_cast<uint32_t>(work->prefill_items.size());
  const int head_group = work->prefill_head_group > 0 ? work->prefill_head_group : num_kv_heads;
  for (int64_t j = 0; j < num_jobs; ++j) {
    const AttentionWorkItem& item =
        work->prefill_items[PrefillJobOf(static_cast<uint32_t>(j), num_items, head_group).item];
    const auto [end, b] = free_at.top();
    free_at.pop();
    owner[j] = b;
    ++start[b + 1];
    free_at.push({end + int64_t{item.kv_end} - item.kv_start + kPrefillJobCost, b});
  }
  // Block-major, each block's jobs in the planner's order (a counting sort by owner).
  for (int b = 0; b < grid; ++b) start[b + 1] += start[b];
  work->prefill_job_start = start;
  work->prefill_jobs.resize(num_jobs);
  for (int64_t j = 0; j < num_jobs; ++j) {
    AttentionPrefillJob& job = work->prefill_jobs[start[owner[j]]++];
    const PrefillJobIndex at = PrefillJobOf(static_cast<uint32_t>(j), num_items, head_group);
    job.item = work->prefill_items[at.item];
    job.kv_head = at.kv_head;
  }
}

}  // namespace pagedattn::kernels
