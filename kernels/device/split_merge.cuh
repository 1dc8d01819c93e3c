// Split-KV merges: the tile kernels' in-kernel merge by the last split of a tile, and the
// separate merge kernel (one block per merged row), both online over the splits' LSEs.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/device/dtype.cuh"
#include "kernels/device/mbarrier.cuh"
#include "kernels/device/profile.cuh"
#include "kernels/device/ptx.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// A merge warp's lanes own kMergeDims<D> consecutive dims of a row each: D / 32 where D is whole
// 64-element blocks; at 80 and 96 four, and the lanes past the row (12 of 32 at 80, 8 at 96) store
// nothing.
template <int D>
inline constexpr int kMergeDims = (D + 63) / 64 * 2;
template <int D>
__device__ __forceinline__ bool MergeLaneActive(int lane) {
  return D % 64 == 0 || lane * kMergeDims<D> < D;
}
// The first dim of the slice a lane loads: its own, and past the row the row's last slice. Every
// lane loads, so no load is predicated: ptxas then issues an unrolled loop's loads together, where
// loads predicated on MergeLaneActive went one split at a time into the same registers (each split
// one L2 round trip; the separate merge at 80 took 5.2-5.6 us alone against 4.1 at 128; 1 x 32768
// decode at 80 and 96, bf16 and FP8, 0.96-0.99x the time b2b since). What an idle lane sums is
// never stored.
template <int D>
__device__ __forceinline__ int MergeLaneFirstDim(int lane) {
  constexpr int kDims = kMergeDims<D>;
  return min(lane, D / kDims - 1) * kDims;
}

// acc += w * v for one lane's kDims floats of a partial O row.
template <int kDims>
struct SplitRowSlice {
  static_assert(kDims % 2 == 0, "whole float2s");
  static constexpr int kVec = kDims % 4 == 0 ? 4 : 2;
  float v[kDims];
  // Loads the slice at src through L2 (partials come from other blocks) in 16-byte loads where
  // the slice allows.
  __device__ __forceinline__ void Load(const float* src) {
#pragma unroll
    for (int d = 0; d < kDims; d += kVec) {
      if constexpr (kVec == 4) {
        const float4 x = __ldcg(reinterpret_cast<const float4*>(src + d));
        v[d] = x.x, v[d + 1] = x.y, v[d + 2] = x.z, v[d + 3] = x.w;
      } else {
        const float2 x = __ldcg(reinterpret_cast<const float2*>(src + d));
        v[d] = x.x, v[d + 1] = x.y;
      }
    }
  }
  __device__ __forceinline__ void AddTo(float (&acc)[kDims], float w) const {
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc[d] += w * v[d];
  }
};

// One lane's running merge of split partials (online over the splits): weight_sum and acc (its
// kDims dims of the O sum) are relative to e^run_max. Rebase raises the base to cover a
// split LSE (or a batch's largest), rescales what came before, and returns the base to take
// the new weights against (0 while every LSE so far is -inf, so that nothing is scaled by NaN).
template <int kDims>
struct SplitMergeState {
  float run_max = -INFINITY;
  float weight_sum = 0.f;
  float acc[kDims] = {};
  __device__ __forceinline__ float Rebase(float lse) {
    const float new_max = fmaxf(run_max, lse);
    const float base = new_max == -INFINITY ? 0.f : new_max;
    const float alpha = __expf(run_max - base);  // 0 while run_max is -inf
    run_max = new_max;
    weight_sum *= alpha;
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc[d] *= alpha;
    return base;
  }
};

// A merged row r of a task, out of one warp (lane: kMergeDims<D> consecutive dims): acc /
// weight_sum to out (in q's element type TIO), base + log(weight_sum) to lse, the row's sink (if
// any) joining both. Shared by both in-kernel merges.
template <typename TIO, int D>
__device__ __forceinline__ void WriteMergedRow(const PagedAttentionParams& p,
                                               const AttentionMergeTask& task,
                                               const AttentionSpan& span, int kv_head, int group,
                                               int r, const float (&acc)[kMergeDims<D>],
                                               float weight_sum, float base) {
  constexpr int kDims = kMergeDims<D>;
  const int lane = threadIdx.x & 31;
  const int span_row = task.row_start + r;
  const RowNorm norm = NormalizeMergedRow(p, weight_sum, base, kv_head, group, span_row);
  const int64_t out_row = OutputRow(p, span.q_offset, span_row, kv_head, group);
  TIO* dst = static_cast<TIO*>(p.out) + out_row * D + lane * kDims;
  if (MergeLaneActive<D>(lane)) {
#pragma unroll
    for (int d = 0; d < kDims; d += 2) StorePair(dst + d, acc[d] * norm.inv, acc[d + 1] * norm.inv);
  }
  if (p.lse && lane == 0) p.lse[out_row] = norm.lse;
}

