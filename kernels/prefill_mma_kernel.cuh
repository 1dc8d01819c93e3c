// The portable prefill tile kernel (FlashAttention-2 family, mma.sync, sm_80 and later): device
// body, thin __global__ and host launcher, templated on (cache dtype, head_dim).
//
// Included only by the per-head-dim instantiation files. A block takes one prefill work item:
// kPrefillTileRows (128) query rows (row = query * group + head in group, all of one kv head)
// against a KV range, streamed through a cp.async pipeline of K/V tiles (kTileKv: 64 positions,
// 32 at head_dim 512) gathered through the page table into swizzled shared memory. Each warp owns
// kMTiles 16-row slices, so every K/V fragment read with ldmatrix feeds kMTiles mma's.
// Per softmax step (kSubKv: 64 positions up to head_dim 96, 32 above): S = Q.K^T, one
// online-softmax update (exp2, scale folded into an FMA), O += P.V with P kept in registers as
// the A operand.
// Masks are applied only on the tiles that need them (the causal diagonal, a sliding window's
// start, the end of the range); tiles a warp cannot see are skipped.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>

#include "kernels/device/ptx.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

template <typename T, int D>
struct PrefillTileConfig {
  // head_dim 512 (SplitsColumns): the planner's tile of kPrefillTileRows rows runs as four
  // neighbouring blocks, kRowSplit halves of its rows by kColSplit halves of O's and V's columns
  // (kDv each), each block computing the scores over all of D; at 128 rows by 512 columns O alone
  // would be 256 accumulators a thread. Its K/V tile is 32 positions, so that two stages fit
  // beside Q: 64 KB of Q + 2 x (32 KB of K + 16 KB of V) = 160 KB, within an A100's 163 KB.
  static constexpr int kRowSplit = SplitsColumns(D) ? 2 : 1;
  static constexpr int kColSplit = SplitsColumns(D) ? 2 : 1;
  static constexpr int kBlocksPerTile = kRowSplit * kColSplit;
  static_assert(kBlocksPerTile == PrefillTileBlocks(D), "the planner counts these blocks");
  static constexpr int kDv = D / kColSplit;                  // O's and V's columns per block
  static constexpr int kRows = kPrefillTileRows / kRowSplit;  // query rows per block
  static constexpr int kMTiles = D > 128 ? 1 : 2;             // 16-row slices per warp
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kWarps = kRows / kWarpRows;  // 4 (d64..d128, d512) or 8 (d192, d256)
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileKv = SplitsColumns(D) ? 32 : kKvTileRows;  // per stage
  // Positions per softmax step: d128 and up hold 96-128 O accumulators per thread, so their S
  // tile is 32 positions wide to fit in 255 registers (no spills in the loop); up to d96 it is
  // 64 wide, 10-11% faster at 80 and 96 (docs/PERFORMANCE.md#head-dims).
  static constexpr int kSubKv = D <= 96 ? 64 : 32;
  static constexpr int kStages = D <= 96 ? 3 : 2;
  static constexpr bool kQInRegisters = D == 64;             // else reloaded per tile (ldmatrix)
  using Copy = KvCopyLayout<D, kThreads, kTileKv>;           // K's (and V's where kDv == D)
  using VCopy = KvCopyLayout<kDv, kThreads, kTileKv>;        // V's
  static constexpr int kChunks = Copy::kChunks;                // 16-byte chunks per row
  static constexpr int kRowStep = Copy::kRowStep;              // rows one copy pass covers
  static constexpr int kRowsPerThread = Copy::kRowsPerThread;  // rows each thread copies
  static constexpr int kRowElems = kSmemRowElems<D>;           // a Q or K row in shared memory
  static constexpr int kVRowElems = kSmemRowElems<kDv>;        // a V row
  static constexpr int kKTileElems = kTileKv * kRowElems;
  static constexpr int kStageElems = kKTileElems + kTileKv * kVRowElems;  // K tile then V tile
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageElems * sizeof(T);
  static constexpr size_t kQBytes = size_t{kRows} * kRowElems * sizeof(T);
  static constexpr size_t SmemBytes() { return kPipelineBytes + kQBytes; }
  // d192/d256 hold 96/128 accumulators per thread with 8 warps, d512 its 256 columns' share: one
  // block per SM; d64..d128 two.
  static constexpr int kMinBlocks = D > 128 ? 1 : 2;
  static_assert(kWarps * kWarpRows == kRows, "warps cover the tile's rows");
  static_assert(kTileKv % kSubKv == 0, "whole softmax steps per stage");
};

