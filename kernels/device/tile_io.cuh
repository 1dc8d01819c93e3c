// Where a tile's data lives: K/V chunk offsets in the paged pool, the swizzled shared-memory
// layout, a block's work item, and the Q-tile load and output-row writes of every tile kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// Shared-memory layout of a [rows][D] K, V or Q tile. Head dims that are whole 64-element
// blocks (64, 128, 192, 256, 512) are swizzled: the chunk index is XORed with row % 8, so that the
// eight rows an ldmatrix reads hit eight different bank groups. The others (80, 96) pad each
// row by one chunk instead (176 or 208 bytes: eight consecutive rows again start in eight
// different 16-byte bank groups). The decode tile lays out its own rows (DecodeOffset).
template <int D>
inline constexpr bool kSwizzledRows = D % 64 == 0;
template <int D>
inline constexpr int kSmemRowElems = kSwizzledRows<D> ? D : D + 8;

// Element offset of (row, 16-byte chunk) in such a tile.
template <int D>
__device__ __forceinline__ int SwizzledOffset(int row, int chunk) {
  if constexpr (kSwizzledRows<D>) {
    return row * D + ((chunk ^ (row & 7)) << 3);
  } else {
    return row * kSmemRowElems<D> + (chunk << 3);
  }
}

// FP8 tiles read straight into mma fragments (kFp8Fragments: every head dim of the decode
// tiles), rows of D bytes: the byte offset of (row, 16-byte chunk). The chunk index is XORed so
// that the eight rows an ldmatrix reads (aligned to 8) hit eight bank groups: rows of 8 chunks
// or more by row % 8; 64-byte rows (two to a 128-byte line) by (row / 2) % 4; rows of 6 chunks
// (96 bytes: row 4 starts in row 0's group) by (row / 4) % 2, rows of 12 (192 bytes: row 2 starts
// in row 0's) by (row / 2) % 4. Rows of 5 chunks (80 bytes) start in eight groups as they are.
template <int D>
inline constexpr bool kFp8Fragments =
    D == 64 || D == 80 || D == 96 || D == 128 || D == 192 || D == 256;
template <int D>
__device__ __forceinline__ int Fp8TileOffset(int row, int chunk) {
  static_assert(kFp8Fragments<D>, "a decode tile's head dim");
  constexpr int kChunks = D / 16;
  const int swizzle = kChunks == 5    ? 0
                      : kChunks == 6  ? (row >> 2) & 1
                      : kChunks == 4  ? (row >> 1) & 3
                      : kChunks == 12 ? (row >> 1) & 3
                                      : row & 7;
  return row * D + ((chunk ^ swizzle) << 4);
}

// How a block's threads copy a K/V tile of kTileKv rows: in kSlots columns of 16-byte chunks
// (kElemsPerChunk elements: 8 of a 16-bit cache, 16 of an FP8 one), each thread taking chunk
// tid % kSlots of rows tid / kSlots + i * kRowStep. kSlots is the row's chunks rounded up to a
// power of two, so that it divides the block; a thread whose column is past the row (head dims
// 80, 96, 192) copies nothing.
constexpr int PowerOfTwoAtLeast(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}
template <int D, int kThreads, int kTileKv, int kElemsPerChunk = 8>
struct KvCopyLayout {
  static constexpr int kChunks = D / kElemsPerChunk;  // 16-byte chunks per row
  static constexpr int kSlots = PowerOfTwoAtLeast(kChunks);
  static constexpr int kRowStep = kThreads / kSlots;         // rows one copy pass covers
  static constexpr int kRowsPerThread = kTileKv / kRowStep;  // rows each thread copies
  static_assert(D % 16 == 0, "whole k16 steps");
  static_assert(kThreads % kSlots == 0 && kTileKv % kRowStep == 0, "copies divide evenly");
};

// This block's work item and kv head in an item-major grid (TileGridBlocks: the kv heads of one
// work item are neighbours in launch order), by a multiply-shift (kv_heads_div) rather than an
// integer division, so that nothing slow stands before the item's load.
struct ItemMajorBlock {
  uint32_t item;
  int kv_head;
};
// unit: the block's (item, kv head) in that order (blockIdx.x, or its quotient where a tile
// takes several neighbouring blocks).
__device__ __forceinline__ ItemMajorBlock ItemMajorAt(const PagedAttentionParams& p,
                                                     uint32_t unit) {
  const uint32_t item = p.kv_heads_div.Div(unit);
  return {item, static_cast<int>(unit - item * p.num_kv_heads)};
}
__device__ __forceinline__ ItemMajorBlock ItemMajor(const PagedAttentionParams& p) {
  return ItemMajorAt(p, blockIdx.x);
}
// A pair-merge grid's (AttentionWork::pair_merge): units 2u and 2u + 1 take items 2i and 2i + 1
// (a tile's two splits) of one kv head, the pairs item-major.
__device__ __forceinline__ ItemMajorBlock PairMajorAt(const PagedAttentionParams& p,
                                                      uint32_t unit) {
  const ItemMajorBlock pair = ItemMajorAt(p, unit >> 1);
  return {2 * pair.item + (unit & 1), pair.kv_head};
}

