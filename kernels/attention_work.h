// The work of one paged attention launch as the kernels read it (spans, tiles of query rows,
// split-KV merge tasks, the Hopper prefill schedule) and the host functions that plan it.
#pragma once

#include <cstdint>
#include <vector>

#include "common/capabilities.h"
#include "kernels/launch_status.h"

namespace pagedattn::kernels {

// One span of the batch as the attention kernels see it.
struct AttentionSpan {
  int64_t q_offset = 0;           // Row of the span's first query in q / out / lse.
  int64_t page_table_offset = 0;  // Index into page_table of the span's first page.
  int32_t num_queries = 0;        // Queries at positions kv_len-num_queries..kv_len-1.
  int32_t kv_len = 0;             // Positions attended: 0..kv_len-1.
};

// One block's work: a tile of a span's rows (row = query * gqa_group + head in group) against
// positions [kv_start, kv_end). partial_row < 0: the tile's only split, written to out
// directly; otherwise written to the partial buffers and combined by a merge task.
struct AttentionWorkItem {
  AttentionSpan span_info;  // Copy of spans[span]: saves the kernel a dependent load at start.
  int32_t span = 0;
  int32_t row_start = 0;
  int32_t kv_start = 0;
  int32_t kv_end = 0;
  int32_t partial_row = -1;
  int32_t merge_task = -1;  // Index of the tile's merge task when split.
};

// The page-table entries of a decode work item's first kItemPages pages, from the page holding
// its kv_start on (0 past its span's last page; AttachFirstPages): with them the tile's first
// copies wait for no page-table load after the item's. At most 32 (a warp's lanes hold one each).
inline constexpr int kItemPages = 32;
static_assert(kItemPages <= 32, "a warp's lanes hold an item's first pages, one each");
struct ItemFirstPages {
  int32_t ids[kItemPages] = {};
};

// The (prefill item, kv head) of prefill job `unit` in the order the prefill blocks run: the kv
// heads in groups of head_group (a divisor of the kv heads, PrefillHeadGroup), group after
// group; within a group item-major (the planner's order), the group's kv heads of an item side
// by side. One group of every kv head: item-major. Host and device.
struct PrefillJobIndex {
  uint32_t item = 0;
  int kv_head = 0;
};
constexpr PrefillJobIndex PrefillJobOf(uint32_t unit, uint32_t num_items, int head_group) {
  const uint32_t g = static_cast<uint32_t>(head_group);
  const uint32_t per_group = num_items * g;
  const uint32_t group = unit / per_group, in_group = unit - group * per_group;
  const uint32_t item = in_group / g;
  return {item, static_cast<int>(group * g + (in_group - item * g))};
}

// One job of the persistent Hopper prefill kernel: a prefill work item for one kv head, copied
// whole so that a block reads its next job with one load (no item lookup behind it).
struct AttentionPrefillJob {
  AttentionWorkItem item;
  int32_t kv_head = 0;
  int32_t reserved = 0;
};
static_assert(sizeof(AttentionPrefillJob) % 4 == 0, "the kernel copies jobs word by word");

// Combines num_splits partial results of one tile (split s at partial_row + s * row_stride);
// done by whichever split finishes last, or by the merge kernel after the tile kernels when the
// plan says separate_merge.
struct AttentionMergeTask {
  int64_t q_offset = 0;  // spans[span].q_offset: where the tile's rows go in out / lse.
  int32_t span = 0;
  int32_t row_start = 0;
  int32_t num_rows = 0;
  int32_t num_splits = 0;
  int32_t partial_row = 0;
  int32_t row_stride = 0;
};

// Rows per tile of the three tile shapes. A span's rows (num_queries * gqa_group) all fit one
// tile up to 32 rows, so each K/V page is read once for every query head of its group:
// decode (16 rows; the 4 warps split each KV tile), wide decode (32 rows; 2 row warps x 2 KV
// warps), and prefill (128 rows, kernels/prefill_mma_kernel.cuh: 4 warps of 32 rows for head_dim
// 64-128, 8 warps of 16 rows for 192 and 256; at 512 blocks of 64 rows, 4 warps of 16).
inline constexpr int kDecodeTileRows = 16;
inline constexpr int kDecodeWideTileRows = 32;
inline constexpr int kPrefillTileRows = 128;
// Warp layouts (query-row warps x KV-split warps) of the two decode tile shapes; the narrow tile
// (RunsNarrowDecode, paged_attention.h) is the 16-row shape with eight KV-split warps.
inline constexpr int kDecodeRowWarps = 1, kDecodeKvWarps = 4;
inline constexpr int kDecodeWideRowWarps = 2, kDecodeWideKvWarps = 2;
inline constexpr int kDecodeNarrowKvWarps = 8, kDecodeNarrowRows = 8;
static_assert(kDecodeRowWarps * 16 == kDecodeTileRows &&
              kDecodeWideRowWarps * 16 == kDecodeWideTileRows);
inline constexpr int kKvTileRows = 64;  // Positions per pipeline stage; chunk multiple (but see
                                        // PlanAttentionWork's one-wave decode chunk).

// Which prefill tile kernel runs: kAuto picks the Hopper (wgmma) kernel where the build and
// the device have it, the portable (mma.sync) one elsewhere; kPortable forces the portable one
// (tests and benchmarks compare the two on the same GPU).
enum class PrefillPath : int32_t { kAuto = 0, kPortable = 1 };

// The work of one launch, built on the host by PlanAttentionWork and uploaded as is.
struct AttentionWork {
  std::vector<AttentionWorkItem> decode_items;       // 16-row tiles
  std::vector<AttentionWorkItem> decode_wide_items;  // 32-row tiles
  // Beside each decode item, its first pages (AttachFirstPages; empty when not attached).
  std::vector<ItemFirstPages> decode_first_pages;
  std::vector<ItemFirstPages> decode_wide_first_pages;
  std::vector<AttentionWorkItem> prefill_items;  // 128-row tiles, by span, longest first
  std::vector<AttentionMergeTask> merge_tasks;
  int64_t partial_rows = 0;  // Rows of the partial buffers per kv head.
  int32_t kv_chunk = 0;      // Positions per split (the split-KV chunk), for logs and tests.
  // Where the splits are merged. In the tile kernels, the last split of a tile merges all of its
  // rows alone, a serial tail of num_splits * rows partial rows at the end of the launch; cheap
  // for the usual decode tile (4-8 rows) but not for a wide one cut in hundreds of splits
  // (32 q heads on 1 kv head). separate_merge: a second kernel merges every (task, row, kv
  // head) in its own block instead, at the price of a launch.
  bool separate_merge = false;
  int32_t merge_rows = 0;  // Rows of the largest merge task.
  // Decode tile blocks an SM may hold at once; 0: as many as fit. A plan that splits nothing
  // asks for one fewer than fit where that finishes its waves sooner
  // (AttentionPlanLimits::fewer_blocks_rate).
  int32_t decode_blocks_per_sm = 0;
  // Every 16-row decode tile holds at most kDecodeNarrowRows rows (decode at GQA up to 8): an FP8
  // cache's tiles may then run the narrow kernel (eight warps, the transposed step alone).
  bool narrow_decode = false;
  // Every 16-row decode tile is cut in exactly two splits, merged in the tiles (not apart): where
  // the narrow tile runs, its two blocks then run as a cluster and merge through each other's
  // shared memory (DecodeTileKernelNarrowPair), and decode_items holds each tile's two splits
  // side by side (as it does under narrow_decode: one tile a span, its splits in order).
  bool pair_merge = false;
  // The persistent Hopper prefill kernel's schedule (SchedulePrefillJobs): block b runs
  // prefill_jobs[prefill_job_start[b] .. prefill_job_start[b + 1]) in that order. Empty when
  // no schedule was asked for (the portable prefill kernel runs one block per item and head).
  std::vector<AttentionPrefillJob> prefill_jobs;
  std::vector<int32_t> prefill_job_start;
  // The kv heads whose prefill jobs run together (PrefillJobOf); 0: every kv head.
  int32_t prefill_head_group = 0;