template <typename T, typename TIO, int D>
__device__ __forceinline__ void PrefillTileBody(const PagedAttentionParams& p) {
  using Cfg = PrefillTileConfig<T, D>;
  constexpr int MT = Cfg::kMTiles;
  constexpr int NT = Cfg::kSubKv / 8;  // n8 tiles of S per softmax step
  constexpr int KC = D / 16;           // k16 chunks of Q.K^T
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem_kv = reinterpret_cast<T*>(smem_raw);
  T* smem_q = reinterpret_cast<T*>(smem_raw + Cfg::kPipelineBytes);

  // Items run in the planner's order (by span, longest first), a group of kv heads at a time
  // (PrefillJobAt); the group's kv heads of one item run side by side, and so do the blocks of
  // one tile (kBlocksPerTile: row half, column half).
  const uint32_t sub = blockIdx.x % Cfg::kBlocksPerTile;
  const ItemMajorBlock block = PrefillJobAt(p, blockIdx.x / Cfg::kBlocksPerTile);
  const int row0 = static_cast<int>(sub / Cfg::kColSplit) * Cfg::kRows;  // in the planner's tile
  const int col0 = static_cast<int>(sub % Cfg::kColSplit) * Cfg::kDv;    // of O and V
  const int kv_head = block.kv_head;
  const AttentionWorkItem item = p.prefill_items[block.item];
  const AttentionSpan span = item.span_info;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_rows = span.num_queries * group;
  const int first_q_pos = span.kv_len - span.num_queries;
  const int tid = threadIdx.x;
  // A row half past the span (a tile of 64 rows or fewer) has nothing to do; its splits merge in
  // the separate merge kernel, which reads only the tile's rows.
  if (Cfg::kRowSplit > 1 && item.row_start + row0 >= span_rows) return;
  const int warp = tid >> 5, lane = tid & 31;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  // ---- K/V pipeline: each thread copies one 16-byte chunk column of kRowsPerThread rows.
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int copy_chunk = tid % Cfg::Copy::kSlots, copy_row0 = tid / Cfg::Copy::kSlots;
  const bool copies = copy_chunk < Cfg::kChunks;  // a column past the row (head_dim 80, 96, 192)
  const int num_tiles = (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  const int32_t* pages = p.page_table + span.page_table_offset;
  // Page ids go through shared memory (one slot of kTileKv ids per stage), so a thread keeps one
  // id in flight instead of one per row it copies: tile t + kStages's id is loaded at the top
  // of iteration t and stored at its end, before the barrier that precedes its copies.
  __shared__ int32_t page_ids[Cfg::kStages][Cfg::kTileKv];
  auto load_page_id = [&](int tile) {
    const int pos = item.kv_start + tile * Cfg::kTileKv + tid;
    return (tid < Cfg::kTileKv && tile < num_tiles && pos < item.kv_end)
               ? pages[p.page_div.Div(pos)]
               : 0;
  };
  // The kDv columns of V from col0 (all of them but at head_dim 512), in their own layout.
  auto issue_v_half = [&](int tile, int stage, T* sv) {
    using VCopy = typename Cfg::VCopy;
    const int chunk = tid % VCopy::kSlots, row0 = tid / VCopy::kSlots;
    if (chunk >= VCopy::kChunks) return;
#pragma unroll
    for (int i = 0; i < VCopy::kRowsPerThread; ++i) {
      const int row = row0 + i * VCopy::kRowStep;
      const int pos = item.kv_start + tile * Cfg::kTileKv + row;
      const bool valid = pos < item.kv_end;
      const int64_t offset =
          KvChunkOffset<D>(p, page_ids[stage][row], pos, kv_head, col0 / 8 + chunk);
      CpAsync16(SmemAddr(sv + SwizzledOffset<Cfg::kDv>(row, chunk)),
                valid ? v_cache + offset : v_cache, valid);
    }
  };
  auto issue_tile = [&](int tile) {
    const int stage = tile % Cfg::kStages;
    T* sk = smem_kv + stage * Cfg::kStageElems;
    T* sv = sk + Cfg::kKTileElems;
    if constexpr (Cfg::kDv != D) issue_v_half(tile, stage, sv);
    if (!copies) return;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
      const int row = copy_row0 + i * Cfg::kRowStep;
      const int pos = item.kv_start + tile * Cfg::kTileKv + row;
      const bool valid = pos < item.kv_end;
      const int64_t offset = KvChunkOffset<D>(p, page_ids[stage][row], pos, kv_head, copy_chunk);
      const int smem_off = SwizzledOffset<D>(row, copy_chunk);
      CpAsync16(SmemAddr(sk + smem_off), valid ? k_cache + offset : k_cache, valid);
      if constexpr (Cfg::kDv == D) {
        CpAsync16(SmemAddr(sv + smem_off), valid ? v_cache + offset : v_cache, valid);
      }
    }
  };
  // Prologue: the ids of the first kStages tiles, then the copies of the first kStages - 1.
  {
    int32_t first_ids[Cfg::kStages];
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) first_ids[s] = load_page_id(s);
    if (tid < Cfg::kTileKv) {
#pragma unroll
      for (int s = 0; s < Cfg::kStages; ++s) page_ids[s][tid] = first_ids[s];
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      if (s < num_tiles) issue_tile(s);
      CpAsyncCommit();
    }
  }

  // ---- Q tile -> shared memory as T (once per block), from q in TIO, as AttentionValue gives it
  // (LoadQTile's rule). Rows past the span are zero. (Not LoadQTile: its batched loads cost
  // this kernel, at the register limit, a spill; its two blocks per SM hide one block's start
  // behind the other's work.)
  for (int c = tid; c < Cfg::kRows * Cfg::kChunks; c += Cfg::kThreads) {
    const int r = c / Cfg::kChunks, chunk = c % Cfg::kChunks;
    const int span_row = item.row_start + row0 + r;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (span_row < span_rows) {
      if constexpr (std::is_same_v<TIO, float>) {
        const float4* src = reinterpret_cast<const float4*>(
            QChunk<float, D>(p, span, kv_head, group, span_row, chunk));
        const float4 lo = src[0], hi = src[1];
        packed = make_uint4(PackPair<T>(lo.x, lo.y), PackPair<T>(lo.z, lo.w),
                            PackPair<T>(hi.x, hi.y), PackPair<T>(hi.z, hi.w));
      } else {
        packed = *reinterpret_cast<const uint4*>(
            QChunk<TIO, D>(p, span, kv_head, group, span_row, chunk));
      }
    }
    *reinterpret_cast<uint4*>(smem_q + SwizzledOffset<D>(r, chunk)) = AttentionChunk<T>(packed);
  }

  // ---- Per-thread state: slice mt, rows quad_row and quad_row + 8; columns 2*quad_col..+1.
  constexpr int DV = Cfg::kDv;  // O's columns in this block
  float o[MT][DV / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DV / 8; ++dt)
      o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  float row_max[MT][2], row_sum[MT][2];  // max in raw score units
  int q_pos[MT][2];                      // last visible position of each row
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_max[mt][i] = -INFINITY;
      row_sum[mt][i] = 0.f;
      const int span_row =
          item.row_start + row0 + warp * Cfg::kWarpRows + mt * 16 + quad_row + 8 * i;
      q_pos[mt][i] =
          span_row >= span_rows ? -1 : (p.causal ? first_q_pos + span_row / group : INT32_MAX - 1);
    }
  }
  // The warp's visible range: steps past warp_max_pos are skipped, steps ending at or before
  // warp_min_pos (and inside the item) need no mask.
  const int warp_first_row = item.row_start + row0 + warp * Cfg::kWarpRows;
  const int warp_last_row = min(warp_first_row + Cfg::kWarpRows - 1, span_rows - 1);
  const bool warp_has_rows = warp_first_row < span_rows;
  const int warp_max_pos =
      !warp_has_rows ? -1 : (p.causal ? first_q_pos + warp_last_row / group : INT32_MAX - 1);
  const int warp_min_pos =
      !warp_has_rows ? -1 : (p.causal ? first_q_pos + warp_first_row / group : INT32_MAX - 1);
  // Under a window: steps ending before the warp's first row's window are skipped, steps
  // starting at or after its last row's window start need no window mask.
  const int warp_min_first = WindowFirst(p, first_q_pos + warp_first_row / group);
  const int warp_max_first = WindowFirst(p, first_q_pos + warp_last_row / group);
  const Softcap softcap = Softcap::Of(p);
  const float scale_log2 = softcap.scale_log2;  // the scores' unit (capped: cap's)

  // ldmatrix addresses: a lane's row and chunk within a 16 x 16 fragment are fixed, and the
  // swizzle only XORs the low 3 bits of the chunk, so chunk 2j + 8m of the lane's row sits at
  // off[j % 4] + (j / 4) * 128 bytes: four per-lane offsets per operand layout, the rest are
  // immediates. A layout (Q, and V read transposed): rows lane%8 + 8*(lane/8%2), chunk +lane/16.
  // K layout: rows lane%8 + 8*(lane/16), chunk + lane/8%2.
  // Unswizzled rows (head_dim 80, 96: padded instead) add the lane's chunk without the XOR.
  // V's rows are as wide as Q's but at head_dim 512 (kDv), whose off_v are their own.
  constexpr int kRowBytes = Cfg::kRowElems * static_cast<int>(sizeof(T));
  constexpr int kVRowBytes = Cfg::kVRowElems * static_cast<int>(sizeof(T));
  constexpr int kSwizzle = kSwizzledRows<D> ? 7 : 0;
  constexpr bool kOwnVOffsets = DV != D;
  uint32_t off_a[4], off_k[4], off_v_own[kOwnVOffsets ? 4 : 1];
  {
    const int row_a = (lane & 7) + 8 * ((lane >> 3) & 1), xor_a = (lane >> 4) ^ (lane & kSwizzle);
    const int row_k = (lane & 7) + 8 * (lane >> 4), xor_k = ((lane >> 3) & 1) ^ (lane & kSwizzle);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      off_a[j] = row_a * kRowBytes + (((2 * j) ^ xor_a) << 4);
      off_k[j] = row_k * kRowBytes + (((2 * j) ^ xor_k) << 4);
      if constexpr (kOwnVOffsets) {
        static_assert(kSwizzledRows<DV>, "a split V tile is whole 64-column blocks");
        off_v_own[j] = row_a * kVRowBytes + (((2 * j) ^ xor_a) << 4);
      }
    }
  }
  auto off_v = [&](int j) {
    if constexpr (kOwnVOffsets) {
      return off_v_own[j];
    } else {
      return off_a[j];
    }
  };
  const uint32_t warp_q_addr = SmemAddr(smem_q) + warp * Cfg::kWarpRows * kRowBytes;
  auto load_q_frag = [&](int mt, int kc, uint32_t(&a)[4]) {
    LdMatrixX4(a, warp_q_addr + off_a[kc & 3] + mt * 16 * kRowBytes + (kc >> 2) * 128);
  };
  uint32_t q_frag[Cfg::kQInRegisters ? MT : 1][Cfg::kQInRegisters ? KC : 1][4];

  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + Cfg::kStages - 1 < num_tiles) issue_tile(tile + Cfg::kStages - 1);
    CpAsyncCommit();
    const int32_t next_id = load_page_id(tile + Cfg::kStages);
    CpAsyncWait<Cfg::kStages - 1>();
    __syncthreads();
    if constexpr (Cfg::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int kc = 0; kc < KC; ++kc) load_q_frag(mt, kc, q_frag[mt][kc]);
      }
    }
    const T* sk = smem_kv + (tile % Cfg::kStages) * Cfg::kStageElems;
    const T* sv = sk + Cfg::kKTileElems;
