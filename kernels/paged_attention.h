// Params structs and non-template entry points of the CUDA kernels: K/V append, paged
// attention over a varlen batch (with its split-KV work plan), and dtype conversion.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "common/capabilities.h"
#include "kernels/launch_status.h"

namespace pagedattn::kernels {

// x / d and x % d for 0 <= x < 2^31 with a multiply and a shift (d is a runtime page size).
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    shift = 0;
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier =
        static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
#ifdef __CUDACC__
  __device__ __forceinline__ uint32_t Div(uint32_t x) const {
    return (__umulhi(x, multiplier) + x) >> shift;
  }
#endif
};

// ---- Append ---------------------------------------------------------------------------------

// Writes num_tokens new K and V rows into the pool of one layer. Row i of k/v
// ([num_tokens][num_kv_heads][head_dim] in src_dtype) goes to pool slot slots[i]
// (= page * page_size + row in page), converted to cache_dtype.
struct AppendParams {
  const void* k = nullptr;
  const void* v = nullptr;
  DType src_dtype = DType::kUnspecified;
  void* k_cache = nullptr;  // [num_pages][num_kv_heads][page_size][head_dim]
  void* v_cache = nullptr;
  DType cache_dtype = DType::kUnspecified;
  const int64_t* slots = nullptr;
  int64_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
};

LaunchStatus LaunchAppendKv(const AppendParams& params, cudaStream_t stream);

// ---- Paged attention ------------------------------------------------------------------------

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
// 64/128, 8 warps of 16 rows for 256).
inline constexpr int kDecodeTileRows = 16;
inline constexpr int kDecodeWideTileRows = 32;
inline constexpr int kPrefillTileRows = 128;
// Warp layouts (query-row warps x KV-split warps) of the two decode tile shapes.
inline constexpr int kDecodeRowWarps = 1, kDecodeKvWarps = 4;
inline constexpr int kDecodeWideRowWarps = 2, kDecodeWideKvWarps = 2;
static_assert(kDecodeRowWarps * 16 == kDecodeTileRows &&
              kDecodeWideRowWarps * 16 == kDecodeWideTileRows);
inline constexpr int kKvTileRows = 64;  // Positions per pipeline stage; chunk multiple (but see
                                        // PlanAttentionWork's one-wave decode chunk).

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
  // The persistent Hopper prefill kernel's schedule (SchedulePrefillJobs): block b runs
  // prefill_jobs[prefill_job_start[b] .. prefill_job_start[b + 1]) in that order. Empty when
  // no schedule was asked for (the portable prefill kernel runs one block per item and head).
  std::vector<AttentionPrefillJob> prefill_jobs;
  std::vector<int32_t> prefill_job_start;

  // Blocks of the prefill schedule (PagedAttentionParams::num_prefill_blocks); 0 without one.
  int32_t num_prefill_blocks() const {
    return prefill_job_start.empty() ? 0 : static_cast<int32_t>(prefill_job_start.size() - 1);
  }
};

// How PlanAttentionWork may spread a launch's work over the GPU.
inline constexpr int kDefaultMinChunk = 256;
struct AttentionPlanLimits {
  // The blocks that carry equal work when KV is split: the tile blocks that run at once beside
  // one merge block (AttentionTargetBlocks).
  int target_blocks = 0;
  // The blocks that run at once when nothing is split (no merge block needs room beside the
  // tiles: AttentionTargetBlocks); 0 means target_blocks.
  int unsplit_blocks = 0;
  // How finely KV is split: a multiple of kKvTileRows; tests lower it.
  int min_chunk = kDefaultMinChunk;
};

// Splits the batch into tiles and, where batch * kv_heads cannot fill the GPU, each tile's KV
// range into chunks (flash-decoding), so that about limits.target_blocks blocks carry equal work.
void PlanAttentionWork(const AttentionSpan* spans, int num_spans, int num_q_heads, int num_kv_heads,
                       bool causal, const AttentionPlanLimits& limits, AttentionWork* work);

// Fills decode_first_pages and decode_wide_first_pages from page_table, the launch's page table
// as the spans index it (host memory).
void AttachFirstPages(const int32_t* page_table, int page_size, AttentionWork* work);

// The decode tile kernels run one block per (work item, kv head) in a one-dimensional grid,
// item-major (the kv heads of an item next to each other, so that the blocks running at once
// read whole pages). Its size: the block count, or an error naming both numbers when it is over
// the 2^31 - 1 blocks one grid dimension takes.
LaunchStatus TileGridBlocks(int64_t num_items, int num_kv_heads, unsigned* blocks);

