// Where a tile's data lives: K/V chunk offsets in the paged pool, the swizzled shared-memory
// layout, a block's work item, and the Q-tile load and output-row writes of every tile kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/device/dtype.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

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

// Row of out / lse for row span_row (= query * group + head in group) of the span whose first
// query is at q_offset.
__device__ __forceinline__ int64_t OutputRow(const PagedAttentionParams& p, int64_t q_offset,
                                             int span_row, int kv_head, int group) {
  return (q_offset + span_row / group) * p.num_q_heads + kv_head * group + span_row % group;
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

// Launches a tile kernel on the item-major grid of num_items work items x the kv heads (one block
// each, ItemMajor), its shared-memory limit raised first. Shared by both prefill kernels.
template <typename Kernel>
LaunchStatus LaunchItemMajorGrid(Kernel kernel, int threads, size_t smem,
                                 SmemLimitFlags& smem_raised, const char* what, int64_t num_items,
                                 const PagedAttentionParams& params, cudaStream_t stream,
                                 Launcher& launcher) {
  if (num_items == 0) return LaunchStatus::Ok();
  if (LaunchStatus st = RaiseSmemLimitOnce(kernel, smem, smem_raised, what); !st.ok()) return st;
  unsigned blocks = 0;
  if (LaunchStatus st = TileGridBlocks(num_items, params.num_kv_heads, &blocks); !st.ok()) {
    return st;
  }
  return launcher.Launch(kernel, dim3(blocks), dim3(threads), smem, stream, params, what);
}

}  // namespace pagedattn::kernels
