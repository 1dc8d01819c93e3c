// The Hopper prefill tile kernel: the prefill tile of kernels/prefill_mma_kernel.cuh with its
// two matrix products on warpgroup MMA (wgmma, sm_90a). Included only by instantiate_hdim*.cu.
//
// A job is one prefill work item (kPrefillTileRows = 128 query rows) of one kv head, run by two
// warpgroups of 64 rows each. At head_dim 128 (and 80, 96, which run in its layout:
// WgmmaPrefillConfig::kWidth) a block is persistent: it runs the jobs the host dealt it
// (SchedulePrefillJobs) back to back, its K/V pipeline running on across jobs so that the next
// job's first tiles and its Q load while the last one ends; at 64, 192 and 256 a block runs one
// job. K/V tiles (64 or 128 positions) are gathered through the page table with 16-byte cp.async
// (row-wise, so any page size works) into shared memory laid out in the 128-byte-swizzle format
// that wgmma reads directly: each 64-column slice of a [rows][D] tile is its own [rows][64] block
// of 128-byte rows, 16-byte chunk c of row r stored at chunk c ^ (r % 8).
// Per tile and warpgroup:
//   S = Q.K^T:  wgmma m64n64k16, A = Q and B = K from shared memory (both K-major), D/16 steps;
//   online softmax in registers (exp2, scale folded into an FMA), masks only where needed;
//   O += P.V:   wgmma m64n64k16, A = P from registers (the S accumulator layout re-packed),
//               B = V from shared memory (MN-major: the transpose bit), D/64 column slices.
// Accumulators stay in the mma.sync fragment layout, so the output and split-KV code is shared
// with the portable kernels (WriteTileRow, MergeIfLastSplit).
//
// Device code exists only when compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); the host picks
// this kernel only when the build has sm_90a (PAGEDATTN_HAVE_SM90A) and the device is 9.0.
#pragma once

#include <algorithm>
#include <type_traits>

#include "kernels/device/ptx.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/device/wgmma.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

template <typename T, int D>
struct WgmmaPrefillConfig {
  static constexpr int kRows = kPrefillTileRows;  // query rows per block
  static constexpr int kGroupRows = 64;           // rows per warpgroup (the wgmma M)
  static constexpr int kGroups = kRows / kGroupRows;
  static constexpr int kThreads = kGroups * 128;
  // The tile's width in shared memory and in O (WgmmaPrefillWidth): at 80 and 96 128, V's
  // columns past D zero and O's dropped; 1.05x the portable kernel's rate at 96, the same at 80
  // (docs/PERFORMANCE.md#head-dims).
  static constexpr int kWidth = WgmmaPrefillWidth(D);
  // Tile shape per head_dim: d128 128 positions x 3 stages, pipelined; d64 64 x 4, one tile at
  // a time (its products are too small to hide the softmax behind); d256 64 x 2, all its 64 KiB
  // Q tile leaves room for (docs/PERFORMANCE.md#design-decisions).
  static constexpr int kTileKv = kWidth == 128 ? 128 : 64;
  static constexpr int kStages = kWidth == 128 ? 3 : (D == 64 ? 4 : 2);
  // Pipelined: S of tile j + 1 overlaps P.V of tile j (needs three stages or more).
  static constexpr bool kPipelined = kWidth == 128;
  // Pipelined tiles run in persistent blocks (WgmmaPrefillPersistentBody), jobs back to back so
  // the next job's first K/V tiles load during the last one's end; the others one block per item
  // and kv head, 2-8% faster than persistent for them (docs/PERFORMANCE.md#design-decisions).
  static constexpr bool kPersistent = kPipelined;
  static constexpr int kSlices = kWidth / 64;                // 64-column slices (swizzle blocks)
  using Copy = KvCopyLayout<D, kThreads, kTileKv>;
  static constexpr int kChunks = Copy::kChunks;                // 16-byte chunks per row
  static constexpr int kRowStep = Copy::kRowStep;              // rows one copy pass covers
  static constexpr int kRowsPerThread = Copy::kRowsPerThread;  // rows each thread copies
  static constexpr int kTileElems = kTileKv * kWidth;
  static constexpr int kStageElems = 2 * kTileElems;  // K tile then V tile
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageElems * sizeof(T);
  static constexpr size_t kQBytes = size_t{kRows} * kWidth * sizeof(T);
  // The swizzle pattern repeats every 1024 bytes and wgmma assumes blocks aligned to it; the
  // dynamic shared memory base is aligned at run time, hence the slack.
  static constexpr size_t kAlign = 1024;
  static constexpr size_t SmemBytes() { return kPipelineBytes + kQBytes + kAlign; }
  static_assert(kWidth % 64 == 0 && D % 16 == 0 && D <= kWidth, "whole 64-column slices");
  static_assert(kTileKv * 128 % kAlign == 0, "slices keep the 1024-byte alignment");
  // Dynamic plus static (row indices, flags: under 2 KiB) shared memory fit one SM's 227 KiB.
  static_assert(SmemBytes() + 2048 <= 227 * 1024, "fits one SM's shared memory");
};

#if PAGEDATTN_WGMMA_DEVICE

// The arithmetic of one warpgroup's tile, shared by both bodies below.
template <typename T, int D>
struct WgmmaTileMath {
  using Cfg = WgmmaPrefillConfig<T, D>;
  static constexpr int kNT = Cfg::kTileKv / 8;   // n8 tiles of S
  static constexpr int kKP = Cfg::kTileKv / 16;  // k16 steps of P.V
  static constexpr uint32_t kRowBytes = 128;     // one row of a 64-column slice
  static constexpr int kOT = Cfg::kWidth / 8;    // n8 tiles of O (those past D / 8 dropped)