// out = sum_s exp(lse_s - max) * out_s / sum_s exp(lse_s - max) over one tile's splits, one warp
// per row; lanes own kMergeDims<D> consecutive dims. Partials come from other blocks: read
// through L2. The splits go in batches whose LSEs (lane j: split j of the batch) and O slices
// are loaded together, merged online (the running max rescales what came before), so each
// batch costs one L2 round trip and none waits for a max over all splits first.
// Splits per merge batch in the decode tiles: at head_dim 128, up to 33 splits (one wave of 264
// blocks on 8 kv heads) take one batch.
// The narrow FP8 tile (256 threads at 128 registers) takes 9 at 128 too: 33 splits' slices
// (132 registers) spilled 300 bytes there.
constexpr int DecodeMergeBatch(int head_dim, int block_threads) {
  return head_dim == 128 && block_threads <= 128 ? 33 : 9;
}

template <typename TIO, int D, int kBatch>
__device__ __forceinline__ void MergeSplits(const PagedAttentionParams& p,
                                            const AttentionMergeTask& task,
                                            const AttentionSpan& span, int kv_head, int group) {
  constexpr int kDims = kMergeDims<D>;
  constexpr int kLseRegs = (kBatch + 31) / 32;  // lane j: LSEs of splits j, j + 32 of a batch
  static_assert(kBatch >= 1 && kBatch <= 64, "at most two LSEs per lane");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* part_lse = p.partial_lse + int64_t{kv_head} * p.partial_rows;
  const float* part_out = p.partial_out + int64_t{kv_head} * p.partial_rows * D;
  const int64_t out_step = int64_t{task.row_stride} * D;  // floats between splits' O rows
  for (int r = warp; r < task.num_rows; r += blockDim.x / 32) {
    const float* lse_r = part_lse + task.partial_row + r;  // split s at lse_r[s * row_stride]
    SplitMergeState<kDims> m;
    for (int s0 = 0; s0 < task.num_splits; s0 += kBatch) {
      const int n = min(kBatch, task.num_splits - s0);
      float my_lse[kLseRegs];
#pragma unroll
      for (int h = 0; h < kLseRegs; ++h) {
        const int j = lane + 32 * h;
        my_lse[h] = j < n ? __ldcg(lse_r + int64_t{s0 + j} * task.row_stride) : -INFINITY;
      }
      // The O slices of the batch, one pointer stepped from split to split.
      SplitRowSlice<kDims> x[kBatch];
      const float* src = part_out + (task.partial_row + int64_t{s0} * task.row_stride + r) * D +
                         MergeLaneFirstDim<D>(lane);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j < n) x[j].Load(src);
        src += out_step;
      }
      float batch_max = my_lse[0];
#pragma unroll
      for (int h = 1; h < kLseRegs; ++h) batch_max = fmaxf(batch_max, my_lse[h]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
        batch_max = fmaxf(batch_max, __shfl_xor_sync(0xffffffffu, batch_max, o));
      const float base = m.Rebase(batch_max);
      float my_weight[kLseRegs];
      float batch_sum = 0.f;
#pragma unroll
      for (int h = 0; h < kLseRegs; ++h) {
        my_weight[h] = lane + 32 * h < n ? __expf(my_lse[h] - base) : 0.f;
        batch_sum += my_weight[h];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) batch_sum += __shfl_xor_sync(0xffffffffu, batch_sum, o);
      m.weight_sum += batch_sum;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w = __shfl_sync(0xffffffffu, my_weight[j / 32], j % 32);
        if (j < n) x[j].AddTo(m.acc, w);
      }
    }
    WriteMergedRow<TIO, D>(p, task, span, kv_head, group, r, m.acc, m.weight_sum, m.run_max);
  }
}