  // Blocks of the prefill schedule (PagedAttentionParams::num_prefill_blocks); 0 without one.
  int32_t num_prefill_blocks() const {
    return prefill_job_start.empty() ? 0 : static_cast<int32_t>(prefill_job_start.size() - 1);
  }
};

// How a plan may spread a launch's work over one device (QueryPlanLimits in paged_attention.h
// answers them per device, cache dtype and head_dim; host tests give their own).
inline constexpr int kDefaultMinChunk = 256;
struct AttentionPlanLimits {
  // The blocks that carry equal work when KV is split: the tile blocks that run at once beside
  // one merge block.
  int target_blocks = 0;
  // The blocks that run at once when nothing is split (no merge block needs room beside the
  // tiles); 0 means target_blocks.
  int unsplit_blocks = 0;
  // The decode tile's blocks an SM (unsplit_blocks = SMs x this / DecodeTileBlocks); 0: unknown.
  int decode_blocks_per_sm = 0;
  // An SM's decode rate with one tile block fewer than decode_blocks_per_sm, relative to its rate
  // with all of them; 0: not measured (a plan never asks for fewer). Where a launch's last wave
  // would hold few blocks, one block an SM fewer can finish in fewer waves' time: a tile bound by
  // its own dependent chains (FP8) runs a short last wave nearly as long as a full one.
  double fewer_blocks_rate = 0;
  // How finely KV is split: a multiple of kKvTileRows; tests lower it.
  int min_chunk = kDefaultMinChunk;
  // Blocks of the persistent Hopper prefill kernel (SchedulePrefillJobs); 0 where the prefill
  // tiles run one block per item (the portable kernel, or a head_dim that is not persistent).
  int prefill_blocks = 0;
  // Prefill tiles that run at once on the kernel that runs them (its blocks an SM x SMs: one
  // tile a block, or a persistent block's current job); 0: unknown, counted as target_blocks. A
  // plan of prefill tiles alone is estimated against these with no wave boundary: its blocks
  // start as others end, longest first.
  int prefill_tile_blocks = 0;
  // The device's L2 cache in bytes (PrefillHeadGroup); 0: unknown, every kv head together.
  int64_t l2_bytes = 0;
  // The prefill kernel these limits were asked for.
  PrefillPath prefill_path = PrefillPath::kAuto;
  // Tiles of several blocks (head_dim 512, SplitsColumns in paged_attention.h): a split tile
  // merges in the separate merge kernel, and its partial rows are its rows only (not a whole
  // tile's).
  bool wide_head = false;
  // false: every span runs on prefill tiles (no decode tiles for this cache dtype and head_dim
  // on this device: HasDecodeTiles, or a 512 decode tile over the device's shared memory).
  bool decode_tiles = true;
  // The device launches thread block clusters (compute capability 9.0 on): a plan may then merge
  // two-split tiles by pairs (AttentionWork::pair_merge).
  bool cluster_launch = false;
};

// Splits the batch into tiles and, where batch * kv_heads cannot fill the GPU, each tile's KV
// range into chunks (flash-decoding), so that about limits.target_blocks blocks carry equal work.
// window > 0 (a sliding window): a tile's range starts where its first query's window does, so
// only the window's pages are read.
void PlanAttentionWork(const AttentionSpan* spans, int num_spans, int num_q_heads, int num_kv_heads,
                       bool causal, int32_t window, const AttentionPlanLimits& limits,
                       AttentionWork* work);

// Fills decode_first_pages and decode_wide_first_pages from page_table, the launch's page table
// as the spans index it (host memory).
void AttachFirstPages(const int32_t* page_table, int page_size, AttentionWork* work);

// The decode tile kernels run one block per (work item, kv head) in a one-dimensional grid,
// item-major (the kv heads of an item next to each other, so that the blocks running at once
// read whole pages). Its size: the block count, or an error naming both numbers when it is over
// the 2^31 - 1 blocks one grid dimension takes.
LaunchStatus TileGridBlocks(int64_t num_items, int num_kv_heads, unsigned* blocks);

// The kv heads whose prefill jobs run together (AttentionWork::prefill_head_group): all of them
// where a span's K/V for every kv head (position_bytes a position and kv head, in the prefill
// tiles' dtype) fit half of limits.l2_bytes, else the largest divisor of num_kv_heads whose
// heads' K/V of the longest span fit it (at least 1). The blocks running at once read one
// span's K/V prefix, each its kv head's: with every head, 1 x 32768's 64 MiB at head_dim 64
// (128 at 128) over the H200's 50 MiB of L2 (docs/PERFORMANCE.md#design-decisions).
int PrefillHeadGroup(const AttentionSpan* spans, int num_spans, int num_kv_heads,
                     int64_t position_bytes, const AttentionPlanLimits& limits);

// Deals the prefill items x kv heads to `blocks` persistent blocks (greedy, in PrefillJobOf's
// order for work->prefill_head_group: each job goes to the block that is free first by an
// estimate of its length), so that each block's jobs run back to back and the next job's K/V
// loads overlap the end of the last. blocks <= 0 clears the schedule.
void SchedulePrefillJobs(int num_kv_heads, int blocks, AttentionWork* work);

}  // namespace pagedattn::kernels