  // The dynamic shared memory: kStages K/V stages, then the Q tile, from a base aligned to the
  // swizzle pattern's 1024 bytes.
  struct Smem {
    uint32_t base;    // shared-state address of stage 0
    T* kv;            // the stages
    T* q;             // the Q tile
    uint32_t q_base;  // its shared-state address
    // Shared-state addresses of stage `stage`'s K and V tiles, and of warpgroup wg's Q rows.
    __device__ __forceinline__ uint32_t k_addr(int stage) const {
      return base + static_cast<uint32_t>(stage * Cfg::kStageElems * sizeof(T));
    }
    __device__ __forceinline__ uint32_t v_addr(int stage) const {
      return k_addr(stage) + static_cast<uint32_t>(Cfg::kTileElems * sizeof(T));
    }
    __device__ __forceinline__ uint32_t q_rows(int wg) const {
      return q_base + wg * Cfg::kGroupRows * kRowBytes;
    }
  };
  __device__ __forceinline__ static Smem SmemOf(unsigned char* smem_raw) {
    const uint32_t base =
        (SmemAddr(smem_raw) + uint32_t{Cfg::kAlign - 1}) & ~uint32_t{Cfg::kAlign - 1};
    unsigned char* aligned = smem_raw + (base - SmemAddr(smem_raw));
    return {base, reinterpret_cast<T*>(aligned),
            reinterpret_cast<T*>(aligned + Cfg::kPipelineBytes),
            base + static_cast<uint32_t>(Cfg::kPipelineBytes)};
  }

  // What a thread's rows see and what its warp and warpgroup compute, for one item: rows
  // quad_row and quad_row + 8 of the warp's 16 in its warpgroup's 64.
  struct Rows {
    int q_pos[2];      // last visible position of each row (-1: past the span)
    int wg_tiles;      // the warpgroup's tiles: its wgmma's are collective, so what it computes
                       // is decided per warpgroup (under a causal mask, a prefix of the tiles)
    int warp_min_pos;  // last visible position of the warp's first row: masks are decided per
                       // warp, and a tile ending at or before it needs none
    int first_pos[2];    // first visible position of each row (a window's; INT32_MIN: all)
    int warp_max_first;  // first visible position of the warp's last row: a tile starting at or
                         // after it needs no window mask
  };
  // kWindowed: the layer may have a sliding window (else every row sees from position 0).
  template <bool kWindowed>
  __device__ __forceinline__ static Rows RowsOf(const PagedAttentionParams& p,
                                                const AttentionWorkItem& item, int group,
                                                int num_tiles, int wg, int wg_warp, int quad_row) {
    const AttentionSpan& span = item.span_info;
    const int span_rows = span.num_queries * group;
    const int first_q_pos = span.kv_len - span.num_queries;
    auto last_visible = [&](int span_row) {
      return span_row >= span_rows ? -1
                                   : (p.causal ? first_q_pos + span_row / group : INT32_MAX - 1);
    };
    Rows r;
    const int warp_first_row = item.row_start + wg * Cfg::kGroupRows + wg_warp * 16;
#pragma unroll
    for (int i = 0; i < 2; ++i) r.q_pos[i] = last_visible(warp_first_row + quad_row + 8 * i);
    const int wg_first_row = item.row_start + wg * Cfg::kGroupRows;
    const int wg_max_pos =
        wg_first_row >= span_rows
            ? -1
            : last_visible(min(wg_first_row + Cfg::kGroupRows - 1, span_rows - 1));
    r.wg_tiles = wg_max_pos < item.kv_start
                     ? 0
                     : min(num_tiles, (wg_max_pos - item.kv_start) / Cfg::kTileKv + 1);
    r.warp_min_pos = last_visible(warp_first_row);
    auto first_visible = [&](int span_row) {
      return kWindowed ? WindowFirst(p, first_q_pos + span_row / group) : INT32_MIN;
    };
#pragma unroll
    for (int i = 0; i < 2; ++i) r.first_pos[i] = first_visible(warp_first_row + quad_row + 8 * i);
    r.warp_max_first = first_visible(min(warp_first_row + 15, span_rows - 1));
    return r;
  }