// The (prefill item, kv head) of a one-block-a-job prefill kernel's unit (blockIdx.x, or its
// quotient where a tile takes several neighbouring blocks): PrefillJobOf's order, the planner's
// head groups (item-major where every kv head is one group).
__device__ __forceinline__ ItemMajorBlock PrefillJobAt(const PagedAttentionParams& p,
                                                      uint32_t unit) {
  if (p.prefill_head_group <= 0 || p.prefill_head_group >= p.num_kv_heads) {
    return ItemMajorAt(p, unit);
  }
  const PrefillJobIndex at =
      PrefillJobOf(unit, static_cast<uint32_t>(p.num_prefill_items), p.prefill_head_group);
  return {at.item, at.kv_head};
}

// Row of out / lse for row span_row (= query * group + head in group) of the span whose first
// query is at q_offset.
__device__ __forceinline__ int64_t OutputRow(const PagedAttentionParams& p, int64_t q_offset,
                                             int span_row, int kv_head, int group) {
  return (q_offset + span_row / group) * p.num_q_heads + kv_head * group + span_row % group;
}

// Where row tile_row (span row span_row) of a work item's tile goes: out / lse (lse null when
// not asked for) for a finished row (an unsplit tile's, or a pair's: DecodeTileKernelNarrowPair),
// the partial buffers of its split otherwise.
template <int D>
__device__ __forceinline__ void TileRowDestination(const PagedAttentionParams& p,
                                                   const AttentionWorkItem& item,
                                                   const AttentionSpan& span, int kv_head,
                                                   int group, int tile_row, int span_row,
                                                   float*& dst, float*& lse_dst, bool finished) {
  if (finished) {
    const int64_t out_row = OutputRow(p, span.q_offset, span_row, kv_head, group);
    dst = static_cast<float*>(p.out) + out_row * D;
    lse_dst = p.lse ? p.lse + out_row : nullptr;
  } else {
    const int64_t part_row = int64_t{kv_head} * p.partial_rows + item.partial_row + tile_row;
    dst = p.partial_out + part_row * D;
    lse_dst = p.partial_lse + part_row;
  }
}

// out's element type TIO (q's: float, or the cache's 16-bit type): two adjacent values from float.
template <typename TIO>
__device__ __forceinline__ void StorePair(TIO* dst, float lo, float hi) {
  if constexpr (std::is_same_v<TIO, float>) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = PackOutputPair<TIO>(lo, hi);
  }
}

// Writes one normalized row of a tile's output (o * inv, this thread's two columns of every
// 8-wide n tile, o_half selecting the row's pair): to out (in TIO) / lse for an unsplit tile, to
// the partial buffers (float) of its split otherwise. Shared by the prefill tile kernels. A block
// that holds kCols of the row's D columns (SplitsColumns) writes them from col0 on, and
// the row's LSE only from the block at column 0.
template <typename TIO, int D, int kCols = D>
__device__ __forceinline__ void WriteTileRow(const PagedAttentionParams& p,
                                             const AttentionWorkItem& item,
                                             const AttentionSpan& span, int kv_head, int group,
                                             int tile_row, int span_row, int quad_col,
                                             const float (&o)[kCols / 8][4], int o_half, float inv,
                                             float lse, int col0 = 0) {
  const bool writes_lse = quad_col == 0 && col0 == 0;
  if constexpr (std::is_same_v<TIO, float>) {  // out and the partials alike: one store loop
    float* dst;
    float* lse_dst;
    TileRowDestination<D>(p, item, span, kv_head, group, tile_row, span_row, dst, lse_dst,
                          item.partial_row < 0);
    dst += col0;
#pragma unroll
    for (int dt = 0; dt < kCols / 8; ++dt) {
      *reinterpret_cast<float2*>(dst + dt * 8 + 2 * quad_col) =
          make_float2(o[dt][2 * o_half] * inv, o[dt][2 * o_half + 1] * inv);
    }
    if (lse_dst && writes_lse) *lse_dst = lse;
  } else if (item.partial_row < 0) {
    const int64_t out_row = OutputRow(p, span.q_offset, span_row, kv_head, group);
    TIO* dst = static_cast<TIO*>(p.out) + out_row * D + col0;
#pragma unroll
    for (int dt = 0; dt < kCols / 8; ++dt) {
      StorePair(dst + dt * 8 + 2 * quad_col, o[dt][2 * o_half] * inv, o[dt][2 * o_half + 1] * inv);
    }
    if (p.lse && writes_lse) p.lse[out_row] = lse;
  } else {
    WriteTileRow<float, D, kCols>(p, item, span, kv_head, group, tile_row, span_row, quad_col, o,
                                  o_half, inv, lse, col0);
  }
}

