// The paged attention tile kernel: device body, thin __global__ and host launcher, templated
// on (cache dtype, head_dim, warp layout). Included only by the per-head-dim .cu files.
//
// A block takes one work item: up to MW*16 query rows (row = query * group + head in group,
// all of one kv head) against a KV range, streamed through a cp.async pipeline of 64-position
// tiles gathered through the page table. S = Q.K^T and O += P.V run on tensor cores
// (mma.m16n8k16, f32 accumulators) with an online softmax between them. With KW > 1 the warps
// share the query rows and split each KV tile, and combine their softmax states at the end;
// this is the decode shape, where each K/V byte is read once for every head of its GQA group.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cfloat>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/device_once.h"
#include "kernels/graph_launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// ---- Small device helpers ---------------------------------------------------------------

template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// c += a * b for one m16n8k16 tile (a row-major 16x16, b col-major 16x8, c f32 16x8).
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);
template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// 16-byte global -> shared copy; when !valid the destination is zero-filled and src unread.
__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(src),
               "r"(src_size)
               : "memory");
}
// CpAsync16 with an L2 cache policy (a createpolicy value).
__device__ __forceinline__ void CpAsync16Policy(uint32_t smem_addr, const void* src, bool valid,
                                                uint64_t policy) {
  const int src_size = valid ? 16 : 0;
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr),
      "l"(src), "r"(src_size), "l"(policy)
      : "memory");
}
// The L2 policy of data read once: its lines are the first evicted.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 2^x on the SFU alone (ex2.approx.ftz: no range fix-up around it); 2^-inf = 0.
// Results below 2^-126 flush to 0: a softmax weight that small adds nothing to a sum that
// holds its row's largest weight (1 when the base was set, up to 2^kRescaleSlack).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- Tile configuration -------------------------------------------------------------------

// Pipeline depth by head_dim: 3 stages at 64 (four blocks an SM) and 128 (two), 2 at 256 (one);
// a fourth stage at 64 costs a block an SM (docs/PERFORMANCE.md#occupancy).
constexpr int DefaultStages(int head_dim) { return head_dim <= 128 ? 3 : 2; }

template <typename T, int D, int MW, int KW>
struct AttentionTileConfig {
  static_assert(MW * KW == 4, "four warps per block");
  static constexpr int kThreads = 128;
  static constexpr int kTileKv = kKvTileRows;   // positions per pipeline stage
  static constexpr int kWarpKv = kTileKv / KW;  // positions per warp per stage
  static constexpr int kRows = MW * 16;         // query rows per block
  static constexpr int kChunks = D / 8;         // 16-byte chunks per K/V row
  static constexpr int kRowsPerThread = kTileKv * kChunks / kThreads;  // rows each thread copies
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kStages = DefaultStages(D);
  static constexpr bool kQInRegisters = D <= 128;
  static constexpr int kStageElems = 2 * kTileKv * D;  // K tile then V tile
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageElems * sizeof(T);
  static constexpr int kRedStride = D + 8;  // padded O rows: a warp's 8 rows hit distinct banks
  static constexpr size_t kReduceFloats = size_t{KW} * kRows * (kRedStride + 2);  // O, max, sum
  static constexpr size_t kReduceBytes = KW > 1 ? kReduceFloats * sizeof(float) : 0;
  static constexpr size_t kQBytes = size_t{kRows} * D * sizeof(T);
  static constexpr size_t SmemBytes() {
    return (kPipelineBytes > kReduceBytes ? kPipelineBytes : kReduceBytes) + kQBytes;
  }
  static_assert(kWarpKv % 16 == 0, "each warp takes whole 16-position steps");
  static_assert(kTileKv * kChunks % kThreads == 0, "copy chunks divide among threads");
};

// Element offset, in the K or V pool ([page][kv_head][page_size][D]), of 16-byte chunk `chunk`
// of KV position pos of kv head kv_head, pos lying in page page_id.
template <int D>
__device__ __forceinline__ int64_t KvChunkOffset(const PagedAttentionParams& p, int page_id,
                                                 int pos, int kv_head, int chunk) {
  const uint32_t in_page = pos - p.page_div.Div(pos) * p.page_size;
  return ((int64_t{page_id} * p.num_kv_heads + kv_head) * p.page_size + in_page) * D + chunk * 8;
}