  // A thread's rows before their first tile: O zero, no max, no sum.
  __device__ __forceinline__ static void StartRows(float (&o)[kOT][4], float (&row_max)[2],
                                                   float (&row_sum)[2]) {
#pragma unroll
    for (int dt = 0; dt < kOT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Copies one K/V tile into stage `stage` (16-byte cp.async, swizzle-128 layout): this thread's
  // chunk copy_chunk of rows copy_row0 + i * kRowStep, from pool rows `rows` (-1: zero-filled).
  __device__ __forceinline__ static void IssueKvTile(T* smem_kv,
                                                     const int32_t (&rows)[Cfg::kTileKv], int stage,
                                                     const T* k_cache, const T* v_cache,
                                                     int copy_chunk, int copy_row0) {
    T* sk = smem_kv + stage * Cfg::kStageElems;
    T* sv = sk + Cfg::kTileElems;
    if (copy_chunk >= Cfg::kChunks) return;  // a column past the row (head_dim 80, 96, 192)
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
      const int row = copy_row0 + i * Cfg::kRowStep;
      const int32_t base = rows[row];
      const bool valid = base >= 0;
      const int64_t offset = int64_t{valid ? base : 0} * D + copy_chunk * 8;
      const int smem_off = Sw128Offset<Cfg::kTileKv>(row, copy_chunk);
      CpAsync16(SmemAddr(sk + smem_off), k_cache + offset, valid);
      CpAsync16(SmemAddr(sv + smem_off), v_cache + offset, valid);
    }
  }

  // Zeroes V's columns past D in every stage (head dims 80, 96: kWidth), which no copy writes,
  // so that P.V over all kWidth columns adds nothing but zeros to the dropped part of O. Made
  // visible to wgmma by the fence and barrier before the first tile.
  __device__ __forceinline__ static void ZeroVPad(T* smem_kv, int tid) {
    constexpr int kPad = (Cfg::kWidth - D) / 8;  // 16-byte chunks a row
    for (int i = tid; i < Cfg::kStages * Cfg::kTileKv * kPad; i += Cfg::kThreads) {
      const int stage = i / (Cfg::kTileKv * kPad), rest = i % (Cfg::kTileKv * kPad);
      T* sv = smem_kv + stage * Cfg::kStageElems + Cfg::kTileElems;
      *reinterpret_cast<uint4*>(sv + Sw128Offset<Cfg::kTileKv>(rest / kPad, D / 8 + rest % kPad)) =
          make_uint4(0, 0, 0, 0);
    }
  }

  // The Q tile of an item and kv head -> shared memory as T, from q in TIO.
  template <typename TIO>
  __device__ __forceinline__ static void LoadQ(const PagedAttentionParams& p,
                                               const AttentionWorkItem& item, int kv_head,
                                               int group, T* smem_q) {
    LoadQTile<T, TIO, D, Cfg::kRows, Cfg::kThreads>(
        p, item, item.span_info, kv_head, group, item.span_info.num_queries * group, smem_q,
        [](int r, int chunk) { return Sw128Offset<Cfg::kRows>(r, chunk); });
  }

  // S = Q K^T of one tile (this warpgroup's Q rows at q_wg_base, the K tile at kb): D/16 k
  // steps; issued, not waited for.
  __device__ __forceinline__ static void IssueS(float (&s)[kNT][4], uint32_t q_wg_base,
                                                uint32_t kb) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t slice = kk >> 2, k_in = (kk & 3) * 32;
      WgmmaSS<T>(s, Sw128Desc(q_wg_base + slice * Cfg::kRows * kRowBytes + k_in),
                 Sw128Desc(kb + slice * Cfg::kTileKv * kRowBytes + k_in), kk > 0);
    }
  }

  // O += P V of one tile (the V tile at vb): per 16-position k step, one wgmma per 64-column
  // slice of V.
  __device__ __forceinline__ static void IssuePV(float (&o)[kOT][4], const uint32_t (&pa)[kKP][4],
                                                 uint32_t vb) {
#pragma unroll
    for (int kp = 0; kp < kKP; ++kp) {
      if constexpr (Cfg::kWidth == 128) {
        // One m64n128 wgmma over both slices: 2% faster than two n64's
        // (docs/PERFORMANCE.md#design-decisions).
        WgmmaRS<T>(o, pa[kp], Sw128Desc(vb + kp * 16 * kRowBytes, Cfg::kTileKv * kRowBytes));
      } else {
#pragma unroll
        for (int sl = 0; sl < Cfg::kSlices; ++sl)
          WgmmaRS<T>(*reinterpret_cast<float(*)[8][4]>(&o[sl * 8]), pa[kp],
                     Sw128Desc(vb + sl * Cfg::kTileKv * kRowBytes + kp * 16 * kRowBytes));
      }
    }
  }

  // s <- 2^(s*scale - base) on row i (0, 1) of the thread's pairs, unclamped; their sum as a tree
  // over the n tiles (a warp has few neighbours to hide a chain of dependent adds behind: two
  // per scheduler).
  __device__ __forceinline__ static float ExpRowSum(float (&s)[kNT][4], int i, float scale_log2,
                                                    float base) {
    float part[kNT];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      s[nt][2 * i] = FastExp2(fmaf(s[nt][2 * i], scale_log2, -base));
      s[nt][2 * i + 1] = FastExp2(fmaf(s[nt][2 * i + 1], scale_log2, -base));
      part[nt] = s[nt][2 * i] + s[nt][2 * i + 1];
    }
#pragma unroll
    for (int level = 1; level < kNT; level *= 2)  // kNT is a power of two
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2 * level) part[nt] += part[nt + level];
    return part[0];
  }

  // Soft-cap (when the layer has one), mask (positions pos0.. of the tile: past kv_end, past a
  // row's q_pos, before its window), new row max, s <- 2^(s*scale - max) in place, running sum;
  // alpha is the factor O must be rescaled by. Apart from PackP so that P's registers, the
  // operand of a P.V in flight, can be written after it is waited for while the exponentials
  // run beside it. Exponents unclamped: only launches whose scores stay finite come here
  // (ExponentsStayFinite), a clamp less a score (2% of prefill).
  __device__ __forceinline__ static void SoftmaxExp(float (&s)[kNT][4], int pos0, int kv_end,
                                                    const Rows& rows, int quad_col,
                                                    const Softcap& softcap, float scale_log2,
                                                    float (&row_max)[2], float (&row_sum)[2],
                                                    float (&alpha)[2]) {
    softcap.Apply(s);
    if (pos0 + Cfg::kTileKv > kv_end || pos0 + Cfg::kTileKv - 1 > rows.warp_min_pos ||
        pos0 < rows.warp_max_first) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = pos0 + nt * 8 + 2 * quad_col + (e & 1);
          if (pos >= kv_end || pos > rows.q_pos[e >> 1] || pos < rows.first_pos[e >> 1]) {
            s[nt][e] = -INFINITY;
          }
        }
    }
    if (softcap.FixedBase<T>()) {  // block-uniform: the fixed base, no max and no rescale
      const float base = SoftmaxBase(softcap.fixed_max, scale_log2);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        row_sum[i] += ExpRowSum(s, i, scale_log2, base);
        row_max[i] = softcap.fixed_max;  // what WriteRows and the merges take the base from
        alpha[i] = 1.f;
      }
      return;
    }
    // The max as a tree too.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float part[kNT];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) part[nt] = fmaxf(s[nt][2 * i], s[nt][2 * i + 1]);
#pragma unroll
      for (int level = 1; level < kNT; level *= 2)  // kNT is a power of two