// The address of 16-byte chunk `chunk` of q's row for span row span_row, in q's element type TIO.
template <typename TIO, int D>
__device__ __forceinline__ const TIO* QChunk(const PagedAttentionParams& p,
                                             const AttentionSpan& span, int kv_head, int group,
                                             int span_row, int chunk) {
  const int query = span_row / group, head = kv_head * group + span_row % group;
  return static_cast<const TIO*>(p.q) + ((span.q_offset + query) * p.num_q_heads + head) * D +
         chunk * 8;
}

constexpr int LargestDivisorAtMost(int n, int most) {
  int d = most < n ? most : n;
  while (n % d != 0) --d;
  return d;
}

// Q tile -> shared memory as T, from q in TIO (float, converted; or T itself), each value as
// AttentionValue gives it (NaN as 0, past 2^48 saturated); rows past the span are zero. A
// thread issues all its loads (up to 8 chunks at a time) before it stores any, so the tile costs
// one global-memory latency rather than one per chunk. offset(row, chunk) is the element offset
// of a 16-byte chunk in the kernel's shared-memory layout; tid the thread's index among the
// kThreads that load it. scale: a factor every value takes before it is rounded to T (q in T:
// after one more rounding), the Hopper prefill's soft-cap (Softcap::q_scaled).
template <typename T, typename TIO, int D, int kRows, int kThreads, typename Offset>
__device__ __forceinline__ void LoadQTile(const PagedAttentionParams& p,
                                          const AttentionWorkItem& item, const AttentionSpan& span,
                                          int kv_head, int group, int span_rows, T* smem_q,
                                          Offset offset, int tid, float scale = 1.f) {
  static_assert(std::is_same_v<TIO, float> || std::is_same_v<TIO, T>, "q in float or in T");
  constexpr int kChunks = D / 8;
  constexpr int kTotal = kRows * kChunks;
  constexpr int kPerThread = (kTotal + kThreads - 1) / kThreads;  // the last pass may be partial
  constexpr int kBatch = LargestDivisorAtMost(kPerThread, 8);
#pragma unroll 1
  for (int b0 = 0; b0 < kPerThread; b0 += kBatch) {
    if constexpr (std::is_same_v<TIO, float>) {
      float4 lo[kBatch], hi[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = tid + (b0 + i) * kThreads;
        const int r = c / kChunks, chunk = c % kChunks;
        const int span_row = item.row_start + r;
        lo[i] = hi[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if ((kTotal % kThreads == 0 || c < kTotal) && span_row < span_rows) {
          const float4* src = reinterpret_cast<const float4*>(
              QChunk<float, D>(p, span, kv_head, group, span_row, chunk));
          lo[i] = src[0];
          hi[i] = src[1];
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = tid + (b0 + i) * kThreads;
        const int r = c / kChunks, chunk = c % kChunks;
        if (kTotal % kThreads != 0 && c >= kTotal) continue;
        const float4 a = make_float4(lo[i].x * scale, lo[i].y * scale, lo[i].z * scale,
                                     lo[i].w * scale);
        const float4 b = make_float4(hi[i].x * scale, hi[i].y * scale, hi[i].z * scale,
                                     hi[i].w * scale);
        *reinterpret_cast<uint4*>(smem_q + offset(r, chunk)) = AttentionChunk<T>(
            make_uint4(PackPair<T>(a.x, a.y), PackPair<T>(a.z, a.w), PackPair<T>(b.x, b.y),
                       PackPair<T>(b.z, b.w)));
      }
    } else {
      uint4 x[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = tid + (b0 + i) * kThreads;
        const int r = c / kChunks, chunk = c % kChunks;
        const int span_row = item.row_start + r;
        x[i] = make_uint4(0, 0, 0, 0);
        if ((kTotal % kThreads == 0 || c < kTotal) && span_row < span_rows) {
          x[i] = *reinterpret_cast<const uint4*>(
              QChunk<T, D>(p, span, kv_head, group, span_row, chunk));
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = tid + (b0 + i) * kThreads;
        const int r = c / kChunks, chunk = c % kChunks;
        if (kTotal % kThreads != 0 && c >= kTotal) continue;
        uint4 v = AttentionChunk<T>(x[i]);
        if (scale != 1.f) {
          uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const T* pair = reinterpret_cast<const T*>(&w[j]);
            w[j] = PackPair<T>(ToFloat(pair[0]) * scale, ToFloat(pair[1]) * scale);
          }
        }
        *reinterpret_cast<uint4*>(smem_q + offset(r, chunk)) = v;
      }
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