// Element offset of (row, 16-byte chunk) in a swizzled [rows][D] tile: the chunk index is
// XORed with row % 8 so that the eight rows an ldmatrix reads hit eight different bank groups.
template <int D>
__device__ __forceinline__ int SwizzledOffset(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
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

// Programmatic dependent launch (sm_90+; no-ops when nothing is launched that way): a kernel
// lets the dependent kernel after it be scheduled, and the dependent waits until the kernel
// before it has completed and its writes are visible.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// This block's work item and kv head in an item-major grid (TileGridBlocks: the kv heads of one
// work item are neighbours in launch order), by a multiply-shift (kv_heads_div) rather than an
// integer division, so that nothing slow stands before the item's load.
struct ItemMajorBlock {
  uint32_t item;
  int kv_head;
};
__device__ __forceinline__ ItemMajorBlock ItemMajor(const PagedAttentionParams& p) {
  const uint32_t item = p.kv_heads_div.Div(blockIdx.x);
  return {item, static_cast<int>(blockIdx.x - item * p.num_kv_heads)};
}

__device__ __forceinline__ void WaitForPrerequisiteGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Row of out / lse for row span_row (= query * group + head in group) of the span whose first
// query is at q_offset.
__device__ __forceinline__ int64_t OutputRow(const PagedAttentionParams& p, int64_t q_offset,
                                             int span_row, int kv_head, int group) {
  return (q_offset + span_row / group) * p.num_q_heads + kv_head * group + span_row % group;
}

// A merged row r of a task, out of one warp (lane: D/32 consecutive dims): acc / weight_sum to
// out, base + log(weight_sum) to lse. Shared by both merges.
template <int D>
__device__ __forceinline__ void WriteMergedRow(const PagedAttentionParams& p,
                                               const AttentionMergeTask& task,
                                               const AttentionSpan& span, int kv_head, int group,
                                               int r, const float (&acc)[D / 32], float weight_sum,
                                               float base) {
  constexpr int kDims = D / 32;
  const int lane = threadIdx.x & 31;
  const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
  const int span_row = task.row_start + r;
  const int64_t out_row = OutputRow(p, span.q_offset, span_row, kv_head, group);
  float* dst = p.out + out_row * D + lane * kDims;
#pragma unroll
  for (int d = 0; d < kDims; d += 2) {
    *reinterpret_cast<float2*>(dst + d) = make_float2(acc[d] * inv, acc[d + 1] * inv);
  }
  if (p.lse && lane == 0) p.lse[out_row] = weight_sum > 0.f ? base + __logf(weight_sum) : -INFINITY;
}

// out = sum_s exp(lse_s - max) * out_s / sum_s exp(lse_s - max) over one tile's splits, one warp
// per row; lanes own D/32 consecutive dims. Partials come from other blocks: read through L2.
// The splits go in batches whose LSEs (lane j: split j of the batch) and O slices are loaded
// together, merged online (the running max rescales what came before), so each batch costs
// one L2 round trip and none waits for a max over all splits first.
// Splits per merge batch in the decode tiles: at head_dim 128, up to 33 splits (one wave of 264
// blocks on 8 kv heads) take one batch.
constexpr int DecodeMergeBatch(int head_dim) { return head_dim == 128 ? 33 : 9; }

template <int D, int kBatch>
__device__ __forceinline__ void MergeSplits(const PagedAttentionParams& p,
                                            const AttentionMergeTask& task,
                                            const AttentionSpan& span, int kv_head, int group) {
  constexpr int kDims = D / 32;
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
      const float* src =
          part_out + (task.partial_row + int64_t{s0} * task.row_stride + r) * D + lane * kDims;
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
    WriteMergedRow<D>(p, task, span, kv_head, group, r, m.acc, m.weight_sum, m.run_max);
  }
}

// The merge of the prefill tiles, whose registers the batched merge above would spill (it did at
// head_dim 128: 255 registers and a 184-byte stack in the Hopper prefill kernel): the LSE max
// first, then the O rows eight splits at a time in float2 loads. Split prefill tiles are rare
// (chunked prefill over a long history); their merge is not on the decode path.
template <int D>
__device__ __forceinline__ void MergeSplitsTwoPass(const PagedAttentionParams& p,
                                                   const AttentionMergeTask& task,
                                                   const AttentionSpan& span, int kv_head,
                                                   int group) {
  constexpr int kDims = D / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* part_lse = p.partial_lse + int64_t{kv_head} * p.partial_rows;
  const float* part_out = p.partial_out + int64_t{kv_head} * p.partial_rows * D;
  for (int r = warp; r < task.num_rows; r += blockDim.x / 32) {
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
        const float* src = part_out + row * D + lane * kDims;
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
    WriteMergedRow<D>(p, task, span, kv_head, group, r, acc, weight_sum, base);
  }
}

// Where row tile_row (span row span_row) of a work item's tile goes: out / lse (lse null when
// not asked for) for an unsplit tile, the partial buffers of its split otherwise.
template <int D>
__device__ __forceinline__ void TileRowDestination(const PagedAttentionParams& p,
                                                   const AttentionWorkItem& item,
                                                   const AttentionSpan& span, int kv_head,
                                                   int group, int tile_row, int span_row,
                                                   float*& dst, float*& lse_dst) {
  if (item.partial_row < 0) {
    const int64_t out_row = OutputRow(p, span.q_offset, span_row, kv_head, group);
    dst = p.out + out_row * D;
    lse_dst = p.lse ? p.lse + out_row : nullptr;
  } else {
    const int64_t part_row = int64_t{kv_head} * p.partial_rows + item.partial_row + tile_row;
    dst = p.partial_out + part_row * D;
    lse_dst = p.partial_lse + part_row;
  }
}