#pragma unroll
        for (int nt = 0; nt < kNT; nt += 2 * level) part[nt] = fmaxf(part[nt], part[nt + level]);
      float mx = fmaxf(row_max[i], part[0]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = SoftmaxBase(mx, scale_log2);
      alpha[i] = FastExp2(SoftmaxExponent(row_max[i], scale_log2, base));
      row_max[i] = mx;
      row_sum[i] = row_sum[i] * alpha[i] + ExpRowSum(s, i, scale_log2, base);
    }
  }

  // P as the A operand of P.V (k step kp covers positions 16kp..16kp+15).
  __device__ __forceinline__ static void PackP(const float (&s)[kNT][4], uint32_t (&pa)[kKP][4]) {
#pragma unroll
    for (int kp = 0; kp < kKP; ++kp) {
      pa[kp][0] = PackPair<T>(s[2 * kp][0], s[2 * kp][1]);
      pa[kp][1] = PackPair<T>(s[2 * kp][2], s[2 * kp][3]);
      pa[kp][2] = PackPair<T>(s[2 * kp + 1][0], s[2 * kp + 1][1]);
      pa[kp][3] = PackPair<T>(s[2 * kp + 1][2], s[2 * kp + 1][3]);
    }
  }

  __device__ __forceinline__ static void RescaleO(float (&o)[kOT][4], const float (&alpha)[2]) {
    // Only when some row's max moved: after the first tiles of a long range it rarely does.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
      }
    }
  }

  __device__ __forceinline__ static void FenceP(uint32_t (&pa)[kKP][4]) {
#pragma unroll
    for (int kp = 0; kp < kKP; ++kp) FenceRegs(pa[kp]);
  }

  // Normalize and write this thread's two rows: to out (in TIO) / lse for an unsplit tile, to the
  // partial buffers otherwise.
  template <typename TIO>
  __device__ __forceinline__ static void WriteRows(const PagedAttentionParams& p,
                                                   const AttentionWorkItem& item,
                                                   const AttentionSpan& span, int kv_head,
                                                   int group, int span_rows, int first_tile_row,
                                                   int quad_col, const float (&o)[kOT][4],
                                                   const float (&row_max)[2],
                                                   const float (&row_sum)[2], float scale_log2) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = row_sum[i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int tile_row = first_tile_row + 8 * i;
      const int span_row = item.row_start + tile_row;
      if (span_row >= span_rows) continue;
      // A sink joins an unsplit tile's rows here, a split one's in the merge.
      const float sink =
          item.partial_row < 0 ? SinkLog2(p, kv_head, group, span_row) : -INFINITY;
      const RowNorm norm = NormalizeRow(sum, SoftmaxBase(row_max[i], scale_log2), sink);
      WriteTileRow<TIO, D>(p, item, span, kv_head, group, tile_row, span_row, quad_col,
                           *reinterpret_cast<const float(*)[D / 8][4]>(&o[0]), i, norm.inv,
                           norm.lse);
    }
  }
};