// Deals the prefill items x kv heads to `blocks` persistent blocks (greedy, in the planner's
// order: each job goes to the block that is free first by an estimate of its length), so that
// each block's jobs run back to back and the next job's K/V loads overlap the end of the last.
// blocks <= 0 clears the schedule.
void SchedulePrefillJobs(int num_kv_heads, int blocks, AttentionWork* work);

// Blocks of the paged attention kernel that run at once on this device with room left on each
// SM for one separate-merge block (SMs * such blocks per SM): the target_blocks to plan for;
// and (unsplit_blocks, when not null) all that run at once: PlanAttentionWork's unsplit_blocks.
LaunchStatus AttentionTargetBlocks(DType kv_dtype, int head_dim, int* target_blocks,
                                   int* unsplit_blocks = nullptr);

// Which prefill tile kernel runs: kAuto picks the Hopper (wgmma) kernel where the build and
// the device have it, the portable (mma.sync) one elsewhere; kPortable forces the portable one
// (tests and benchmarks compare the two on the same GPU).
enum class PrefillPath : int32_t { kAuto = 0, kPortable = 1 };

// Blocks the persistent Hopper prefill kernel keeps resident on this device (SMs * blocks per
// SM) when `path` picks it and this head_dim runs persistent (128), 0 otherwise (the portable
// kernel, or one block per item): the `blocks` for SchedulePrefillJobs.
LaunchStatus PrefillScheduleBlocks(DType kv_dtype, int head_dim, PrefillPath path, int* blocks);

struct PagedAttentionParams {
  DType kv_dtype = DType::kUnspecified;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  FastDivmod page_div;      // SetDivisors (LaunchPagedAttention): page_size,
  FastDivmod kv_heads_div;  // and num_kv_heads.
  bool causal = true;
  float sm_scale = 0.f;
  PrefillPath prefill_path = PrefillPath::kAuto;

  const void* k_cache =
      nullptr;  // This layer's K pool: [num_pages][num_kv_heads][page_size][head_dim]
  const void* v_cache = nullptr;
  const int32_t* page_table = nullptr;

  const float* q = nullptr;  // [total_queries][num_q_heads][head_dim], float32
  float* out = nullptr;      // [total_queries][num_q_heads][head_dim], float32
  float* lse = nullptr;      // [total_queries][num_q_heads], natural log; null: not written

  const AttentionWorkItem* decode_items = nullptr;
  int32_t num_decode_items = 0;
  const AttentionWorkItem* decode_wide_items = nullptr;
  int32_t num_decode_wide_items = 0;
  // AttentionWork's decode_first_pages / decode_wide_first_pages; null: page ids from page_table.
  const ItemFirstPages* decode_first_pages = nullptr;
  const ItemFirstPages* decode_wide_first_pages = nullptr;
  const AttentionWorkItem* prefill_items = nullptr;
  int32_t num_prefill_items = 0;
  const AttentionMergeTask* merge_tasks = nullptr;
  int32_t num_merge_tasks = 0;
  float* partial_out = nullptr;  // [num_kv_heads][partial_rows][head_dim]
  float* partial_lse = nullptr;  // [num_kv_heads][partial_rows]
  int64_t partial_rows = 0;
  // [num_merge_tasks][num_kv_heads] split counters: zero before a launch, zero again after it
  // (the last split of a tile merges the tile and resets its counter). Unused with
  // separate_merge.
  int32_t* merge_counters = nullptr;
  bool separate_merge = false;  // AttentionWork::separate_merge
  int32_t merge_rows = 0;       // AttentionWork::merge_rows
  // AttentionWork's prefill schedule; the Hopper prefill kernel needs it (one block each of
  // num_prefill_blocks).
  const AttentionPrefillJob* prefill_jobs = nullptr;
  const int32_t* prefill_job_start = nullptr;  // num_prefill_blocks + 1 entries
  int32_t num_prefill_blocks = 0;
};

// Sets the params' divisors (page_div, kv_heads_div) from page_size and num_kv_heads, as
// LaunchPagedAttention does before it launches anything.
inline void SetDivisors(PagedAttentionParams* p) {
  p->page_div = FastDivmod(static_cast<uint32_t>(p->page_size));
  p->kv_heads_div = FastDivmod(static_cast<uint32_t>(p->num_kv_heads));
}

// Runs the decode-shape tiles, then the prefill-shape tiles; split tiles merge themselves, or
// (separate_merge) a merge kernel runs after them.
LaunchStatus LaunchPagedAttention(const PagedAttentionParams& params, cudaStream_t stream);

// ---- Conversion ---------------------------------------------------------------------------

// dst[i] = src[i] converted between any two of float32 / float16 / bfloat16.
LaunchStatus LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                           cudaStream_t stream);

}  // namespace pagedattn::kernels