// Writes one normalized row of a tile's output (o * inv, this thread's two columns of every
// 8-wide n tile, o_half selecting the row's pair): to out/lse for an unsplit tile, to the
// partial buffers of its split otherwise. Shared by the decode and prefill tile kernels.
template <int D>
__device__ __forceinline__ void WriteTileRow(const PagedAttentionParams& p,
                                             const AttentionWorkItem& item,
                                             const AttentionSpan& span, int kv_head, int group,
                                             int tile_row, int span_row, int quad_col,
                                             const float (&o)[D / 8][4], int o_half, float inv,
                                             float lse) {
  float* dst;
  float* lse_dst;
  TileRowDestination<D>(p, item, span, kv_head, group, tile_row, span_row, dst, lse_dst);
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    *reinterpret_cast<float2*>(dst + dt * 8 + 2 * quad_col) =
        make_float2(o[dt][2 * o_half] * inv, o[dt][2 * o_half + 1] * inv);
  }
  if (lse_dst && quad_col == 0) *lse_dst = lse;
}

// Split-KV: the last split of a tile to finish merges all of them (no second launch). Called
// by every thread of the block after its partials are written. kBatch: the batched merge's
// splits per batch (decode tiles), or kTwoPassMerge (prefill tiles: MergeSplitsTwoPass).
inline constexpr int kTwoPassMerge = 0;
template <int D, int kBatch>
__device__ __forceinline__ void MergeIfLastSplit(const PagedAttentionParams& p,
                                                 const AttentionWorkItem& item,
                                                 const AttentionSpan& span, int kv_head,
                                                 int group) {
  if (item.partial_row < 0 || p.separate_merge) return;
  __shared__ int is_last_split;
  const AttentionMergeTask task = p.merge_tasks[item.merge_task];
  int* counter = p.merge_counters + int64_t{item.merge_task} * p.num_kv_heads + kv_head;
  __threadfence();  // this split's partials are visible before it is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last_split = atomicAdd(counter, 1) == task.num_splits - 1;
    // The last split reads the others' partials after the barrier below: the counting
    // thread's fence orders those reads after the count (each writer fenced before counting).
    if (is_last_split) __threadfence();
  }
  __syncthreads();
  if (is_last_split) {
    if constexpr (kBatch == kTwoPassMerge) {
      MergeSplitsTwoPass<D>(p, task, span, kv_head, group);
    } else {
      MergeSplits<D, kBatch>(p, task, span, kv_head, group);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
  }
}