template <typename T, typename TIO, int D, bool kVariant>
__device__ __forceinline__ void WgmmaPrefillItemBody(const PagedAttentionParams& p) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  using M = WgmmaTileMath<T, D>;
  static_assert(!Cfg::kPipelined, "the pipelined tile runs in the persistent body");
  constexpr int kNT = M::kNT, kKP = M::kKP, kS = Cfg::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const typename M::Smem smem = M::SmemOf(smem_raw);
  T* smem_kv = smem.kv;

  // Items run in the planner's order (by span, longest first); the kv heads of one item run
  // side by side.
  const ItemMajorBlock block = ItemMajor(p);
  const int kv_head = block.kv_head;
  const AttentionWorkItem item = p.prefill_items[block.item];
  const AttentionSpan span = item.span_info;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_rows = span.num_queries * group;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  // ---- K/V pipeline: tile t is issued kS - 1 tiles ahead, into stage t % kS, by all threads,
  // each copying 16-byte chunk copy_chunk of kRowsPerThread rows (swizzle-128 layout). The
  // pool row of each position's K/V goes through shared memory, one slot per stage,
  // computed kS tiles ahead by the thread of that position (page-table load, page division):
  // a copy then costs one shared load and two adds.
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int copy_chunk = tid % Cfg::Copy::kSlots, copy_row0 = tid / Cfg::Copy::kSlots;
  const int num_tiles = (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  const int32_t* pages = p.page_table + span.page_table_offset;
  // Row indices (row = (page * kv_heads + kv_head) * page_size + in_page, D elements each) fit
  // in 31 bits: 2^31 rows of at least 128 bytes exceed any GPU's memory. At head_dim 128 the
  // block uses all but 2 KiB of the SM's shared memory, which int64 offsets would not fit.
  __shared__ int32_t row_base[kS][Cfg::kTileKv];  // -1: past the item's range
  auto load_page_id = [&](int tile) {
    const int pos = item.kv_start + tile * Cfg::kTileKv + tid;
    return (tid < Cfg::kTileKv && tile < num_tiles && pos < item.kv_end)
               ? pages[p.page_div.Div(pos)]
               : -1;
  };
  auto store_row_base = [&](int tile, int32_t page_id) {
    if (tid >= Cfg::kTileKv) return;
    const int pos = item.kv_start + tile * Cfg::kTileKv + tid;
    const int32_t in_page = pos - static_cast<int32_t>(p.page_div.Div(pos)) * p.page_size;
    row_base[tile % kS][tid] =
        page_id < 0 ? -1 : (page_id * p.num_kv_heads + kv_head) * p.page_size + in_page;
  };
  auto issue_tile = [&](int tile) {
    M::IssueKvTile(smem_kv, row_base[tile % kS], tile % kS, k_cache, v_cache, copy_chunk,
                   copy_row0);
  };
  {
    int32_t first_ids[kS];
#pragma unroll
    for (int s = 0; s < kS; ++s) first_ids[s] = load_page_id(s);
#pragma unroll
    for (int s = 0; s < kS; ++s) store_row_base(s, first_ids[s]);
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kS - 1; ++s) {
      if (s < num_tiles) issue_tile(s);
      CpAsyncCommit();
    }
  }

  // ---- Q tile -> shared memory as T (once per block), while the first copies fly.
  M::template LoadQ<TIO>(p, item, kv_head, group, smem.q);

  // ---- Per-thread state: rows quad_row and quad_row + 8 of this warp's 16 in its warpgroup's
  // 64; columns 2*quad_col..+1 of every 8-wide n tile (the mma.sync accumulator layout).
  float o[M::kOT][4], row_max[2], row_sum[2];
  M::StartRows(o, row_max, row_sum);
  const typename M::Rows rows =
      M::template RowsOf<kVariant>(p, item, group, num_tiles, wg, wg_warp, quad_row);
  const int wg_tiles = rows.wg_tiles;
  const Softcap softcap = kVariant ? Softcap::Of(p) : Softcap::None(p);
  const float scale_log2 = softcap.scale_log2;  // the scores' unit (capped: cap's)
  const uint32_t q_wg_base = smem.q_rows(wg);
  auto issue_s = [&](float(&s)[kNT][4], int tile) {
    M::IssueS(s, q_wg_base, smem.k_addr(tile % kS));
  };
  auto issue_pv = [&](const uint32_t(&pa)[kKP][4], int tile) {
    M::IssuePV(o, pa, smem.v_addr(tile % kS));
  };
  auto softmax_exp = [&](float(&s)[kNT][4], int tile, float(&alpha)[2]) {
    M::SoftmaxExp(s, item.kv_start + tile * Cfg::kTileKv, item.kv_end, rows, quad_col, softcap,
                  scale_log2, row_max, row_sum, alpha);
  };
  auto fence_o = [&]() { FenceRegs(o); };

  // ---- Main loop: one tile at a time, issue tile + kS - 1 into the stage the last iteration
  // read, then S, softmax and P.V of this tile.
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + kS - 1 < num_tiles) issue_tile(tile + kS - 1);
    CpAsyncCommit();
    const int32_t next_id = load_page_id(tile + kS);
    CpAsyncWait<kS - 1>();
    ProxyFenceShared();  // this thread's cp.async and Q stores, visible to wgmma
    __syncthreads();
    if (tile < wg_tiles) {
      float s[kNT][4];
      WgmmaFence();
      issue_s(s, tile);
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegs(s);
      uint32_t pa[kKP][4];
      float alpha[2];
      softmax_exp(s, tile, alpha);
      M::PackP(s, pa);
      M::RescaleO(o, alpha);
      fence_o();
      M::FenceP(pa);
      WgmmaFence();
      issue_pv(pa, tile);
      WgmmaCommit();
      WgmmaWait<0>();
      fence_o();
      M::FenceP(pa);
    }
    store_row_base(tile + kS, next_id);
    __syncthreads();  // the stage is overwritten by the next iteration's copies
  }
  CpAsyncWait<0>();

  // ---- Normalize and write.
  M::template WriteRows<TIO>(p, item, span, kv_head, group, span_rows,
                             wg * Cfg::kGroupRows + wg_warp * 16 + quad_row, quad_col, o, row_max,
                             row_sum, scale_log2);

  MergeIfLastSplit<TIO, D, kTwoPassMerge>(p, item, span, kv_head, group);
}