#pragma unroll 1
    for (int sub = 0; sub < Cfg::kTileKv / Cfg::kSubKv; ++sub) {
      const int sub_row = sub * Cfg::kSubKv;  // first row of this step in the stage
      const int pos0 = item.kv_start + tile * Cfg::kTileKv + sub_row;
      const uint32_t k_addr = SmemAddr(sk) + sub_row * kRowBytes;
      const uint32_t v_addr = SmemAddr(sv) + sub_row * kVRowBytes;

      // Warp-uniform: skip positions no row of the warp sees.
      if (pos0 <= warp_max_pos && pos0 < item.kv_end &&
          pos0 + Cfg::kSubKv - 1 >= warp_min_first) {
        // S = Q K^T: each K fragment (16 positions x 16 dims) serves all MT slices.
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          uint32_t a[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if constexpr (Cfg::kQInRegisters) {
#pragma unroll
              for (int j = 0; j < 4; ++j) a[mt][j] = q_frag[mt][kc][j];
            } else {
              load_q_frag(mt, kc, a[mt]);
            }
          }
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            LdMatrixX4(b, k_addr + off_k[kc & 3] + np * 16 * kRowBytes + (kc >> 2) * 128);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              Mma16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
              Mma16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
          }
        }

#pragma unroll
        for (int mt = 0; mt < MT; ++mt) softcap.Apply(s[mt]);
        // Masks only where the step crosses the item's end or this warp's causal diagonal (and,
        // below, its window's start).
        const bool needs_mask =
            pos0 + Cfg::kSubKv > item.kv_end || pos0 + Cfg::kSubKv - 1 > warp_min_pos;
        if (needs_mask) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int pos = pos0 + nt * 8 + 2 * quad_col + (e & 1);
                if (pos >= item.kv_end || pos > q_pos[mt][e >> 1]) s[mt][nt][e] = -INFINITY;
              }
        }
        if (pos0 < warp_max_first) {  // a window's start: its rows' first positions, found here
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int first = WindowFirst(
                  p, first_q_pos + (warp_first_row + mt * 16 + quad_row + 8 * i) / group);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  if (pos0 + nt * 8 + 2 * quad_col + e < first) s[mt][nt][2 * i + e] = -INFINITY;
                }
            }
        }

        // Online softmax, once per step: new row max, rescaled sum, P = 2^(s*scale - max).
        uint32_t pa[MT][NT / 2][4];
        float alpha[MT][2];
        bool max_moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float mx = row_max[mt][i];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
              mx = fmaxf(mx, fmaxf(s[mt][nt][2 * i], s[mt][nt][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = SoftmaxBase(mx, scale_log2);
            max_moved |= mx != row_max[mt][i];
            alpha[mt][i] = FastExp2(SoftmaxExponent(row_max[mt][i], scale_log2, base));
            row_max[mt][i] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              s[mt][nt][2 * i] = FastExp2(SoftmaxExponent(s[mt][nt][2 * i], scale_log2, base));
              s[mt][nt][2 * i + 1] =
                  FastExp2(SoftmaxExponent(s[mt][nt][2 * i + 1], scale_log2, base));
              sum += s[mt][nt][2 * i] + s[mt][nt][2 * i + 1];
            }
            row_sum[mt][i] = row_sum[mt][i] * alpha[mt][i] + sum;
          }
          // P's accumulator layout is the A operand layout of the P.V mma (k = 16 positions).
#pragma unroll
          for (int kp = 0; kp < NT / 2; ++kp) {
            pa[mt][kp][0] = PackPair<T>(s[mt][2 * kp][0], s[mt][2 * kp][1]);
            pa[mt][kp][1] = PackPair<T>(s[mt][2 * kp][2], s[mt][2 * kp][3]);
            pa[mt][kp][2] = PackPair<T>(s[mt][2 * kp + 1][0], s[mt][2 * kp + 1][1]);
            pa[mt][kp][3] = PackPair<T>(s[mt][2 * kp + 1][2], s[mt][2 * kp + 1][3]);
          }
        }

        // Rescale O only when some row's max moved (alpha != 1): after the first tiles of a
        // long range the max rarely moves, and this is 4*MT*D/8 multiplies per step.
        if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DV / 8; ++dt) {
              o[mt][dt][0] *= alpha[mt][0];
              o[mt][dt][1] *= alpha[mt][0];
              o[mt][dt][2] *= alpha[mt][1];
              o[mt][dt][3] *= alpha[mt][1];
            }
        }

        // O += P V: each V fragment (16 positions x 16 dims) serves all MT slices.