// Q tile -> shared memory, converted to T; rows past the span are zero. A thread issues all
// its loads (up to 8 chunks at a time) before it converts and stores any, so the tile costs one
// global-memory latency rather than one per chunk. offset(row, chunk) is the element offset of
// a 16-byte chunk in the kernel's shared-memory layout.
template <typename T, int D, int kRows, int kThreads, typename Offset>
__device__ __forceinline__ void LoadQTile(const PagedAttentionParams& p,
                                          const AttentionWorkItem& item, const AttentionSpan& span,
                                          int kv_head, int group, int span_rows, T* smem_q,
                                          Offset offset) {
  constexpr int kChunks = D / 8;
  static_assert(kRows * kChunks % kThreads == 0, "Q chunks divide among threads");
  constexpr int kPerThread = kRows * kChunks / kThreads;
  constexpr int kBatch = kPerThread < 8 ? kPerThread : 8;
  static_assert(kPerThread % kBatch == 0, "whole batches");
#pragma unroll 1
  for (int b0 = 0; b0 < kPerThread; b0 += kBatch) {
    float4 lo[kBatch], hi[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = threadIdx.x + (b0 + i) * kThreads;
      const int r = c / kChunks, chunk = c % kChunks;
      const int span_row = item.row_start + r;
      lo[i] = hi[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (span_row < span_rows) {
        const int query = span_row / group, head = kv_head * group + span_row % group;
        const float4* src = reinterpret_cast<const float4*>(
            p.q + ((span.q_offset + query) * p.num_q_heads + head) * D + chunk * 8);
        lo[i] = src[0];
        hi[i] = src[1];
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = threadIdx.x + (b0 + i) * kThreads;
      const int r = c / kChunks, chunk = c % kChunks;
      *reinterpret_cast<uint4*>(smem_q + offset(r, chunk)) =
          make_uint4(PackPair<T>(lo[i].x, lo[i].y), PackPair<T>(lo[i].z, lo[i].w),
                     PackPair<T>(hi[i].x, hi[i].y), PackPair<T>(hi[i].z, hi[i].w));
    }
  }
}

// ---- Device body --------------------------------------------------------------------------

// The decode tile's lazy softmax base may trail the row's max by up to this much (log2 units):
// P <= 2^8 before normalization. Lazy at head_dim >= 128, where the skipped rescale of O is D/2
// multiplies a step; at 64 the vote costs more than it saves (docs/PERFORMANCE.md#tried).
inline constexpr float kRescaleSlack = 8.f;
constexpr bool LazyRescale(int head_dim) { return head_dim >= 128; }

template <typename T, int D, int MW, int KW>
__device__ __forceinline__ void AttentionTileBody(const PagedAttentionParams& p,
                                                  const AttentionWorkItem* items,
                                                  const ItemFirstPages* first_pages) {
  using Cfg = AttentionTileConfig<T, D, MW, KW>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem_kv = reinterpret_cast<T*>(smem_raw);
  T* smem_q = reinterpret_cast<T*>(smem_raw + (Cfg::kPipelineBytes > Cfg::kReduceBytes
                                                   ? Cfg::kPipelineBytes
                                                   : Cfg::kReduceBytes));

  // A separate merge launched after these tiles (LaunchKernelPairWithParams) may be scheduled
  // now: its blocks wait for this grid's end in griddepcontrol.wait.
  AllowDependentLaunch();
  // Blocks go item-major (TileGridBlocks): the kv heads of one work item are neighbours in
  // launch order, so the blocks that run at once read whole pages (a page holds every kv head's
  // rows, one after another) rather than one kv head's part of many pages.
  const ItemMajorBlock block = ItemMajor(p);
  const uint32_t item_index = block.item;
  const AttentionWorkItem item = items[item_index];
  const int kv_head = block.kv_head;
  const AttentionSpan span = item.span_info;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_rows = span.num_queries * group;
  const int first_q_pos = span.kv_len - span.num_queries;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int mw = warp % MW, kw = warp / MW;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  // Pipeline: each thread copies the same 16-byte chunk column of kRowsPerThread rows.
  // K and V are read once per launch (each (span, kv head) has one decode tile): their lines
  // leave L2 first, so the work items, page table and split partials stay there.
  const uint64_t read_once = EvictFirstPolicy();
  const int copy_chunk = tid % Cfg::kChunks, copy_row0 = tid / Cfg::kChunks;
  const int num_tiles = (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  const int32_t* pages = p.page_table + span.page_table_offset;
  // A chunk's byte offset in the pool is page id * page_bytes (one 32 x 32 -> 64-bit multiply)
  // plus its offset within the page: the kv head's rows, the position's row, the chunk.
  const char* k_bytes = static_cast<const char*>(p.k_cache);
  const char* v_bytes = static_cast<const char*>(p.v_cache);
  constexpr uint32_t kRowBytes = D * sizeof(T);
  static_assert(uint64_t{kMaxNumHeads} * kMaxPageSize * kRowBytes <= uint64_t{1} << 32,
                "a page of every kv head is addressed in 32 bits");
  const uint32_t page_bytes = static_cast<uint32_t>(p.num_kv_heads * p.page_size) * kRowBytes;
  const uint32_t head_chunk_bytes =
      static_cast<uint32_t>(kv_head * p.page_size) * kRowBytes + copy_chunk * 16;
  // The rows a thread copies of one tile: their page ids, loaded one tile ahead of the copies so
  // that their latency stays hidden, and (up to 8 rows a thread, head_dim <= 128, where the
  // registers allow) their byte offsets within the page, found with the ids; with more rows the
  // offsets are found again when the copies are issued. Rows past the range: page id 0 and
  // offset 0, so that every address stays in the pool.
  constexpr bool kKeepOffsets = Cfg::kRowsPerThread <= 8;
  struct TileRows {
    int id[Cfg::kRowsPerThread];
    uint32_t offset[kKeepOffsets ? Cfg::kRowsPerThread : 1];
  };
  auto in_page_offset = [&](int pos, uint32_t page) {  // page: pos / page_size
    return head_chunk_bytes + (pos - page * p.page_size) * kRowBytes;
  };
  // The item's first pages (AttachFirstPages), lane j holding page j: loaded beside the item, so
  // the first tiles' copies wait for no page-table load.
  const bool pages_attached = first_pages != nullptr;
  const int lane_first_page =
      pages_attached && lane < kItemPages ? first_pages[item_index].ids[lane] : 0;
  const uint32_t first_page = p.page_div.Div(item.kv_start);
  // from_item: the page ids from the item's first pages (the prologue, when they hold its tiles'
  // pages: carry_first below), otherwise from the page table.
  auto fetch_pages = [&](int tile, TileRows& rows, auto from_item) {
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
      const int pos = item.kv_start + tile * Cfg::kTileKv + copy_row0 + i * Cfg::kRowStep;
      const bool valid = tile < num_tiles && pos < item.kv_end;
      const uint32_t page = p.page_div.Div(pos);
      if constexpr (decltype(from_item)::value) {
        const int carried = __shfl_sync(0xffffffffu, lane_first_page, (page - first_page) & 31);
        rows.id[i] = valid ? carried : 0;
      } else {
        rows.id[i] = valid ? pages[page] : 0;
      }
      if constexpr (kKeepOffsets) {
        rows.offset[i] = valid ? in_page_offset(pos, page) : 0;
      }
    }
  };
  auto issue_tile = [&](int tile, const TileRows& rows) {
    T* sk = smem_kv + (tile % Cfg::kStages) * Cfg::kStageElems;
    T* sv = sk + Cfg::kTileKv * D;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
      const int row = copy_row0 + i * Cfg::kRowStep;
      const int pos = item.kv_start + tile * Cfg::kTileKv + row;
      const bool valid = pos < item.kv_end;
      uint32_t in_page;
      if constexpr (kKeepOffsets) {
        in_page = rows.offset[i];
      } else {
        in_page = valid ? in_page_offset(pos, p.page_div.Div(pos)) : 0;
      }
      const uint64_t offset =
          static_cast<uint64_t>(static_cast<uint32_t>(rows.id[i])) * page_bytes + in_page;
      const int smem_off = SwizzledOffset<D>(row, copy_chunk);
      CpAsync16Policy(SmemAddr(sk + smem_off), k_bytes + offset, valid, read_once);
      CpAsync16Policy(SmemAddr(sv + smem_off), v_bytes + offset, valid, read_once);
    }
  };

  // Prologue: the first kStages - 1 tiles' copies, then the next tile's page ids; Q is loaded
  // while those copies fly. When the item's first pages hold every page of the prologue's
  // kStages tiles (a block-uniform test), the ids come from them and each tile's copies go out as
  // soon as its ids are known (the prologue is bound by its instructions, not by loads);
  // otherwise all ids of the first tiles are loaded at once from the page table, then copied.
  const bool carry_first =
      pages_attached &&
      p.page_div.Div(min(item.kv_start + Cfg::kStages * Cfg::kTileKv, item.kv_end) - 1) -
              first_page <
          kItemPages;
  TileRows next_rows;
  if (carry_first) {
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      TileRows rows;
      fetch_pages(s, rows, std::true_type{});
      if (s < num_tiles) issue_tile(s, rows);
      CpAsyncCommit();
    }
    fetch_pages(Cfg::kStages - 1, next_rows, std::true_type{});
  } else {
    TileRows first_rows[Cfg::kStages - 1];
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) fetch_pages(s, first_rows[s], std::false_type{});
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      if (s < num_tiles) issue_tile(s, first_rows[s]);
      CpAsyncCommit();
    }
    fetch_pages(Cfg::kStages - 1, next_rows, std::false_type{});
  }

  // Q tile -> shared memory, converted to T, while those copies fly.
  LoadQTile<T, D, Cfg::kRows, Cfg::kThreads>(
      p, item, span, kv_head, group, span_rows, smem_q,
      [](int r, int chunk) { return SwizzledOffset<D>(r, chunk); });

  // Per-thread state: rows quad_row and quad_row + 8 of this warp's 16, columns 2*quad_col..+1
  // of each 8-wide n tile.
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  int q_pos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int span_row = item.row_start + mw * 16 + quad_row + 8 * i;
    q_pos[i] = span_row >= span_rows ? -1 : (p.causal ? first_q_pos + span_row / group : INT32_MAX);
  }
  // Last position any row of this warp may see: sub-tiles past it are skipped.
  const int warp_last_row = min(item.row_start + mw * 16 + 15, span_rows - 1);
  const int warp_max_pos = warp_last_row < item.row_start + mw * 16
                               ? -1
                               : (p.causal ? first_q_pos + warp_last_row / group : INT32_MAX);
  const float scale_log2 = p.sm_scale * 1.4426950408889634f;

  const T* warp_q = smem_q + mw * 16 * D;
  uint32_t q_frag[Cfg::kQInRegisters ? D / 16 : 1][4];
  auto load_q_frag = [&](int kc, uint32_t(&a)[4]) {
    const int r = (lane & 7) + 8 * ((lane >> 3) & 1);
    LdMatrixX4(a, SmemAddr(warp_q + SwizzledOffset<D>(r, 2 * kc + (lane >> 4))));
  };

  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + Cfg::kStages - 1 < num_tiles) issue_tile(tile + Cfg::kStages - 1, next_rows);
    CpAsyncCommit();
    fetch_pages(tile + Cfg::kStages, next_rows, std::false_type{});
    CpAsyncWait<Cfg::kStages - 1>();
    __syncthreads();
    if constexpr (Cfg::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) load_q_frag(kc, q_frag[kc]);
      }
    }
    const T* sk = smem_kv + (tile % Cfg::kStages) * Cfg::kStageElems;
    const T* sv = sk + Cfg::kTileKv * D;