template <typename T, typename TIO, int D, bool kVariant>
__device__ __forceinline__ void WgmmaPrefillPersistentBody(const PagedAttentionParams& p) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  using M = WgmmaTileMath<T, D>;
  static_assert(Cfg::kPipelined, "the one-tile-at-a-time loop runs in the per-item body");
  constexpr int kNT = M::kNT, kKP = M::kKP, kS = Cfg::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const typename M::Smem smem = M::SmemOf(smem_raw);
  T* smem_kv = smem.kv;
  if constexpr (Cfg::kWidth > D) M::ZeroVPad(smem_kv, threadIdx.x);

  // This block's jobs (item, kv head), in the host's order (SchedulePrefillJobs).
  const int job_begin = p.prefill_job_start[blockIdx.x];
  const int job_end = p.prefill_job_start[blockIdx.x + 1];
  if (job_begin >= job_end) return;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  // ---- Jobs in shared memory: a ring of kRing records, job j in slot (j - job_begin) % kRing.
  // The K/V pipeline runs ahead of the arithmetic, across job boundaries (below), by at most kS
  // tiles, so the jobs in use at once are the arithmetic's, the pipeline's and the next one:
  // each job is copied in when the pipeline enters the one before it, from a register loaded
  // one job earlier still (threads tid < kJobWords, one word each), so the copy never waits.
  constexpr int kRing = kS + 3;
  constexpr int kJobWords = sizeof(AttentionPrefillJob) / 4;
  static_assert(kRing >= kS + 3, "the ring holds every job in use");
  static_assert(kJobWords <= Cfg::kThreads, "one word per thread");
  __shared__ AttentionPrefillJob ring[kRing];
  auto job_word = [&](int j) { return reinterpret_cast<const int32_t*>(p.prefill_jobs + j)[tid]; };
  auto set_ring_word = [&](int slot, int32_t w) {
    reinterpret_cast<int32_t*>(&ring[slot])[tid] = w;
  };
  int32_t ahead_word = 0;  // word tid of job (the pipeline's job + 2)
  if (tid < kJobWords) {
    set_ring_word(0, job_word(job_begin));
    if (job_begin + 1 < job_end) set_ring_word(1, job_word(job_begin + 1));
    if (job_begin + 2 < job_end) ahead_word = job_word(job_begin + 2);
  }
  __syncthreads();

  // ---- K/V pipeline: one stream of tiles over all the block's jobs, stream tile g in stage
  // g % kS, issued kS - 1 tiles ahead by all threads, each copying 16-byte chunk copy_chunk of
  // kRowsPerThread rows (swizzle-128 layout). The pool row of each position goes through
  // shared memory (row_base, one slot per stage), computed kS tiles ahead by the thread of that
  // position from the cursor (below), which walks the jobs tile by tile. A copy then costs one
  // shared load and two adds, and never needs to know which job its tile belongs to.
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int copy_chunk = tid % Cfg::Copy::kSlots, copy_row0 = tid / Cfg::Copy::kSlots;
  auto tiles_of = [](const AttentionWorkItem& item) {
    return (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  };
  // Row indices (row = (page * kv_heads + kv_head) * page_size + in_page, D elements each) fit
  // in 31 bits: 2^31 rows of at least 128 bytes exceed any GPU's memory. At head_dim 128 the
  // block uses all but 2 KiB of the SM's shared memory, which int64 offsets would not fit.
  __shared__ int32_t row_base[kS][Cfg::kTileKv];  // -1: past the job's range
  __shared__ float2 pin_slot;                     // PinBeforeWait's (never written)
  const uint32_t sink = SmemAddr(&pin_slot);
  // The pipeline's cursor over the block's jobs, one K/V tile at a time.
  struct JobCursor {
    int job;         // the job whose tiles the pipeline issues
    int slot;        // its ring slot
    int pos;         // this thread's position in the cursor's tile (tid's row)
    int end;         // the job's kv_end; INT32_MIN past the last job (no more pages)
    int tiles_left;  // the job's tiles from the cursor's on
  };
  JobCursor cur = {job_begin, 0, ring[0].item.kv_start + tid, ring[0].item.kv_end,
                   tiles_of(ring[0].item)};
  auto load_page_id = [&]() -> int32_t {
    if (tid >= Cfg::kTileKv || cur.pos >= cur.end) return -1;
    return p.page_table[ring[cur.slot].item.span_info.page_table_offset + p.page_div.Div(cur.pos)];
  };
  auto store_row_base = [&](int stage, int32_t page_id) {
    if (tid >= Cfg::kTileKv) return;
    int32_t row = -1;
    if (page_id >= 0) {
      const int32_t in_page = cur.pos - static_cast<int32_t>(p.page_div.Div(cur.pos)) * p.page_size;
      row = (page_id * p.num_kv_heads + ring[cur.slot].kv_head) * p.page_size + in_page;
    }
    row_base[stage][tid] = row;
  };
  // The cursor's next tile; entering a job copies the one after it into the ring (visible
  // after the next barrier, a step before the cursor can reach it).
  auto advance = [&]() {
    cur.pos += Cfg::kTileKv;
    if (--cur.tiles_left > 0) return;
    if (++cur.job >= job_end) {
      cur.end = INT32_MIN;
      cur.tiles_left = INT32_MAX;
      return;
    }
    cur.slot = cur.slot == kRing - 1 ? 0 : cur.slot + 1;
    cur.pos = ring[cur.slot].item.kv_start + tid;
    cur.end = ring[cur.slot].item.kv_end;
    cur.tiles_left = tiles_of(ring[cur.slot].item);
    if (tid < kJobWords && cur.job + 1 < job_end) {
      set_ring_word(cur.slot == kRing - 1 ? 0 : cur.slot + 1, ahead_word);
      if (cur.job + 2 < job_end) ahead_word = job_word(cur.job + 2);
    }
  };
  auto issue_tile = [&](int g) {
    M::IssueKvTile(smem_kv, row_base[g % kS], g % kS, k_cache, v_cache, copy_chunk, copy_row0);
  };
  // The first kS tiles' rows and the first kS - 1 tiles' copies. Page ids load side by side
  // when the first job has kS tiles or more; otherwise the cursor crosses jobs, with a barrier
  // after each step of it (the next job's record).
  if (cur.tiles_left >= kS) {
    int32_t ids[kS];
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      ids[s] = load_page_id();
      cur.pos += Cfg::kTileKv;
    }
    cur.pos -= kS * Cfg::kTileKv;
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      store_row_base(s, ids[s]);
      advance();
    }
    __syncthreads();
  } else {
#pragma unroll 1
    for (int s = 0; s < kS; ++s) {
      store_row_base(s, load_page_id());
      advance();
      __syncthreads();
    }
  }
#pragma unroll
  for (int s = 0; s < kS - 1; ++s) {
    issue_tile(s);
    CpAsyncCommit();
  }
  auto load_q = [&](const AttentionPrefillJob& job) {
    M::template LoadQ<TIO>(p, job.item, job.kv_head, group, smem.q);
  };
  // ---- Q tile of the first job -> shared memory as T, while the first copies fly. The next
  // job's Q is loaded during the last tile of each job, once no S reads the tile any more.
  load_q(ring[0]);

  const Softcap softcap = kVariant ? Softcap::Of(p) : Softcap::None(p);
  const float scale_log2 = softcap.scale_log2;  // the scores' unit (capped: cap's)
  const uint32_t q_wg_base = smem.q_rows(wg);
  // S = Q K^T of stream tile g; issued, not waited for.
  auto issue_s = [&](float(&s)[kNT][4], int g) { M::IssueS(s, q_wg_base, smem.k_addr(g % kS)); };

  int g0 = 0;     // stream index of the current job's first tile
  int cslot = 0;  // the current job's ring slot