#pragma unroll
        for (int kp = 0; kp < NT / 2; ++kp) {
#pragma unroll
          for (int dt = 0; dt < DV / 8; dt += 2) {
            uint32_t b[4];
            LdMatrixX4Trans(b,
                            v_addr + off_v((dt >> 1) & 3) + kp * 16 * kVRowBytes + (dt >> 3) * 128);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              Mma16816<T>(o[mt][dt], pa[mt][kp], b[0], b[1]);
              Mma16816<T>(o[mt][dt + 1], pa[mt][kp], b[2], b[3]);
            }
          }
        }
      }
    }
    // Slot tile % kStages was last read by issue_tile(tile) in an earlier iteration.
    if (tid < Cfg::kTileKv) page_ids[tile % Cfg::kStages][tid] = next_id;
    __syncthreads();  // the stage is overwritten by the next iteration's copies
  }
  CpAsyncWait<0>();

  // ---- Normalize and write: to out/lse for an unsplit tile, to the partial buffers otherwise.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = row_sum[mt][i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int tile_row = row0 + warp * Cfg::kWarpRows + mt * 16 + quad_row + 8 * i;
      const int span_row = item.row_start + tile_row;
      if (span_row >= span_rows) continue;
      // A sink joins an unsplit tile's rows here, a split one's in the merge.
      const float sink = item.partial_row < 0 ? SinkLog2(p, kv_head, group, span_row) : -INFINITY;
      const RowNorm norm = NormalizeRow(sum, SoftmaxBase(row_max[mt][i], scale_log2), sink);
      WriteTileRow<TIO, D, DV>(p, item, span, kv_head, group, tile_row, span_row, quad_col,
                               o[mt], i, norm.inv, norm.lse, col0);
    }
  }

  // A tile of several blocks merges in the separate merge kernel (AttentionPlanLimits::wide_head).
  if constexpr (Cfg::kBlocksPerTile == 1) {
    MergeIfLastSplit<TIO, D, kTwoPassMerge>(p, item, span, kv_head, group);
  }
}