// The merge of the prefill tiles, whose registers the batched merge above would spill (it did at
// head_dim 128: 255 registers and a 184-byte stack in the Hopper prefill kernel): the LSE max
// first, then the O rows eight splits at a time in float2 loads. Split prefill tiles are rare
// (chunked prefill over a long history); their merge is not on the decode path.
// Run by the block's first num_warps warps.
template <typename TIO, int D>
__device__ __forceinline__ void MergeSplitsTwoPass(const PagedAttentionParams& p,
                                                   const AttentionMergeTask& task,
                                                   const AttentionSpan& span, int kv_head,
                                                   int group, int num_warps) {
  constexpr int kDims = kMergeDims<D>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* part_lse = p.partial_lse + int64_t{kv_head} * p.partial_rows;
  const float* part_out = p.partial_out + int64_t{kv_head} * p.partial_rows * D;
  for (int r = warp; r < task.num_rows; r += num_warps) {
    float max_lse = -INFINITY;
    for (int s = lane; s < task.num_splits; s += 32) {
      max_lse = fmaxf(max_lse, __ldcg(part_lse + task.partial_row + s * task.row_stride + r));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, o));
    const float base = max_lse == -INFINITY ? 0.f : max_lse;
    float weight_sum = 0.f;
    float acc[kDims];
#pragma unroll
    for (int j = 0; j < kDims; ++j) acc[j] = 0.f;
    for (int s0 = 0; s0 < task.num_splits; s0 += 32) {
      const int n = min(32, task.num_splits - s0);
      const float my_weight =
          lane < n
              ? __expf(__ldcg(part_lse + task.partial_row + (s0 + lane) * task.row_stride + r) -
                       base)
              : 0.f;
      weight_sum += my_weight;
#pragma unroll 8
      for (int j = 0; j < n; ++j) {
        const float w = __shfl_sync(0xffffffffu, my_weight, j);
        const int64_t row = task.partial_row + (s0 + j) * task.row_stride + r;
        const float* src = part_out + row * D + MergeLaneFirstDim<D>(lane);
#pragma unroll
        for (int d = 0; d < kDims; d += 2) {
          const float2 v = __ldcg(reinterpret_cast<const float2*>(src + d));
          acc[d] += w * v.x;
          acc[d + 1] += w * v.y;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) weight_sum += __shfl_xor_sync(0xffffffffu, weight_sum, o);
    WriteMergedRow<TIO, D>(p, task, span, kv_head, group, r, acc, weight_sum, base);
  }
}

// Split-KV: the last split of a tile to finish merges all of them (no second launch). Called
// by every thread of the block after its partials are written, or with kThreads > 0 by the
// block's first kThreads threads only (a warp-specialized block's consumers), which then meet at
// named barrier kMergeBarrier. kBatch: the batched merge's splits per batch (decode tiles), or
// kTwoPassMerge (prefill tiles: MergeSplitsTwoPass).
inline constexpr int kTwoPassMerge = 0;
inline constexpr int kMergeBarrier = 15;
template <typename TIO, int D, int kBatch, int kThreads = 0>
__device__ __forceinline__ void MergeIfLastSplit(const PagedAttentionParams& p,
                                                 const AttentionWorkItem& item,
                                                 const AttentionSpan& span, int kv_head,
                                                 int group) {
  if (item.partial_row < 0 || p.separate_merge) return;
  auto sync = [] {
    if constexpr (kThreads == 0) {
      __syncthreads();
    } else {
      NamedBarrierSync(kMergeBarrier, kThreads);
    }
  };
  __shared__ int is_last_split;
  const AttentionMergeTask task = p.merge_tasks[item.merge_task];
  int* counter = p.merge_counters + int64_t{item.merge_task} * p.num_kv_heads + kv_head;
  __threadfence();  // this split's partials are visible before it is counted
  sync();
  if (threadIdx.x == 0) {
    is_last_split = atomicAdd(counter, 1) == task.num_splits - 1;
    // The last split reads the others' partials after the barrier below: the counting
    // thread's fence orders those reads after the count (each writer fenced before counting).
    if (is_last_split) __threadfence();
  }
  sync();
  if (is_last_split) {
    if constexpr (kBatch == kTwoPassMerge) {
      MergeSplitsTwoPass<TIO, D>(p, task, span, kv_head, group,
                                 kThreads == 0 ? blockDim.x / 32 : kThreads / 32);
    } else {
      MergeSplits<TIO, D, kBatch>(p, task, span, kv_head, group);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
  }
}

// ---- The separate merge (PagedAttentionParams::separate_merge) ------------------------------

// One block per (merge task, row, kv head): warp w merges splits w, w + 8, ... of the row online,
// each split's LSE and O slice loaded together (the loop is unrolled by four, so four splits'
// loads can be in flight), so the partial rows of all splits are read with 8 warps' loads in
// flight rather than one warp's; the warps' (max, sum, O) are combined in shared memory.
// At most 64 registers, so that a block fits beside two decode tile blocks on an SM and is
// resident, waiting, before they end (Launcher::LaunchPair).
inline constexpr int kMergeThreads = 256;

template <typename TIO, int D>
__global__ void __launch_bounds__(kMergeThreads, 4)
    MergeSplitsKernel(const __grid_constant__ PagedAttentionParams p) {
  constexpr int kWarps = kMergeThreads / 32, kDims = kMergeDims<D>;
  // Launched right after the tiles (Launcher::LaunchPair), it may start before they end:
  // its task (written before the launch, by the host) is read while they run, so that only the
  // partials' loads follow the wait for their grid's end.
  const AttentionMergeTask task = p.merge_tasks[blockIdx.x];
  const int r = blockIdx.y, kv_head = blockIdx.z;
  if (r >= task.num_rows) return;
#define PAGEDATTN_MERGE_STAMP(event)                                                           \
  PAGEDATTN_STAMP(                                                                             \
      p,                                                                                       \
      profile::SlotOf(profile::kMerge,                                                         \
                      (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x), \
      profile::event)
  PAGEDATTN_MERGE_STAMP(kMergeEntry);
  WaitForPrerequisiteGrids();
  PAGEDATTN_MERGE_STAMP(kMergeWaited);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* lse = p.partial_lse + int64_t{kv_head} * p.partial_rows + task.partial_row + r;
  const float* part =
      p.partial_out + (int64_t{kv_head} * p.partial_rows + task.partial_row + r) * D;
  __shared__ float red[kWarps][D];
  __shared__ float red_max[kWarps], red_sum[kWarps];

  SplitMergeState<kDims> m;
  const bool active = MergeLaneActive<D>(lane);
#pragma unroll 4
  for (int s = warp; s < task.num_splits; s += kWarps) {
    const int64_t row = int64_t{s} * task.row_stride;
    const float split_lse = __ldcg(lse + row);
    SplitRowSlice<kDims> x;
    x.Load(part + row * D + MergeLaneFirstDim<D>(lane));
    const float w = __expf(split_lse - m.Rebase(split_lse));
    m.weight_sum += w;
    x.AddTo(m.acc, w);
  }
  if (active) {
#pragma unroll
    for (int j = 0; j < kDims; ++j) red[warp][lane * kDims + j] = m.acc[j];
  }
  if (lane == 0) {
    red_max[warp] = m.run_max;
    red_sum[warp] = m.weight_sum;
  }
  __syncthreads();

  // The warps' sums rescaled to the largest of their maxima.
  float max_all = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) max_all = fmaxf(max_all, red_max[w]);
  const float base = max_all == -INFINITY ? 0.f : max_all;
  float scale[kWarps];
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    scale[w] = __expf(red_max[w] - base);  // 0 for a warp that had no split
    total += red_sum[w] * scale[w];
  }
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_row = task.row_start + r;
  const RowNorm norm = NormalizeMergedRow(p, total, base, kv_head, group, span_row);
  const int64_t out_row = OutputRow(p, task.q_offset, span_row, kv_head, group);
  for (int d = threadIdx.x; d < D; d += kMergeThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][d] * scale[w];
    static_cast<TIO*>(p.out)[out_row * D + d] = FromFloat<TIO>(sum * norm.inv);
  }
  if (p.lse && threadIdx.x == 0) p.lse[out_row] = norm.lse;
  PAGEDATTN_MERGE_STAMP(kMergeExit);
#undef PAGEDATTN_MERGE_STAMP
}

template <typename TIO, int D>
KernelLaunch MergeSplitsLaunch(const PagedAttentionParams& params) {
  return {reinterpret_cast<const void*>(MergeSplitsKernel<TIO, D>),
          dim3(params.num_merge_tasks, params.merge_rows, params.num_kv_heads), dim3(kMergeThreads),
          0};
}

// The separate merge for one head_dim and out's element type TIO.
#define PAGEDATTN_INSTANTIATE_MERGE(TIO, D) \
  template KernelLaunch MergeSplitsLaunch<TIO, D>(const PagedAttentionParams&);

}  // namespace pagedattn::kernels