#pragma unroll
    for (int step = 0; step < Cfg::kWarpKv / 16; ++step) {
      const int row0 = kw * Cfg::kWarpKv + step * 16;  // first position row in the tile
      const int pos0 = item.kv_start + tile * Cfg::kTileKv + row0;
      if (pos0 >= item.kv_end || pos0 > warp_max_pos) continue;  // warp-uniform

      // S = Q K^T over 16 positions: two n8 tiles, each summed over head_dim in two
      // accumulators (even and odd k chunks) up to head_dim 128, so that the dependent mma chain
      // before the softmax is D/32 deep rather than D/16 (at 256 the registers are spent).
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[4];
        if constexpr (Cfg::kQInRegisters) {
#pragma unroll
          for (int j = 0; j < 4; ++j) a[j] = q_frag[kc][j];
        } else {
          load_q_frag(kc, a);
        }
        uint32_t b[4];
        const int r = row0 + (lane & 7) + 8 * (lane >> 4);
        LdMatrixX4(b, SmemAddr(sk + SwizzledOffset<D>(r, 2 * kc + ((lane >> 3) & 1))));
        float(&acc)[2][4] = (D <= 128 && (kc & 1)) ? s_odd : s;
        Mma16816<T>(acc[0], a, b[0], b[1]);
        Mma16816<T>(acc[1], a, b[2], b[3]);
      }
      if constexpr (D <= 128) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
        }
      }

      // Mask (split end, causal) and scale to log2 units.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = pos0 + nt * 8 + 2 * quad_col + (e & 1);
          const bool visible = pos < item.kv_end && pos <= q_pos[e >> 1];
          s[nt][e] = visible ? s[nt][e] * scale_log2 : -INFINITY;
        }
      }

      // Online softmax, P = 2^(s - base). With LazyRescale(D) the base (row_max) is raised to
      // the row's max only when some row of the warp has a score more than kRescaleSlack above
      // its base, and O and the running sum are rescaled then only. Otherwise P stays below
      // 2^kRescaleSlack, well within f32 and the P operand's exponent range, and the common
      // step (the max settles after the first tiles) skips the rescale of O. Without it, every
      // step raises the base to the max and rescales. Each thread tests its own scores (some
      // score of a row is over the bar exactly when the row's max is), so the row's max across
      // its quad of threads is found only when the base is raised.
      float mx[2];
      bool raise = false;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(fmaxf(s[0][2 * i], s[0][2 * i + 1]), fmaxf(s[1][2 * i], s[1][2 * i + 1]));
        raise = raise || mx[i] > row_max[i] + kRescaleSlack;
      }
      if (!LazyRescale(D) || __any_sync(0xffffffffu, raise)) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
          mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
          const float new_max = fmaxf(row_max[i], mx[i]);
          const float alpha = FastExp2(row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
          row_max[i] = new_max;
          row_sum[i] *= alpha;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            o[dt][2 * i] *= alpha;
            o[dt][2 * i + 1] *= alpha;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float base = row_max[i] == -INFINITY ? 0.f : row_max[i];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s[nt][2 * i] = FastExp2(s[nt][2 * i] - base);
          s[nt][2 * i + 1] = FastExp2(s[nt][2 * i + 1] - base);
        }
        row_sum[i] += s[0][2 * i] + s[0][2 * i + 1] + s[1][2 * i] + s[1][2 * i + 1];
      }

      // O += P V: P's accumulator layout is the A operand layout of the next mma.
      const uint32_t pa[4] = {PackPair<T>(s[0][0], s[0][1]), PackPair<T>(s[0][2], s[0][3]),
                              PackPair<T>(s[1][0], s[1][1]), PackPair<T>(s[1][2], s[1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t b[4];
        const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
        LdMatrixX4Trans(b, SmemAddr(sv + SwizzledOffset<D>(r, dt + (lane >> 4))));
        Mma16816<T>(o[dt], pa, b[0], b[1]);
        Mma16816<T>(o[dt + 1], pa, b[2], b[3]);
      }
    }
    __syncthreads();  // the stage is overwritten by the next iteration's copies
  }
  CpAsyncWait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }

  // The KW warps that split each KV tile combine their (max, sum, O) through shared memory:
  // each stores its state for the tile's live rows (rows past the span are skipped), then all
  // threads combine 4-dim slices of those rows and write them, normalized, as float4 stores: to
  // out/lse for an unsplit tile, to the partial buffers of its split otherwise.
  static_assert(KW > 1, "the decode tiles split each KV tile among warps");
  __syncthreads();  // every warp is done with the pipeline's shared memory
  float* red_o = reinterpret_cast<float*>(smem_raw);           // [KW][kRows][kRedStride]
  float* red_max = red_o + KW * Cfg::kRows * Cfg::kRedStride;  // [KW][kRows]
  float* red_sum = red_max + KW * Cfg::kRows;                  // [KW][kRows]
  const int live_rows = min(Cfg::kRows, span_rows - item.row_start);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = mw * 16 + quad_row + 8 * i;
    if (r >= live_rows) continue;
    if (quad_col == 0) {
      red_max[kw * Cfg::kRows + r] = row_max[i];
      red_sum[kw * Cfg::kRows + r] = row_sum[i];
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<float2*>(red_o + (kw * Cfg::kRows + r) * Cfg::kRedStride + dt * 8 +
                                 2 * quad_col) = make_float2(o[dt][2 * i], o[dt][2 * i + 1]);
    }
  }
  __syncthreads();
  constexpr int kQuads = D / 4;
  for (int e = tid; e < live_rows * kQuads; e += Cfg::kThreads) {
    const int r = e / kQuads, c = (e % kQuads) * 4;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < KW; ++w) m = fmaxf(m, red_max[w * Cfg::kRows + r]);
    const float base = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < KW; ++w) {
      const float f = exp2f(red_max[w * Cfg::kRows + r] - base);
      sum += red_sum[w * Cfg::kRows + r] * f;
      const float4 v =
          *reinterpret_cast<const float4*>(red_o + (w * Cfg::kRows + r) * Cfg::kRedStride + c);
      acc.x += v.x * f;
      acc.y += v.y * f;
      acc.z += v.z * f;
      acc.w += v.w * f;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float lse = sum > 0.f ? (m + __log2f(sum)) * 0.6931471805599453f : -INFINITY;
    float* dst;
    float* lse_dst;
    TileRowDestination<D>(p, item, span, kv_head, group, r, item.row_start + r, dst, lse_dst);
    *reinterpret_cast<float4*>(dst + c) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (lse_dst && c == 0) *lse_dst = lse;
  }

  MergeIfLastSplit<D, DecodeMergeBatch(D)>(p, item, span, kv_head, group);
}