// TIO: q's and out's element type (float, or the cache's T).
template <typename T, typename TIO, int D>
__global__ void __launch_bounds__(PrefillTileConfig<T, D>::kThreads,
                                  PrefillTileConfig<T, D>::kMinBlocks)
    PagedPrefillTileKernel(const __grid_constant__ PagedAttentionParams params) {
  PrefillTileBody<T, TIO, D>(params);
}

template <typename T, typename TIO, int D>
LaunchStatus LaunchPrefillTiles(const PagedAttentionParams& params, cudaStream_t stream,
                                Launcher& launcher) {
  using Cfg = PrefillTileConfig<T, D>;
  if (Cfg::kBlocksPerTile > 1 && params.num_merge_tasks > 0 && !params.separate_merge) {
    return LaunchStatus::Unsupported("head_dim " + std::to_string(D) +
                                     ": split prefill tiles merge in the separate merge kernel");
  }
  static SmemLimitFlags smem_raised;
  return LaunchItemMajorGrid(PagedPrefillTileKernel<T, TIO, D>, Cfg::kThreads, Cfg::SmemBytes(),
                             smem_raised, "prefill attention",
                             int64_t{params.num_prefill_items} * Cfg::kBlocksPerTile, params,
                             stream, launcher);
}

// Blocks of the portable prefill kernel an SM holds at once (the fewer of q in float and in T).
template <typename T, int D>
LaunchStatus PrefillTileOccupancy(int* blocks_per_sm) {
  using Cfg = PrefillTileConfig<T, D>;
  int blocks[2] = {0, 0};
  auto query = [&](auto kernel, int* n) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(Cfg::SmemBytes()));
    if (err == cudaSuccess) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kernel, Cfg::kThreads,
                                                          Cfg::SmemBytes());
    }
    return err;
  };
  cudaError_t err = query(PagedPrefillTileKernel<T, float, D>, &blocks[0]);
  if (err == cudaSuccess) err = query(PagedPrefillTileKernel<T, T, D>, &blocks[1]);
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("occupancy(prefill attention): ") +
                                   cudaGetErrorString(err));
  }
  *blocks_per_sm = std::min(blocks[0], blocks[1]);
  return LaunchStatus::Ok();
}

#define PAGEDATTN_INSTANTIATE_PREFILL(T, D)                                                        \
  template LaunchStatus LaunchPrefillTiles<T, float, D>(const PagedAttentionParams&, cudaStream_t, \
                                                        Launcher&);                                \
  template LaunchStatus LaunchPrefillTiles<T, T, D>(const PagedAttentionParams&, cudaStream_t,     \
                                                    Launcher&);                                    \
  template LaunchStatus PrefillTileOccupancy<T, D>(int*);

}  // namespace pagedattn::kernels