#pragma unroll 1
  for (int ck = job_begin; ck < job_end; ++ck, cslot = cslot == kRing - 1 ? 0 : cslot + 1) {
    const AttentionPrefillJob& job = ring[cslot];
    const AttentionWorkItem& item = job.item;
    const AttentionSpan& span = item.span_info;
    const int kv_head = job.kv_head;
    const int span_rows = span.num_queries * group;
    const int num_tiles = tiles_of(item);
    const int kv_start = item.kv_start, kv_end = item.kv_end;
    const bool has_next = ck + 1 < job_end;

    // ---- Per-thread state: rows quad_row and quad_row + 8 of this warp's 16 in its
    // warpgroup's 64; columns 2*quad_col..+1 of every 8-wide n tile (the mma.sync accumulator
    // layout).
    float o[M::kOT][4], row_max[2], row_sum[2];
    M::StartRows(o, row_max, row_sum);
    const typename M::Rows rows =
        M::template RowsOf<kVariant>(p, item, group, num_tiles, wg, wg_warp, quad_row);
    const int wg_tiles = rows.wg_tiles;

    // O += P V of job tile `tile` (stream g0 + tile).
    auto issue_pv = [&](const uint32_t(&pa)[kKP][4], int tile) {
      M::IssuePV(o, pa, smem.v_addr((g0 + tile) % kS));
    };
    auto softmax_exp = [&](float(&s)[kNT][4], int tile, float(&alpha)[2]) {
      M::SoftmaxExp(s, kv_start + tile * Cfg::kTileKv, kv_end, rows, quad_col, softcap,
                    scale_log2, row_max, row_sum, alpha);
    };
    auto fence_o = [&]() { FenceRegs(o); };
    // The stream tile kS - 1 ahead of g (whichever job it belongs to), as one commit group.
    auto issue_ahead = [&](int g) {
      issue_tile(g + kS - 1);
      CpAsyncCommit();
    };
    // Stage g % kS held stream tile g's rows, read when it was issued; it now takes the
    // cursor's tile (g + kS), whose page id was loaded at the start of the step. Done while
    // the step's wgmma's run, off the path between them.
    auto produce = [&](int g, int32_t page_id) {
      store_row_base(g % kS, page_id);
      advance();
    };
    // In the job's last step, after its barrier: no S reads Q any more, so the next job's Q
    // tile is loaded (beside the last P.V when there is one).
    auto next_q = [&](int tile) {
      if (tile == num_tiles - 1 && has_next) load_q(ring[cslot == kRing - 1 ? 0 : cslot + 1]);
    };

    // ---- Main loop, software-pipelined within the warpgroup: while O += P_j V_j runs on the
    // tensor cores, the softmax of tile j + 1 (whose S was issued just before) runs beside it.
    // Iteration j needs V of tile j and K of tile j + 1 resident; stream tile g + kS - 1 is
    // issued after the barrier, into the stage of tile j - 1, whose P.V every warpgroup has
    // waited for.
    // One iteration: P of `tile` is in pa. S of tile + 1 and P.V of tile are issued
    // together; the exponentials of tile + 1 run while P.V is in flight; then O is rescaled
    // and P packed.
    uint32_t pa[kKP][4];
    auto step = [&](int tile) {
      const int g = g0 + tile;
      const int32_t next_id = load_page_id();
      CpAsyncWait<kS - 3>();  // stream tile g + 1
      ProxyFenceShared();
      __syncthreads();
      // Warpgroup-uniform branches, each one issuing and waiting for its own wgmma's (ptxas
      // serializes wgmma's whose groups stay open across a branch).
      if (tile + 1 < wg_tiles) {
        float s[kNT][4];
        fence_o();
        M::FenceP(pa);
        WgmmaFence();
        issue_s(s, g + 1);
        WgmmaCommit();
        issue_pv(pa, tile);
        WgmmaCommit();
        issue_ahead(g);
        produce(g, next_id);
        WgmmaWait<1>();  // S of tile + 1; P.V of tile may still run
        FenceRegs(s);
        float alpha[2];
        softmax_exp(s, tile + 1, alpha);
        // ptxas schedules the wait below as early as it can, which would put it above the
        // exponentials and end their overlap with the P.V in flight; a shared-memory store
        // of the running sums (which depend on every exponential) pins them above it.
        PinBeforeWait(sink, row_sum);
        WgmmaWait<0>();
        fence_o();
        M::FenceP(pa);
        M::RescaleO(o, alpha);
        M::PackP(s, pa);
      } else if (tile < wg_tiles) {
        fence_o();
        M::FenceP(pa);
        WgmmaFence();
        issue_pv(pa, tile);
        WgmmaCommit();
        issue_ahead(g);
        produce(g, next_id);
        next_q(tile);
        WgmmaWait<0>();
        fence_o();
        M::FenceP(pa);
      } else {
        issue_ahead(g);
        produce(g, next_id);
        next_q(tile);
      }
    };
    CpAsyncWait<kS - 2>();  // stream tile g0
    ProxyFenceShared();     // this thread's cp.async and Q stores, visible to wgmma
    __syncthreads();
    if (wg_tiles > 0) {
      float s[kNT][4];
      WgmmaFence();
      issue_s(s, g0);
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegs(s);
      float alpha[2];
      softmax_exp(s, 0, alpha);  // O is still zero: no rescale
      M::PackP(s, pa);
    }
#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) step(tile);
    g0 += num_tiles;

    // ---- Normalize and write.
    M::template WriteRows<TIO>(p, item, span, kv_head, group, span_rows,
                               wg * Cfg::kGroupRows + wg_warp * 16 + quad_row, quad_col, o, row_max,
                               row_sum, scale_log2);

    MergeIfLastSplit<TIO, D, kTwoPassMerge>(p, item, span, kv_head, group);
  }
  CpAsyncWait<0>();  // the zero-filled copies past the last job
}

#endif  // PAGEDATTN_WGMMA_DEVICE