// ---- Kernel and launcher ------------------------------------------------------------------

// The work list of each tile shape, told apart by its number of 16-row warps.
template <int MW>
__host__ __device__ inline const AttentionWorkItem* TileItems(const PagedAttentionParams& p) {
  static_assert(MW == 1 || MW == 2 || MW == 4, "tile shapes: 16, 32 or 64 rows");
  return MW == 1 ? p.decode_items : (MW == 2 ? p.decode_wide_items : p.prefill_items);
}
template <int MW>
__host__ __device__ inline const ItemFirstPages* TileFirstPages(const PagedAttentionParams& p) {
  static_assert(MW == 1 || MW == 2, "decode tile shapes: 16 or 32 rows");
  return MW == 1 ? p.decode_first_pages : p.decode_wide_first_pages;
}
template <int MW>
inline int NumTileItems(const PagedAttentionParams& p) {
  return MW == 1 ? p.num_decode_items : (MW == 2 ? p.num_decode_wide_items : p.num_prefill_items);
}

template <typename T, int D, int MW, int KW>
__global__ void __launch_bounds__(128)
    PagedAttentionTileKernel(const __grid_constant__ PagedAttentionParams params) {
  AttentionTileBody<T, D, MW, KW>(params, TileItems<MW>(params), TileFirstPages<MW>(params));
}
// The same kernel held to at most 192 registers a thread, for the 16-row decode tile at head_dim
// 128 (two blocks an SM), so that a separate merge block (64 x 256) is resident beside two tile
// blocks and waits there (LaunchKernelPairWithParams). TileKernel picks the one a shape uses.
template <typename T, int D, int MW, int KW>
__global__ void __maxnreg__(192)
    PagedAttentionTileKernel192(const __grid_constant__ PagedAttentionParams params) {
  AttentionTileBody<T, D, MW, KW>(params, TileItems<MW>(params), TileFirstPages<MW>(params));
}
template <typename T, int D, int MW, int KW>
constexpr auto TileKernel() {
  if constexpr (D == 128 && MW == 1) {
    return PagedAttentionTileKernel192<T, D, MW, KW>;
  } else {
    return PagedAttentionTileKernel<T, D, MW, KW>;
  }
}

// One kernel's record of the devices whose shared-memory limit it has raised. Once every
// device has it, a launch asks nothing of the runtime (cudaGetDevice is host time before the
// launch, and the launch's host time is the GPU's when it is idle).
struct SmemLimitFlags {
  std::atomic<bool> device[kMaxDevices] = {};
  std::atomic<int> raised_devices{0};
};

// Raises a kernel's dynamic shared-memory limit to smem, once per device (the limit is a
// per-device attribute; `raised` is the kernel's own flags). `what` names it in errors.
template <typename Kernel>
LaunchStatus RaiseSmemLimitOnce(Kernel kernel, size_t smem, SmemLimitFlags& raised,
                                const char* what) {
  if (raised.raised_devices.load() == CudaDeviceCountOnce()) return LaunchStatus::Ok();
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess && (device >= kMaxDevices || !raised.device[device].load())) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err == cudaSuccess && device < kMaxDevices && !raised.device[device].exchange(true)) {
      raised.raised_devices.fetch_add(1);
    }
  }
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("cudaFuncSetAttribute(") + what +
                                   "): " + cudaGetErrorString(err));
  }
  return LaunchStatus::Ok();
}

// then: a kernel to launch right after the tiles, programmatically dependent on them (the
// separate merge); null for none.
template <typename T, int D, int MW, int KW>
LaunchStatus LaunchAttentionTiles(const PagedAttentionParams& params, cudaStream_t stream,
                                  const KernelLaunch* then) {
  using Cfg = AttentionTileConfig<T, D, MW, KW>;
  const int num_items = NumTileItems<MW>(params);
  if (num_items == 0) return LaunchStatus::Ok();
  auto kernel = TileKernel<T, D, MW, KW>();
  constexpr size_t smem = Cfg::SmemBytes();
  static SmemLimitFlags smem_raised;
  if (LaunchStatus st = RaiseSmemLimitOnce(kernel, smem, smem_raised, "paged attention");
      !st.ok()) {
    return st;
  }
  unsigned blocks = 0;
  if (LaunchStatus st = TileGridBlocks(num_items, params.num_kv_heads, &blocks); !st.ok()) {
    return st;
  }
  const dim3 grid(blocks);
  if (then != nullptr) {
    const KernelLaunch tiles = {reinterpret_cast<const void*>(kernel), grid, dim3(Cfg::kThreads),
                                smem};
    return LaunchKernelPairWithParams(tiles, *then, stream, &params, sizeof(params),
                                      "paged attention and split-KV merge");
  }
  return LaunchKernelWithParams(kernel, grid, dim3(Cfg::kThreads), smem, stream, params,
                                "paged attention");
}

// ---- The separate merge (PagedAttentionParams::separate_merge) ------------------------------

// One block per (merge task, row, kv head): warp w merges splits w, w + 8, ... of the row online,
// each split's LSE and O slice loaded together (the loop is unrolled by four, so four splits'
// loads can be in flight), so the partial rows of all splits are read with 8 warps' loads in
// flight rather than one warp's; the warps' (max, sum, O) are combined in shared memory.
// At most 64 registers, so that a block fits beside two decode tile blocks on an SM and is
// resident, waiting, before they end (LaunchKernelPairWithParams).
inline constexpr int kMergeThreads = 256;