// TIO: q's and out's element type (float, or the cache's T). kVariant: the layer may have a
// sliding window or a soft-cap; a plain layer's kernel compiles their checks out, which makes it
// 0.5-1.5% faster (docs/PERFORMANCE.md#design-decisions). Sinks join rows at the end in both.
template <typename T, typename TIO, int D, bool kVariant>
__global__ void __launch_bounds__(WgmmaPrefillConfig<T, D>::kThreads, 1)
    PagedPrefillWgmmaKernel(const __grid_constant__ PagedAttentionParams params) {
#if PAGEDATTN_WGMMA_DEVICE
  if constexpr (WgmmaPrefillConfig<T, D>::kPersistent) {
    WgmmaPrefillPersistentBody<T, TIO, D, kVariant>(params);
  } else {
    WgmmaPrefillItemBody<T, TIO, D, kVariant>(params);
  }
#else
  __trap();  // never launched: the host picks this kernel only for sm_90a builds on sm_90
#endif
}

// The Hopper prefill kernel's shared-memory limit, raised once per device for the launcher and
// the occupancy query alike.
template <typename T, typename TIO, int D, bool kVariant>
LaunchStatus RaiseWgmmaPrefillSmemLimit() {
  static SmemLimitFlags smem_raised;
  return RaiseSmemLimitOnce(PagedPrefillWgmmaKernel<T, TIO, D, kVariant>,
                            WgmmaPrefillConfig<T, D>::SmemBytes(), smem_raised,
                            "prefill attention (wgmma)");
}

// One of the kernels. Persistent configurations: one block per schedule entry
// (num_prefill_blocks, from SchedulePrefillJobs), each running its jobs back to back. The others:
// one block per item and kv head.
template <typename T, typename TIO, int D, bool kVariant>
LaunchStatus LaunchPrefillTilesWgmmaOf(const PagedAttentionParams& params, cudaStream_t stream,
                                       Launcher& launcher) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  if constexpr (!Cfg::kPersistent) {
    static SmemLimitFlags smem_raised;
    return LaunchItemMajorGrid(PagedPrefillWgmmaKernel<T, TIO, D, kVariant>, Cfg::kThreads,
                               Cfg::SmemBytes(), smem_raised, "prefill attention (wgmma)",
                               params.num_prefill_items, params, stream, launcher);
  }
  if (params.prefill_jobs == nullptr || params.prefill_job_start == nullptr ||
      params.num_prefill_blocks <= 0) {
    return LaunchStatus::Unsupported(
        "the Hopper prefill kernel needs a job schedule (SchedulePrefillJobs with the blocks "
        "QueryPlanLimits gives)");
  }
  if (LaunchStatus st = RaiseWgmmaPrefillSmemLimit<T, TIO, D, kVariant>(); !st.ok()) return st;
  return launcher.Launch(PagedPrefillWgmmaKernel<T, TIO, D, kVariant>,
                         dim3(static_cast<unsigned>(params.num_prefill_blocks)),
                         dim3(Cfg::kThreads), Cfg::SmemBytes(), stream, params,
                         "prefill attention (wgmma)");
}

// A layer with a window or a soft-cap takes the variant kernel, any other the plain one.
template <typename T, typename TIO, int D>
LaunchStatus LaunchPrefillTilesWgmma(const PagedAttentionParams& params, cudaStream_t stream,
                                     Launcher& launcher) {
  if (params.num_prefill_items == 0) return LaunchStatus::Ok();
  return params.window > 0 || params.softcap > 0.f
             ? LaunchPrefillTilesWgmmaOf<T, TIO, D, true>(params, stream, launcher)
             : LaunchPrefillTilesWgmmaOf<T, TIO, D, false>(params, stream, launcher);
}

// Blocks of one of the kernels an SM holds (shared memory and registers).
template <typename T, typename TIO, int D, bool kVariant>
LaunchStatus WgmmaPrefillBlocksPerSm(int* blocks) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  if (LaunchStatus st = RaiseWgmmaPrefillSmemLimit<T, TIO, D, kVariant>(); !st.ok()) return st;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks, PagedPrefillWgmmaKernel<T, TIO, D, kVariant>, Cfg::kThreads, Cfg::SmemBytes());
  return err == cudaSuccess
             ? LaunchStatus::Ok()
             : LaunchStatus::CudaError(std::string("occupancy of the Hopper prefill kernel: ") +
                                       cudaGetErrorString(err));
}

// Blocks of the persistent Hopper prefill kernel one SM holds (shared memory and registers),
// the fewest of its kernels (q in float or in T, plain or variant layer: one schedule serves
// each); 0 for a configuration that runs one block per item (no schedule).
template <typename T, int D>
LaunchStatus PrefillWgmmaOccupancy(int* blocks_per_sm) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  *blocks_per_sm = 0;
  if constexpr (!Cfg::kPersistent) return LaunchStatus::Ok();
  int blocks[4] = {0, 0, 0, 0};
  LaunchStatus st = WgmmaPrefillBlocksPerSm<T, float, D, false>(&blocks[0]);
  if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, T, D, false>(&blocks[1]);
  if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, float, D, true>(&blocks[2]);
  if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, T, D, true>(&blocks[3]);
  if (!st.ok()) return st;
  *blocks_per_sm = std::min({blocks[0], blocks[1], blocks[2], blocks[3]});
  return LaunchStatus::Ok();
}

#define PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(T, D)                                         \
  template LaunchStatus LaunchPrefillTilesWgmma<T, float, D>(const PagedAttentionParams&, \
                                                             cudaStream_t, Launcher&);    \
  template LaunchStatus LaunchPrefillTilesWgmma<T, T, D>(const PagedAttentionParams&,     \
                                                         cudaStream_t, Launcher&);        \
  template LaunchStatus PrefillWgmmaOccupancy<T, D>(int*);

}  // namespace pagedattn::kernels