template <int D>
__global__ void __launch_bounds__(kMergeThreads, 4)
    MergeSplitsKernel(const __grid_constant__ PagedAttentionParams p) {
  constexpr int kWarps = kMergeThreads / 32, kDims = D / 32;
  // Launched right after the tiles (LaunchKernelPairWithParams), it may start before they end:
  // its task (written before the launch, by the host) is read while they run, so that only the
  // partials' loads follow the wait for their grid's end.
  const AttentionMergeTask task = p.merge_tasks[blockIdx.x];
  const int r = blockIdx.y, kv_head = blockIdx.z;
  if (r >= task.num_rows) return;
  WaitForPrerequisiteGrids();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* lse = p.partial_lse + int64_t{kv_head} * p.partial_rows + task.partial_row + r;
  const float* part =
      p.partial_out + (int64_t{kv_head} * p.partial_rows + task.partial_row + r) * D;
  __shared__ float red[kWarps][D];
  __shared__ float red_max[kWarps], red_sum[kWarps];

  SplitMergeState<kDims> m;
#pragma unroll 4
  for (int s = warp; s < task.num_splits; s += kWarps) {
    const int64_t row = int64_t{s} * task.row_stride;
    const float split_lse = __ldcg(lse + row);
    SplitRowSlice<kDims> x;
    x.Load(part + row * D + lane * kDims);
    const float w = __expf(split_lse - m.Rebase(split_lse));
    m.weight_sum += w;
    x.AddTo(m.acc, w);
  }
#pragma unroll
  for (int j = 0; j < kDims; ++j) red[warp][lane * kDims + j] = m.acc[j];
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
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_row = task.row_start + r;
  const int64_t out_row = OutputRow(p, task.q_offset, span_row, kv_head, group);
  for (int d = threadIdx.x; d < D; d += kMergeThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][d] * scale[w];
    p.out[out_row * D + d] = sum * inv;
  }
  if (p.lse && threadIdx.x == 0) p.lse[out_row] = total > 0.f ? base + __logf(total) : -INFINITY;
}

template <int D>
KernelLaunch MergeSplitsLaunch(const PagedAttentionParams& params) {
  return {reinterpret_cast<const void*>(MergeSplitsKernel<D>),
          dim3(params.num_merge_tasks, params.merge_rows, params.num_kv_heads), dim3(kMergeThreads),
          0};
}

// Tile blocks an SM holds at once (resident), and how many of them leave room for one
// separate-merge block (beside_merge), whose blocks must be resident, waiting, before the tiles
// end (LaunchKernelPairWithParams): the planner counts the waves of a split plan in the second,
// of a plan without splits (no merge) in the first. Head_dim 128 holds two beside a merge block
// (<= 192 registers); head_dim 64's four fill the register file, so split plans count three
// (docs/PERFORMANCE.md#occupancy).
template <typename T, int D, int MW, int KW>
LaunchStatus AttentionTileOccupancy(int* resident, int* beside_merge) {
  using Cfg = AttentionTileConfig<T, D, MW, KW>;
  auto kernel = TileKernel<T, D, MW, KW>();
  constexpr size_t smem = Cfg::SmemBytes();
  cudaFuncAttributes tile = {}, merge = {};
  int device = 0, regs_per_sm = 0;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, Cfg::kThreads, smem);
  }
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&tile, kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&merge, MergeSplitsKernel<D>);
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&regs_per_sm, cudaDevAttrMaxRegistersPerMultiprocessor, device);
  }
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("occupancy(paged attention): ") +
                                   cudaGetErrorString(err));
  }
  // Registers are allocated per warp in units of 256, so per thread in multiples of 8.
  auto block_regs = [](int regs, int threads) { return (regs + 7) / 8 * 8 * threads; };
  const int tile_regs = block_regs(tile.numRegs, Cfg::kThreads);
  const int merge_regs = block_regs(merge.numRegs, kMergeThreads);
  *beside_merge = *resident;
  while (*beside_merge > 1 && *beside_merge * tile_regs + merge_regs > regs_per_sm) {
    --*beside_merge;
  }
  return LaunchStatus::Ok();
}

#define PAGEDATTN_INSTANTIATE_MERGE(D) \
  template KernelLaunch MergeSplitsLaunch<D>(const PagedAttentionParams&);

// Explicit instantiation of both decode tile shapes for one (dtype, head_dim).
#define PAGEDATTN_INSTANTIATE_ATTENTION(T, D)                                                \
  template LaunchStatus LaunchAttentionTiles<T, D, 1, 4>(const PagedAttentionParams&,        \
                                                         cudaStream_t, const KernelLaunch*); \
  template LaunchStatus LaunchAttentionTiles<T, D, 2, 2>(const PagedAttentionParams&,        \
                                                         cudaStream_t, const KernelLaunch*); \
  template LaunchStatus AttentionTileOccupancy<T, D, 1, 4>(int*, int*);

}  // namespace pagedattn::kernels
