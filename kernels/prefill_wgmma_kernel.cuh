// The Hopper prefill tile kernel: the prefill tile of kernels/prefill_mma_kernel.cuh with its
// two matrix products on warpgroup MMA (wgmma, sm_90a). Included by instantiate_hdim*.cu (and
// by the bench's profile check and the copy-layout test).
//
// A job is one prefill work item (kPrefillTileRows = 128 query rows) of one kv head, computed by
// two warpgroups of 64 rows each. K/V tiles (64 or 128 positions) are gathered through the page
// table with 16-byte cp.async (row-wise, so any page size works), or in the persistent blocks as
// TMA boxes (page sizes a multiple of 8, no window: PrefillTmaBoxRows), into shared memory laid
// out in the 128-byte-swizzle format that wgmma reads directly: each 64-column slice of a
// [rows][D] tile is its own [rows][64] block of 128-byte rows, 16-byte chunk c of row r stored at
// chunk c ^ (r % 8).
//
// At every head_dim but 64 (80 and 96 in 128's layout: WgmmaPrefillConfig::kWidth) a block is
// persistent and warp-specialized (FlashAttention-3's recipe, on paged K/V): it runs the jobs
// the host dealt it (SchedulePrefillJobs) back to back; a third, producer warpgroup streams
// their K/V tiles through the stages (mbarriers: a stage's K, its V, its release), so the next
// job's first tiles load while the last one ends; the two consumer warpgroups only compute, with
// the registers the producer gave up (setmaxnreg), and take turns on the tensor cores (named
// barriers): one's softmax runs while the other's matrix products do. At 64 a block runs one
// job, every thread copying and computing, a block barrier a tile.
// Per tile and warpgroup:
//   S = Q.K^T:  wgmma m64nTk16 (T = kTileKv: n128 at width 128, n64 at 64, 192 and 256), A = Q
//               and B = K from shared memory (both K-major), D/16 steps;
//   online softmax in registers (exp2, scale folded into an FMA), masks only where needed;
//   O += P.V:   wgmma m64nWk16, A = P from registers (the S accumulator layout re-packed),
//               B = V from shared memory (MN-major: the transpose bit), one wgmma over all of
//               its 64-column slices (W = kWidth; at 64 one n64).
// Accumulators stay in the mma.sync fragment layout, so the output and split-KV code is shared
// with the portable kernels (WriteTileRow, MergeIfLastSplit).
//
// Device code exists only when compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); the host picks
// this kernel only when the build has sm_90a (PAGEDATTN_HAVE_SM90A) and the device is 9.0.
#pragma once

#include <algorithm>
#include <type_traits>

#include "kernels/device/mbarrier.cuh"
#include "kernels/device/profile.cuh"
#include "kernels/device/ptx.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/device/wgmma.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"
#include "kernels/tensor_map.h"

namespace pagedattn::kernels {

// KvCopyLayout's fields for copies that take a [rows][D] tile one 64-column slice at a time: a
// thread copies chunk tid % 8 of rows tid / 8 + i * kRowStep in each of the kSlices slices.
template <int D, int kThreads, int kTileKv>
struct SliceCopyLayout {
  static constexpr int kSlots = 8;  // a slice's 16-byte chunks
  static constexpr int kSlices = D / 64;
  static constexpr int kRowStep = kThreads / kSlots;
  static constexpr int kRowsPerThread = kTileKv / kRowStep;
  static_assert(D % 64 == 0 && kTileKv % kRowStep == 0, "whole slices, copies divide evenly");
};
// The slices a copy layout takes one at a time (KvCopyLayout: one, the whole row).
template <typename Copy>
__host__ __device__ constexpr int CopySlices() {
  if constexpr (requires { Copy::kSlices; }) {
    return Copy::kSlices;
  } else {
    return 1;
  }
}
// Copy i of slice sl of a thread of layout Copy into a [kTileKv][D] tile in Sw128Offset's
// layout: its element offset from the thread's first copy (the thread's rows share a swizzle
// phase, so each address is the first plus a constant), and the column of the pool row it
// reads, for the thread's 16-byte chunk copy_chunk (tid % kSlots; its first row tid / kSlots).
template <int kTileKv, typename Copy>
__host__ __device__ constexpr int TileCopyStep(int sl, int i) {
  return (sl * kTileKv + i * Copy::kRowStep) * 64;
}
__host__ __device__ constexpr int TileCopyColumn(int copy_chunk, int sl) {
  return sl * 64 + copy_chunk * 8;
}
// Where the TMA box of rows box * box_rows.. and columns slice * 64.. of a [kTileKv][D] tile
// lands (element offset): TMA's 128-byte swizzle, which XORs an address's 16-byte chunk bits with
// its 128-byte row bits, puts each of its rows and chunks where Sw128Offset does, the box starting
// on a 1024-byte swizzle atom.
template <int kTileKv>
__host__ __device__ constexpr int TmaBoxOffset(int slice, int box, int box_rows) {
  return (slice * kTileKv + box * box_rows) * 64;
}

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
  // Tile shape per width: 128 128 positions x 3 stages; 64 64 x 5 in one block a job, two an SM
  // (its products are too small to hide the softmax behind across warpgroups: persistent and
  // warp-specialized, 1.0-1.14x the time; five stages and one barrier a tile, 0.87-0.90x four
  // stages and two), pipelined within each warpgroup; 192 64 x 3 and 256 64 x 2, what their 48
  // and 64 KiB Q tiles leave room for (docs/PERFORMANCE.md#design-decisions).
  static constexpr int kTileKv = kWidth == 128 ? 128 : 64;
  static constexpr int kStages = kWidth == 128 || kWidth == 192 ? 3 : (kWidth == 64 ? 5 : 2);
  // Pipelined across warpgroups: S of tile j + 1 overlaps P.V of tile j, and the consumer
  // warpgroups take turns (WgmmaPrefillWsBody); head_dim 64's item body pipelines within each.
  static constexpr bool kPipelined = kWidth != 64;
  // Pipelined tiles run in persistent blocks (WgmmaPrefillWsBody), jobs back to back so
  // the next job's first K/V tiles load during the last one's end; head_dim 64's one block per
  // item and kv head (WgmmaPrefillItemBody).
  static constexpr bool kPersistent = kPipelined;
  static constexpr int kSlices = kWidth / 64;                // 64-column slices (swizzle blocks)
  // Persistent blocks are warp-specialized: the kThreads consumer threads above, then a producer
  // warpgroup, whose registers (setmaxnreg) go to the consumers.
  static constexpr int kProducerThreads = 128;
  static constexpr int kLaunchThreads = kPersistent ? kThreads + kProducerThreads : kThreads;
  // Blocks an SM must hold: one persistent block; two of head_dim 64's (registers <= 128), whose
  // tiles overlap only across blocks.
  static constexpr int kMinBlocks = kPersistent ? 1 : 2;
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static_assert(kProducerRegs * kProducerThreads + kConsumerRegs * kThreads <= 65536,
                "one SM's register file");
  using Copy = KvCopyLayout<D, kThreads, kTileKv>;
  // The producer's: a row's chunks over its threads where that keeps each thread's rows in one
  // swizzle phase (row steps of 8), else (192, 256) one 64-column slice's 8 chunks at a time.
  using ProducerCopy =
      std::conditional_t<KvCopyLayout<D, kProducerThreads, kTileKv>::kRowStep % 8 == 0,
                         KvCopyLayout<D, kProducerThreads, kTileKv>,
                         SliceCopyLayout<D, kProducerThreads, kTileKv>>;
  static constexpr int kChunks = Copy::kChunks;                // 16-byte chunks per row
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

// The rows of the TMA boxes the warp-specialized producer moves K/V in, or 0 for its cp.async
// copies: the page size's largest power-of-two factor, at most a tile and at least 8 rows (a
// swizzle atom), so page sizes that are multiples of 8, in layers without a window (a window's
// ranges start anywhere: their boxes would straddle pages, gathered row by row). TMA took
// 0.83-0.96x the time of the producer's cp.async at the default shapes
// (docs/PERFORMANCE.md#design-decisions).
constexpr int PrefillTmaBoxRows(int page_size, int window, int tile_kv) {
  const int rows = std::min(page_size & -page_size, tile_kv);
  return page_size > 0 && window == 0 && rows >= kTmaMinBoxRows ? rows : 0;
}

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

  // The copies of one K or V tile into tile memory dst (16-byte cp.async, swizzle-128 layout):
  // this thread's chunk copy_chunk of rows copy_row0 + i * kRowStep (Copy's layout), from the
  // pool rows `bases` (LoadRowBases; -1: zero-filled). The rows' swizzle (row % 8) is the same
  // for all of them, so each copy costs an address and the copy: no shared-memory load, no
  // swizzle arithmetic.
  template <typename Copy>
  __device__ __forceinline__ static void LoadRowBases(int32_t (&bases)[Copy::kRowsPerThread],
                                                      const int32_t (&rows)[Cfg::kTileKv],
                                                      int copy_row0) {
#pragma unroll
    for (int i = 0; i < Copy::kRowsPerThread; ++i) bases[i] = rows[copy_row0 + i * Copy::kRowStep];
  }
  template <typename Copy>
  __device__ __forceinline__ static void IssueTileRows(
      T* dst, const int32_t (&bases)[Copy::kRowsPerThread], const T* cache, int copy_chunk,
      int copy_row0) {
    static_assert(Copy::kRowStep % 8 == 0, "every row of a thread's in the same swizzle phase");
    constexpr int kSlices = CopySlices<Copy>();
    if (kSlices == 1 && copy_chunk >= Cfg::kChunks) return;  // past the row (80, 96)
    const uint32_t dst0 = SmemAddr(dst + Sw128Offset<Cfg::kTileKv>(copy_row0, copy_chunk));
    const char* src0 = reinterpret_cast<const char*>(cache + TileCopyColumn(copy_chunk, 0));
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
      for (int i = 0; i < Copy::kRowsPerThread; ++i) {
        CpAsync16Or0(dst0 + TileCopyStep<Cfg::kTileKv, Copy>(sl, i) * sizeof(T),
                     src0 + (TileCopyColumn(0, sl) + int64_t{max(bases[i], 0)} * D) * sizeof(T),
                     bases[i] >= 0);
      }
  }

  // Copies one K/V tile into stage `stage`, with the block's threads (Cfg::Copy).
  __device__ __forceinline__ static void IssueKvTile(T* smem_kv,
                                                     const int32_t (&rows)[Cfg::kTileKv], int stage,
                                                     const T* k_cache, const T* v_cache,
                                                     int copy_chunk, int copy_row0) {
    using Copy = typename Cfg::Copy;
    T* sk = smem_kv + stage * Cfg::kStageElems;
    int32_t bases[Copy::kRowsPerThread];
    LoadRowBases<Copy>(bases, rows, copy_row0);
    IssueTileRows<Copy>(sk, bases, k_cache, copy_chunk, copy_row0);
    IssueTileRows<Copy>(sk + Cfg::kTileElems, bases, v_cache, copy_chunk, copy_row0);
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

  // The Q tile of an item and kv head -> shared memory as T, from q in TIO, by the block.
  template <typename TIO>
  __device__ __forceinline__ static void LoadQ(const PagedAttentionParams& p,
                                               const AttentionWorkItem& item, int kv_head,
                                               int group, T* smem_q, float q_scale) {
    LoadQTile<T, TIO, D, Cfg::kRows, Cfg::kThreads>(
        p, item, item.span_info, kv_head, group, item.span_info.num_queries * group, smem_q,
        [](int r, int chunk) { return Sw128Offset<Cfg::kRows>(r, chunk); }, threadIdx.x,
        q_scale);
  }
  // Warpgroup wg's 64 rows of it, by that warpgroup's threads (wg_tid: 0..127).
  template <typename TIO>
  __device__ __forceinline__ static void LoadGroupQ(const PagedAttentionParams& p,
                                                    const AttentionWorkItem& item, int kv_head,
                                                    int group, T* smem_q, int wg, int wg_tid,
                                                    float q_scale) {
    AttentionWorkItem rows = item;
    rows.row_start += wg * Cfg::kGroupRows;
    LoadQTile<T, TIO, D, Cfg::kGroupRows, 128>(
        p, rows, item.span_info, kv_head, group, item.span_info.num_queries * group, smem_q,
        [wg](int r, int chunk) { return Sw128Offset<Cfg::kRows>(wg * Cfg::kGroupRows + r, chunk); },
        wg_tid, q_scale);
  }
  // LoadGroupQ as copies in flight (cp.async; rows past the span zero-filled), for q in T with
  // no scale: issued as the warpgroup's last P.V of the job before starts, so that they land
  // while it runs. FinishGroupQ waits for them and bounds the rows in place (AttentionChunk: the
  // finite scores the tile relies on).
  static constexpr int kGroupQChunks = Cfg::kGroupRows * (D / 8) / 128;  // a thread's
  __device__ __forceinline__ static void IssueGroupQ(const PagedAttentionParams& p,
                                                     const AttentionWorkItem& item, int kv_head,
                                                     int group, T* smem_q, int wg, int wg_tid) {
    const int span_rows = item.span_info.num_queries * group;
#pragma unroll
    for (int i = 0; i < kGroupQChunks; ++i) {
      const int c = wg_tid + i * 128, r = c / (D / 8), chunk = c % (D / 8);
      const int span_row = item.row_start + wg * Cfg::kGroupRows + r;
      const bool valid = span_row < span_rows;
      CpAsync16Or0(SmemAddr(smem_q + Sw128Offset<Cfg::kRows>(wg * Cfg::kGroupRows + r, chunk)),
                   QChunk<T, D>(p, item.span_info, kv_head, group, valid ? span_row : 0, chunk),
                   valid);
    }
    CpAsyncCommit();
  }
  __device__ __forceinline__ static void FinishGroupQ(T* smem_q, int wg, int wg_tid) {
    CpAsyncWait<0>();
#pragma unroll
    for (int i = 0; i < kGroupQChunks; ++i) {
      const int c = wg_tid + i * 128;
      uint4* q = reinterpret_cast<uint4*>(
          smem_q + Sw128Offset<Cfg::kRows>(wg * Cfg::kGroupRows + c / (D / 8), c % (D / 8)));
      *q = AttentionChunk<T>(*q);
    }
  }

  // Descriptors (Sw128Desc) of the Q rows, and of stage 0's K and V tiles; a stage's and a k
  // step's are these plus a constant (Sw128DescPlus). V's leading field: the bytes between its
  // 64-column slices, which one wgmma spans.
  static constexpr uint32_t kStageBytes = Cfg::kStageElems * sizeof(T);
  static constexpr uint32_t kVLeading = Cfg::kWidth > 64 ? Cfg::kTileKv * kRowBytes : 1024;
  __device__ __forceinline__ static uint64_t StageDesc(uint64_t k_desc0, int stage) {
    return Sw128DescPlus(k_desc0, stage * kStageBytes);
  }

  // S = Q K^T of one tile (this warpgroup's Q rows at q_desc, the K tile at k_desc): D/16 k
  // steps; issued, not waited for.
  __device__ __forceinline__ static void IssueS(float (&s)[kNT][4], uint64_t q_desc,
                                                uint64_t k_desc) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t slice = kk >> 2, k_in = (kk & 3) * 32;
      WgmmaSS<T>(s, Sw128DescPlus(q_desc, slice * Cfg::kRows * kRowBytes + k_in),
                 Sw128DescPlus(k_desc, slice * Cfg::kTileKv * kRowBytes + k_in), kk > 0);
    }
  }

  // O += P V of one tile (the V tile at v_desc, leading field kVLeading): per 16-position k
  // step, one wgmma over all of V's 64-column slices (at width 64, its one n64).
  __device__ __forceinline__ static void IssuePV(float (&o)[kOT][4], const uint32_t (&pa)[kKP][4],
                                                 uint64_t v_desc) {
#pragma unroll
    for (int kp = 0; kp < kKP; ++kp) {
      if constexpr (Cfg::kWidth > 64) {
        // One wgmma over every slice (m64n128 at head_dim 128: 2% faster than two n64's,
        // docs/PERFORMANCE.md#design-decisions).
        WgmmaRS<T>(o, pa[kp], Sw128DescPlus(v_desc, kp * 16 * kRowBytes));
      } else {
#pragma unroll
        for (int sl = 0; sl < Cfg::kSlices; ++sl)
          WgmmaRS<T>(*reinterpret_cast<float(*)[8][4]>(&o[sl * 8]), pa[kp],
                     Sw128DescPlus(v_desc, sl * Cfg::kTileKv * kRowBytes + kp * 16 * kRowBytes));
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
    MaskScores(s, pos0, kv_end, rows, quad_col, softcap);
    ExpOfMasked(s, softcap, scale_log2, row_max, row_sum, alpha);
  }

  // The soft-cap and the masks of SoftmaxExp.
  __device__ __forceinline__ static void MaskScores(float (&s)[kNT][4], int pos0, int kv_end,
                                                    const Rows& rows, int quad_col,
                                                    const Softcap& softcap) {
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
  }

  // The rest of SoftmaxExp, on masked scores.
  __device__ __forceinline__ static void ExpOfMasked(float (&s)[kNT][4], const Softcap& softcap,
                                                     float scale_log2, float (&row_max)[2],
                                                     float (&row_sum)[2], float (&alpha)[2]) {
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
    // The thread's max of each row, as a tree too. The base is lazy (kRescaleSlack): raised,
    // to the row's max across its quad, only when some row of the warp has a score that far
    // above it, so most tiles skip the shuffles and O's rescale.
    float mx[2];
    bool raise = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float part[kNT];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) part[nt] = fmaxf(s[nt][2 * i], s[nt][2 * i + 1]);
#pragma unroll
      for (int level = 1; level < kNT; level *= 2)  // kNT is a power of two
#pragma unroll
        for (int nt = 0; nt < kNT; nt += 2 * level) part[nt] = fmaxf(part[nt], part[nt + level]);
      mx[i] = part[0];
      const float base = row_max[i] == -INFINITY ? -INFINITY : SoftmaxBase(row_max[i], scale_log2);
      raise = raise || mx[i] * scale_log2 > base + kRescaleSlack;
    }
    alpha[0] = alpha[1] = 1.f;
    if (__any_sync(0xffffffffu, raise)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float m = fmaxf(row_max[i], mx[i]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        alpha[i] = FastExp2(SoftmaxExponent(row_max[i], scale_log2, SoftmaxBase(m, scale_log2)));
        row_max[i] = m;
        row_sum[i] *= alpha[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
      row_sum[i] += ExpRowSum(s, i, scale_log2, SoftmaxBase(row_max[i], scale_log2));
  }

  // The softmax of a tile after a row's first, on masked scores, without their maxima (70 of a
  // warp's 489 instructions a tile): each weight taken against its row's base as it stands, and
  // their sums tested instead. Under kBaseSumLimit every weight of the thread's is too (within the
  // P operand's range, float16's included): the tile is done and O not rescaled. Over it (a row
  // whose scores rose far past its base, rare after a row's first tiles) the scores are gone:
  // returns false, and the caller recomputes them (RecomputeS) for ExpOfMasked. A warp with a
  // row that has no base yet goes to ExpOfMasked at once (docs/PERFORMANCE.md#design-decisions).
  static constexpr float kBaseSumLimit = 32768.f;  // 2^15
  __device__ __forceinline__ static bool ExpOnBase(float (&s)[kNT][4], const Softcap& softcap,
                                                   float scale_log2, float (&row_max)[2],
                                                   float (&row_sum)[2], float (&alpha)[2]) {
    if (!__all_sync(0xffffffffu, row_max[0] != -INFINITY && row_max[1] != -INFINITY)) {
      ExpOfMasked(s, softcap, scale_log2, row_max, row_sum, alpha);
      return true;
    }
    float sum[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      sum[i] = ExpRowSum(s, i, scale_log2, SoftmaxBase(row_max[i], scale_log2));
    }
    // A weight past float's range makes its sum inf, which fails the test too.
    if (!__all_sync(0xffffffffu, sum[0] <= kBaseSumLimit && sum[1] <= kBaseSumLimit)) return false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_sum[i] += sum[i];
      alpha[i] = 1.f;
    }
    return true;
  }

  // S of one tile for this warp's 16 rows alone (mma.sync, ldmatrix from the swizzled tiles):
  // the rare way back for ExpOnBase. q_row0: the warp's first row in the Q tile q; k: the K tile.
  __device__ __forceinline__ static void RecomputeS(float (&s)[kNT][4], const T* q, int q_row0,
                                                    const T* k, int lane) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll 1
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      LdMatrixX4(a, SmemAddr(q + Sw128Offset<Cfg::kRows>(q_row0 + (lane & 15),
                                                         2 * kk + (lane >> 4))));
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t b[4];
        const int r = 16 * np + (lane & 7) + 8 * (lane >> 4);
        LdMatrixX4(b, SmemAddr(k + Sw128Offset<Cfg::kTileKv>(r, 2 * kk + ((lane >> 3) & 1))));
        Mma16816<T>(s[2 * np], a, b[0], b[1]);
        Mma16816<T>(s[2 * np + 1], a, b[2], b[3]);
      }
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
  static_assert(!Cfg::kPipelined, "the pipelined tile runs in the warp-specialized body");
  static_assert(Cfg::kStages >= 3, "tile + 1 landed while tile + kS - 1 is issued");
  constexpr int kNT = M::kNT, kKP = M::kKP, kS = Cfg::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const typename M::Smem smem = M::SmemOf(smem_raw);
  T* smem_kv = smem.kv;

  // Items run in the planner's order (by span, longest first), a group of kv heads at a time
  // (PrefillJobAt); the group's kv heads of one item run side by side.
  const ItemMajorBlock block = PrefillJobAt(p, blockIdx.x);
#define PAGEDATTN_JOB_STAMP(event) \
  PAGEDATTN_STAMP(p, profile::SlotOf(profile::kPrefillJobs, blockIdx.x), profile::event)
  PAGEDATTN_JOB_STAMP(kTileEntry);
  const int kv_head = block.kv_head;
  const AttentionWorkItem item = p.prefill_items[block.item];
  const AttentionSpan span = item.span_info;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_rows = span.num_queries * group;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int wg = WarpUniform(warp >> 2), wg_warp = warp & 3;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  // ---- K/V pipeline: tile t is issued kS - 1 tiles ahead, into stage t % kS, by all threads,
  // each copying 16-byte chunk copy_chunk of kRowsPerThread rows (swizzle-128 layout). The
  // pool row of each position's K/V goes through shared memory, one slot per stage,
  // computed kS tiles ahead by the thread of that position (page-table load, page division):
  // a copy then costs one shared load and two adds.
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int copy_chunk = tid % Cfg::Copy::kSlots, copy_row0 = tid / Cfg::Copy::kSlots;
  const int num_tiles =
      WarpUniform((item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv);
  const int32_t* pages = p.page_table + span.page_table_offset;
  // Row indices (row = (page * kv_heads + kv_head) * page_size + in_page, D elements each) fit
  // in 31 bits: 2^31 rows of at least 128 bytes exceed any GPU's memory.
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

  // ---- Q tile -> shared memory as T (once per block), while the first copies fly; a soft-cap's
  // sm_scale / cap in it where the fixed base serves (Softcap::ScaleQ).
  Softcap softcap = kVariant ? Softcap::Of(p) : Softcap::None(p);
  M::template LoadQ<TIO>(p, item, kv_head, group, smem.q, softcap.template ScaleQ<T>());

  // ---- Per-thread state: rows quad_row and quad_row + 8 of this warp's 16 in its warpgroup's
  // 64; columns 2*quad_col..+1 of every 8-wide n tile (the mma.sync accumulator layout).
  float o[M::kOT][4], row_max[2], row_sum[2];
  M::StartRows(o, row_max, row_sum);
  const typename M::Rows rows =
      M::template RowsOf<kVariant>(p, item, group, num_tiles, wg, wg_warp, quad_row);
  const int wg_tiles = WarpUniform(rows.wg_tiles);
  const float scale_log2 = softcap.scale_log2;  // the scores' unit (capped: cap's)
  const uint64_t q_desc = Sw128Desc(smem.q_rows(wg));
  const uint64_t k_desc0 = Sw128Desc(smem.k_addr(0));
  const uint64_t v_desc0 = Sw128Desc(smem.v_addr(0), M::kVLeading);
  auto issue_s = [&](float(&s)[kNT][4], int tile) {
    M::IssueS(s, q_desc, M::StageDesc(k_desc0, tile % kS));
  };
  auto issue_pv = [&](const uint32_t(&pa)[kKP][4], int tile) {
    M::IssuePV(o, pa, M::StageDesc(v_desc0, tile % kS));
  };
  auto softmax_exp = [&](float(&s)[kNT][4], int tile, float(&alpha)[2]) {
    M::SoftmaxExp(s, item.kv_start + tile * Cfg::kTileKv, item.kv_end, rows, quad_col, softcap,
                  scale_log2, row_max, row_sum, alpha);
  };
  auto fence_o = [&]() { FenceRegs(o); };

  __shared__ float2 pin_slot;  // PinBeforeWait's (never written)
  const uint32_t pin = SmemAddr(&pin_slot);
  // The weights of a plain layer's tile on the rows' bases as they stand (ExpOnBase; its stage
  // stays until the next barrier, for RecomputeS), or a variant's on its rows' maxima.
  auto exponentials = [&](float(&s)[kNT][4], int tile, float(&alpha)[2]) {
    if constexpr (kVariant) {
      softmax_exp(s, tile, alpha);
    } else {
      const int pos0 = item.kv_start + tile * Cfg::kTileKv;
      M::MaskScores(s, pos0, item.kv_end, rows, quad_col, softcap);
      if (!M::ExpOnBase(s, softcap, scale_log2, row_max, row_sum, alpha)) {
        M::RecomputeS(s, smem.q, wg * Cfg::kGroupRows + wg_warp * 16,
                      smem_kv + (tile % kS) * Cfg::kStageElems, lane);
        M::MaskScores(s, pos0, item.kv_end, rows, quad_col, softcap);
        M::ExpOfMasked(s, softcap, scale_log2, row_max, row_sum, alpha);
      }
    }
  };

  // ---- S of the first tile.
  uint32_t pa[kKP][4];
  CpAsyncWait<kS - 2>();  // tile 0's copies
  ProxyFenceShared();
  __syncthreads();
  PAGEDATTN_JOB_STAMP(kFirstTileLanded);
  if (wg_tiles > 0) {
    float s[kNT][4];
    WgmmaFence();
    issue_s(s, 0);
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegs(s);
    float alpha[2];
    exponentials(s, 0, alpha);  // O is still zero: no rescale
    M::PackP(s, pa);
  }

  // ---- Main loop, software-pipelined within the warpgroup (as the warp-specialized body's):
  // S of tile + 1 and P.V of tile issued together, the exponentials of tile + 1 while P.V is in
  // flight; one barrier a tile. Past it, tile + kS - 1 is issued into the stage of tile - 1,
  // whose P.V the last iteration waited. Warpgroup-uniform branches, each issuing and waiting
  // for its own wgmma's (ptxas serializes wgmma's whose groups stay open across a branch).
#pragma unroll 1
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int32_t next_id = load_page_id(tile + kS);
    CpAsyncWait<kS - 3>();  // tile + 1's copies (issued up to tile + kS - 2)
    ProxyFenceShared();     // this thread's cp.async and Q stores, visible to wgmma
    // Every thread's copies of tile + 1 have landed and every warp is done with tile - 1.
    __syncthreads();
    if (tile + kS - 1 < num_tiles) issue_tile(tile + kS - 1);
    CpAsyncCommit();
    if (tile + 1 < wg_tiles) {
      float s[kNT][4];
      fence_o();
      M::FenceP(pa);
      WgmmaFence();
      issue_s(s, tile + 1);
      WgmmaCommit();
      issue_pv(pa, tile);
      WgmmaCommit();
      WgmmaWait<1>();  // S of tile + 1; P.V of tile may still run
      FenceRegs(s);
      float alpha[2];
      exponentials(s, tile + 1, alpha);
      PinBeforeWait(pin, row_sum);  // the exponentials above the wait (see the ws body)
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
      WgmmaWait<0>();
      fence_o();
      M::FenceP(pa);
    }
    store_row_base(tile + kS, next_id);  // read after the next iteration's barrier
  }
  CpAsyncWait<0>();
  PAGEDATTN_JOB_STAMP(kLastTileDone);

  // ---- Normalize and write.
  M::template WriteRows<TIO>(p, item, span, kv_head, group, span_rows,
                             wg * Cfg::kGroupRows + wg_warp * 16 + quad_row, quad_col, o, row_max,
                             row_sum, scale_log2);

  MergeIfLastSplit<TIO, D, kTwoPassMerge>(p, item, span, kv_head, group);
  PAGEDATTN_JOB_STAMP(kTileExit);
#undef PAGEDATTN_JOB_STAMP
}

// Named barriers of the warp-specialized body (0 is __syncthreads', kMergeBarrier the merge's).
inline constexpr int kProducerBarrier = 1;  // the producer warpgroup, a tile's row indices
inline constexpr int kTurnBarrier = 2;      // + wg: consumer warpgroup wg's turn to issue
inline constexpr int kQBarrier = 4;         // + wg: consumer warpgroup wg's Q rows stored

// The producer warps that move one operand's (K's, V's) boxes: warp `part` of them box i
// where i % kTmaWarpsPerOperand == part. One warp an operand took 1.01-1.10x the time of two
// at the default shapes, 1.12x at head_dim 256 (docs/PERFORMANCE.md#design-decisions).
inline constexpr int kTmaWarpsPerOperand = 2;

// The producer of WgmmaPrefillWsBody where the launcher made the pools' tensor maps
// (p.kv_box_rows > 0): warps 0 and 1 move each stream tile's K, warps 2 and 3 its V, as TMA
// boxes of kv_box_rows rows (the page size's largest power-of-two factor, at most a tile) x 64
// columns, each box issued by its warp's lane 0 (a TMA's operands are warp-uniform: boxes of
// each lane's own would be issued one lane at a time). A box wholly past the job's range is one
// before row 0, which TMA fills with zeros; a box that the range's end cuts is read whole from
// its page, its rows past the end finite (the pool's rows always are: zeroed at allocation,
// written as AttentionValue) and masked; a box that a page boundary cuts (a range that starts
// inside one) is gathered by cp.async, row by row. A stage's full barrier completes on the
// first warp's expected bytes and the two warps' 64 cp.async arrivals.
template <typename T, int D>
__device__ __forceinline__ void ProduceKvTma(const PagedAttentionParams& p, T* smem_kv,
                                             uint64_t* full, uint64_t* empty, int job_begin,
                                             int job_end, int kv, int part, int lane) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  constexpr int kS = Cfg::kStages, kTileKv = Cfg::kTileKv;
  constexpr int kRowChunks = Cfg::kSlices * 8;  // 16-byte chunks of a tile row
  const int box_rows = p.kv_box_rows, groups = kTileKv / box_rows;
  const uint32_t box_bytes = box_rows * 64 * sizeof(T);
  const T* cache = static_cast<const T*>(kv == 0 ? p.k_cache : p.v_cache);
  const void* map = kv == 0 ? p.kv_maps.k : p.kv_maps.v;
  int g = 0;
#pragma unroll 1
  for (int j = job_begin; j < job_end; ++j) {
    const AttentionWorkItem& item = p.prefill_jobs[j].item;
    const int kv_head = p.prefill_jobs[j].kv_head, kv_end = item.kv_end;
    const int32_t* pages = p.page_table + item.span_info.page_table_offset;
    auto pool_row = [&](int pos) {
      const uint32_t page = p.page_div.Div(pos);
      return (pages[page] * p.num_kv_heads + kv_head) * p.page_size +
             (pos - static_cast<int32_t>(page) * p.page_size);
    };
    const int num_tiles = (kv_end - item.kv_start + kTileKv - 1) / kTileKv;
#pragma unroll 1
    for (int t = 0; t < num_tiles; ++t, ++g) {
      const int stage = g % kS;
      const int pos0 = item.kv_start + t * kTileKv;
      // Lane i < groups: box i's first pool row (-box_rows past the range), or gathered.
      int32_t row = -box_rows;
      bool gather = false;
      if (lane < groups) {
        const int pos = pos0 + lane * box_rows;
        if (pos < kv_end) {
          const int in_page = pos - static_cast<int32_t>(p.page_div.Div(pos)) * p.page_size;
          gather = in_page + box_rows > p.page_size;
          if (!gather) row = pool_row(pos);
        }
      }
      const uint32_t gathered = __ballot_sync(~0u, gather);
      const uint32_t tile_addr =
          SmemAddr(smem_kv + stage * Cfg::kStageElems + kv * Cfg::kTileElems);
      MbarWait(&empty[stage], ((g / kS) & 1) ^ 1);
      if (part == 0 && lane == 0) {
        MbarArriveExpectTx(&full[stage],
                           (groups - __popc(gathered)) * Cfg::kSlices * box_bytes);
      }
#pragma unroll 1
      for (int i = part; i < groups; i += kTmaWarpsPerOperand) {
        const int32_t box_row = __shfl_sync(~0u, row, i);
        if (lane == 0 && !((gathered >> i) & 1)) {
#pragma unroll
          for (int slice = 0; slice < Cfg::kSlices; ++slice) {
            TmaLoad2d(tile_addr + TmaBoxOffset<kTileKv>(slice, i, box_rows) * sizeof(T), map,
                      slice * 64, box_row, &full[stage]);
          }
        }
      }
      static_assert(kTmaWarpsPerOperand == 2, "the mask below: every other box");
#pragma unroll 1
      for (uint32_t left = gathered & (part == 0 ? 0x55555555u : 0xAAAAAAAAu); left != 0;
           left &= left - 1) {
        const int r0 = (__ffs(left) - 1) * box_rows;
#pragma unroll 1
        for (int c = lane; c < box_rows * kRowChunks; c += 32) {
          const int r = r0 + c / kRowChunks, chunk = c % kRowChunks;
          if (chunk >= Cfg::kChunks) continue;  // past D (80, 96): zeros since the start
          const int pos = pos0 + r;
          const bool valid = pos < kv_end;
          const int64_t src_row = valid ? pool_row(pos) : 0;
          CpAsync16Or0(tile_addr + Sw128Offset<kTileKv>(r, chunk) * sizeof(T),
                       cache + src_row * D + chunk * 8, valid);
        }
      }
      CpAsyncMbarArrive(&full[stage]);
    }
  }
  CpAsyncCommit();  // the gathers above are in no group until now: wait for all of them
  CpAsyncWait<0>();
}

// The producer of WgmmaPrefillWsBody where K/V go by cp.async (page sizes that are not multiples
// of 8, windowed layers): for each stream tile, its kTileKv positions' pool rows (thread ptid <
// kTileKv computes position ptid's: page-table load, page division, one tile ahead of its copies)
// go through shared memory, then each thread copies its chunk of kRowsPerThread rows of K, then
// of V, each followed by an arrival that lands with its copies. Row indices
// (row = (page * kv_heads + kv_head) * page_size + in_page) fit in 31 bits: 2^31 rows of at
// least 128 bytes exceed any GPU's memory.
template <typename T, int D>
__device__ __forceinline__ void ProduceKvCpAsync(const PagedAttentionParams& p, T* smem_kv,
                                                 uint64_t* full_k, uint64_t* full_v,
                                                 uint64_t* empty_k, uint64_t* empty_v,
                                                 int job_begin, int job_end, int ptid) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  using M = WgmmaTileMath<T, D>;
  constexpr int kS = Cfg::kStages;
  auto tiles_of = [](const AttentionWorkItem& item) {
    return (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  };
  using Copy = typename Cfg::ProducerCopy;
  const int copy_chunk = ptid % Copy::kSlots, copy_row0 = ptid / Copy::kSlots;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  __shared__ int32_t row_base[kS][Cfg::kTileKv];  // -1: past the job's range
  // The tile whose rows load next: thread ptid's position in it, its job's range and pages.
  struct Cursor {
    int job, pos, end, tiles_left, kv_head;
    const int32_t* pages;
  };
  auto enter = [&](Cursor& c, int j) {
    c.job = j;
    c.pos = 0;
    c.end = INT32_MIN;  // past the last job: no rows
    if (j >= job_end) return;
    const AttentionWorkItem& item = p.prefill_jobs[j].item;
    c.pos = item.kv_start + ptid;
    c.end = item.kv_end;
    c.tiles_left = tiles_of(item);
    c.kv_head = p.prefill_jobs[j].kv_head;
    c.pages = p.page_table + item.span_info.page_table_offset;
  };
  auto load_row = [&](Cursor& c) {
    int32_t row = -1;
    if (ptid < Cfg::kTileKv && c.pos < c.end) {
      const uint32_t page = p.page_div.Div(c.pos);
      row = (c.pages[page] * p.num_kv_heads + c.kv_head) * p.page_size +
            (c.pos - static_cast<int32_t>(page) * p.page_size);
    }
    c.pos += Cfg::kTileKv;
    if (c.end != INT32_MIN && --c.tiles_left == 0) enter(c, c.job + 1);
    return row;
  };
  Cursor ahead;
  enter(ahead, job_begin);
  int32_t row = load_row(ahead);
  int g = 0;
#pragma unroll 1
  for (int j = job_begin; j < job_end; ++j) {
    const int num_tiles = tiles_of(p.prefill_jobs[j].item);
#pragma unroll 1
    for (int t = 0; t < num_tiles; ++t, ++g) {
      const int stage = g % kS;
      const uint32_t free_parity = ((g / kS) & 1) ^ 1;
      const int32_t next_row = load_row(ahead);
      if (ptid < Cfg::kTileKv) row_base[stage][ptid] = row;
      NamedBarrierSync(kProducerBarrier, Cfg::kProducerThreads);
      int32_t bases[Copy::kRowsPerThread];
      M::template LoadRowBases<Copy>(bases, row_base[stage], copy_row0);
      T* sk = smem_kv + stage * Cfg::kStageElems;
      MbarWait(&empty_k[stage], free_parity);
      M::template IssueTileRows<Copy>(sk, bases, k_cache, copy_chunk, copy_row0);
      CpAsyncMbarArrive(&full_k[stage]);
      // V's addresses computed again rather than kept (in registers the producer gave up).
#pragma unroll
      for (int i = 0; i < Copy::kRowsPerThread; ++i) asm volatile("" : "+r"(bases[i]));
      MbarWait(&empty_v[stage], free_parity);
      M::template IssueTileRows<Copy>(sk + Cfg::kTileElems, bases, v_cache, copy_chunk,
                                      copy_row0);
      CpAsyncMbarArrive(&full_v[stage]);
      row = next_row;
    }
  }
  CpAsyncCommit();  // the copies above are in no group until now: wait for all of them
  CpAsyncWait<0>();
}

// The persistent, warp-specialized body (every width but 64). Threads 0..kThreads-1: two
// consumer warpgroups; the last warpgroup: the producer. Both sides walk the block's jobs and
// their tiles in the same order, stream tile g in stage g % kS; per stage four mbarriers:
// full_k and full_v (the producer's 128 threads' copies of K, of V, have landed), empty_k and
// empty_v (the consumers' 8 warps have waited for every wgmma reading K, V): K is released as
// soon as its S is done, so the next K copy starts a P.V earlier. kTmaKv: the producer moves K/V
// as TMA boxes (ProduceKvTma, p.kv_box_rows > 0), else with cp.async. Separate kernels: beside
// the TMA branch, the cp.async producer's 56 registers spilled 148 bytes (20 alone).
template <typename T, typename TIO, int D, bool kVariant, bool kTmaKv>
__device__ __forceinline__ void WgmmaPrefillWsBody(const PagedAttentionParams& p) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  using M = WgmmaTileMath<T, D>;
  static_assert(Cfg::kPipelined, "head_dim 64 runs in the per-item body");
  constexpr int kNT = M::kNT, kKP = M::kKP, kS = Cfg::kStages;
  constexpr int kConsumers = Cfg::kThreads, kConsumerWarps = kConsumers / 32;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const typename M::Smem smem = M::SmemOf(smem_raw);
  __shared__ uint64_t full_k[kS], full_v[kS], empty_k[kS], empty_v[kS];
  const int tid = threadIdx.x;
  if (tid == 0) {
    // Arrivals that complete a full barrier: the TMA producer's two warps (lanes) and its
    // expected bytes, or the cp.async producer's threads.
    const uint32_t producers = kTmaKv ? kTmaWarpsPerOperand * 32 + 1 : Cfg::kProducerThreads;
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      MbarInit(&full_k[s], producers);
      MbarInit(&full_v[s], producers);
      MbarInit(&empty_k[s], kConsumerWarps);
      MbarInit(&empty_v[s], kConsumerWarps);
    }
  }
  if constexpr (Cfg::kWidth > D) {
    if (tid < kConsumers) M::ZeroVPad(smem.kv, tid);
    ProxyFenceShared();  // the zeros, visible to wgmma
  }
  __syncthreads();

  // This block's jobs (item, kv head), in the host's order (SchedulePrefillJobs).
  const int job_begin = p.prefill_job_start[blockIdx.x];
  const int job_end = p.prefill_job_start[blockIdx.x + 1];
  if (job_begin >= job_end) return;
  const int group = p.num_q_heads / p.num_kv_heads;
  auto tiles_of = [](const AttentionWorkItem& item) {
    return (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  };

  if (tid >= kConsumers) {
    // ---- Producer: K/V into the stages, TMA boxes or cp.async.
    LowerRegisters<Cfg::kProducerRegs>();
    const int ptid = tid - kConsumers;
    if constexpr (kTmaKv) {
      static_assert(2 * kTmaWarpsPerOperand * 32 == Cfg::kProducerThreads, "K's warps, V's");
      const int kv = ptid / (32 * kTmaWarpsPerOperand);
      ProduceKvTma<T, D>(p, smem.kv, kv == 0 ? full_k : full_v, kv == 0 ? empty_k : empty_v,
                         job_begin, job_end, kv, ptid / 32 % kTmaWarpsPerOperand, ptid % 32);
    } else {
      ProduceKvCpAsync<T, D>(p, smem.kv, full_k, full_v, empty_k, empty_v, job_begin, job_end,
                             ptid);
    }
    return;
  }

  // ---- Consumers: warpgroup wg computes rows wg * 64.. of each job; the two take turns to
  // issue their wgmma's (warpgroup 0 first), so that one's softmax runs beside the other's
  // matrix products. Each turn is a barrier the warpgroup syncs at and the other arrives at
  // when its own issue is done; both take the same turns (one a job plus one a tile), whatever
  // their rows see.
  RaiseRegisters<Cfg::kConsumerRegs>();
  const int warp = tid >> 5, lane = tid & 31;
  const int wg = WarpUniform(warp >> 2), wg_warp = warp & 3, wg_tid = tid & 127;
  const int quad_row = lane >> 2, quad_col = lane & 3;
  Softcap softcap = kVariant ? Softcap::Of(p) : Softcap::None(p);
  const float q_scale = softcap.template ScaleQ<T>();  // Q carries sm_scale / cap, or 1
  const float scale_log2 = softcap.scale_log2;  // the scores' unit (capped: cap's)
  const uint64_t q_desc = Sw128Desc(smem.q_rows(wg));
  const uint64_t k_desc0 = Sw128Desc(smem.k_addr(0));
  const uint64_t v_desc0 = Sw128Desc(smem.v_addr(0), M::kVLeading);
  __shared__ float2 pin_slot;  // PinBeforeWait's (never written)
  const uint32_t sink = SmemAddr(&pin_slot);
  auto take_turn = [&] { NamedBarrierSync(kTurnBarrier + wg, 2 * 128); };
  auto end_turn = [&] { NamedBarrierArrive(kTurnBarrier + (wg ^ 1), 2 * 128); };
  auto wait_k = [&](int g) { MbarWait(&full_k[g % kS], (g / kS) & 1); };
  auto wait_v = [&](int g) { MbarWait(&full_v[g % kS], (g / kS) & 1); };
  auto release_k = [&](int g) {
    if (lane == 0) MbarArrive(&empty_k[g % kS]);
  };
  auto release_v = [&](int g) {
    if (lane == 0) MbarArrive(&empty_v[g % kS]);
  };
  if (wg == 1) end_turn();

  // q in T and unscaled: a job's Q rows are copied in flight during the last P.V of the job
  // before (IssueGroupQ); q_issued says they were (warpgroup-uniform).
  constexpr bool kQInFlight = std::is_same_v<TIO, T> && !kVariant;
  bool q_issued = false;
  int g0 = 0;  // stream index of the current job's first tile
#pragma unroll 1
  for (int j = job_begin; j < job_end; ++j) {
#define PAGEDATTN_JOB_STAMP(event) \
  PAGEDATTN_STAMP(p, profile::SlotOf(profile::kPrefillJobs, j), profile::event)
    PAGEDATTN_JOB_STAMP(kTileEntry);
    const AttentionWorkItem item = p.prefill_jobs[j].item;
    const int kv_head = p.prefill_jobs[j].kv_head;
    const AttentionSpan& span = item.span_info;
    const int span_rows = span.num_queries * group;
    const int num_tiles = WarpUniform(tiles_of(item));

    // ---- This warpgroup's Q rows -> shared memory (its S of the last job has completed).
    if (kQInFlight && q_issued) {
      M::FinishGroupQ(smem.q, wg, wg_tid);
    } else {
      M::template LoadGroupQ<TIO>(p, item, kv_head, group, smem.q, wg, wg_tid, q_scale);
    }
    q_issued = false;
    ProxyFenceShared();
    NamedBarrierSync(kQBarrier + wg, 128);

    float o[M::kOT][4], row_max[2], row_sum[2];
    M::StartRows(o, row_max, row_sum);
    const typename M::Rows rows =
        M::template RowsOf<kVariant>(p, item, group, num_tiles, wg, wg_warp, quad_row);
    const int wg_tiles = WarpUniform(rows.wg_tiles);
    auto issue_s = [&](float(&s)[kNT][4], int g) {
      M::IssueS(s, q_desc, M::StageDesc(k_desc0, g % kS));
    };
    auto issue_pv = [&](const uint32_t(&pa)[kKP][4], int g) {
      M::IssuePV(o, pa, M::StageDesc(v_desc0, g % kS));
    };
    auto softmax_exp = [&](float(&s)[kNT][4], int tile, float(&alpha)[2]) {
      M::SoftmaxExp(s, item.kv_start + tile * Cfg::kTileKv, item.kv_end, rows, quad_col, softcap,
                    scale_log2, row_max, row_sum, alpha);
    };
    auto fence_o = [&]() { FenceRegs(o); };

    // ---- S of the first tile.
    uint32_t pa[kKP][4];
    wait_k(g0);
    PAGEDATTN_JOB_STAMP(kFirstTileLanded);
    ProxyFenceShared();  // the producer's copies, seen through the async proxy
    take_turn();
    if (wg_tiles > 0) {
      float s[kNT][4];
      WgmmaFence();
      issue_s(s, g0);
      WgmmaCommit();
      end_turn();
      WgmmaWait<0>();
      release_k(g0);
      FenceRegs(s);
      float alpha[2];
      softmax_exp(s, 0, alpha);  // O is still zero: no rescale
      M::PackP(s, pa);
    } else {
      end_turn();
      release_k(g0);
    }

    // ---- Main loop, software-pipelined within the warpgroup as well: S of tile + 1 and P.V of
    // tile are issued together, and the exponentials of tile + 1 run while P.V is in flight.
    // Warpgroup-uniform branches, each one issuing and waiting for its own wgmma's (ptxas
    // serializes wgmma's whose groups stay open across a branch).
#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int g = g0 + tile;
      if (tile + 1 < num_tiles) wait_k(g + 1);
      wait_v(g);
      ProxyFenceShared();
      take_turn();
      if (tile + 1 < wg_tiles) {
        float s[kNT][4];
        fence_o();
        M::FenceP(pa);
        WgmmaFence();
        issue_s(s, g + 1);
        WgmmaCommit();
        issue_pv(pa, g);
        WgmmaCommit();
        end_turn();
        WgmmaWait<1>();  // S of tile + 1; P.V of tile may still run
        float alpha[2];
        if constexpr (kVariant) {
          // A layer with a window or a soft-cap: every tile finds its rows' maxima (ExpOnBase
          // holds K and ran this kernel's soft-capped tile 1.03x slower).
          release_k(g + 1);
          FenceRegs(s);
          softmax_exp(s, tile + 1, alpha);
        } else {
          FenceRegs(s);
          const int pos0 = item.kv_start + (tile + 1) * Cfg::kTileKv;
          M::MaskScores(s, pos0, item.kv_end, rows, quad_col, softcap);
          if (!M::ExpOnBase(s, softcap, scale_log2, row_max, row_sum, alpha)) {
            M::RecomputeS(s, smem.q, wg * Cfg::kGroupRows + wg_warp * 16,
                          smem.kv + ((g + 1) % kS) * Cfg::kStageElems, lane);
            M::MaskScores(s, pos0, item.kv_end, rows, quad_col, softcap);
            M::ExpOfMasked(s, softcap, scale_log2, row_max, row_sum, alpha);
          }
          release_k(g + 1);  // after the scores' last read
        }
        // ptxas schedules the wait below as early as it can, which would put it above the
        // exponentials and end their overlap with the P.V in flight; a shared-memory store
        // of the running sums (which depend on every exponential) pins them above it.
        PinBeforeWait(sink, row_sum);
        WgmmaWait<0>();
        release_v(g);
        fence_o();
        M::FenceP(pa);
        M::RescaleO(o, alpha);
        M::PackP(s, pa);
      } else if (tile < wg_tiles) {
        fence_o();
        M::FenceP(pa);
        WgmmaFence();
        issue_pv(pa, g);
        WgmmaCommit();
        end_turn();
        if constexpr (kQInFlight) {  // every S of this job (and RecomputeS) has read its Q rows
          if (j + 1 < job_end) {
            M::IssueGroupQ(p, p.prefill_jobs[j + 1].item, p.prefill_jobs[j + 1].kv_head, group,
                           smem.q, wg, wg_tid);
            q_issued = true;
          }
        }
        WgmmaWait<0>();
        release_v(g);
        if (tile + 1 < num_tiles) release_k(g + 1);
        fence_o();
        M::FenceP(pa);
      } else {
        end_turn();
        release_v(g);
        if (tile + 1 < num_tiles) release_k(g + 1);
      }
    }
    g0 += num_tiles;
    PAGEDATTN_JOB_STAMP(kLastTileDone);

    // ---- Normalize and write.
    M::template WriteRows<TIO>(p, item, span, kv_head, group, span_rows,
                               wg * Cfg::kGroupRows + wg_warp * 16 + quad_row, quad_col, o, row_max,
                               row_sum, scale_log2);

    MergeIfLastSplit<TIO, D, kTwoPassMerge, kConsumers>(p, item, span, kv_head, group);
    PAGEDATTN_JOB_STAMP(kTileExit);
#undef PAGEDATTN_JOB_STAMP
  }
  // Balances warpgroup 1's first arrival: every arrival at a turn barrier is matched.
  if (wg == 0) take_turn();
}

#endif  // PAGEDATTN_WGMMA_DEVICE

// TIO: q's and out's element type (float, or the cache's T). kVariant: the layer may have a
// sliding window or a soft-cap; a plain layer's kernel compiles their checks out, which makes it
// 0.5-1.5% faster (docs/PERFORMANCE.md#design-decisions). Sinks join rows at the end in both.
// kTmaKv: K/V through TMA boxes (persistent configurations only).
template <typename T, typename TIO, int D, bool kVariant, bool kTmaKv = false>
__global__ void __launch_bounds__(WgmmaPrefillConfig<T, D>::kLaunchThreads,
                                  WgmmaPrefillConfig<T, D>::kMinBlocks)
    PagedPrefillWgmmaKernel(const __grid_constant__ PagedAttentionParams params) {
#if PAGEDATTN_WGMMA_DEVICE
  if constexpr (WgmmaPrefillConfig<T, D>::kPersistent) {
    WgmmaPrefillWsBody<T, TIO, D, kVariant, kTmaKv>(params);
  } else {
    WgmmaPrefillItemBody<T, TIO, D, kVariant>(params);
  }
#else
  __trap();  // never launched: the host picks this kernel only for sm_90a builds on sm_90
#endif
}

// The Hopper prefill kernel's shared-memory limit, raised once per device for the launcher and
// the occupancy query alike.
template <typename T, typename TIO, int D, bool kVariant, bool kTmaKv>
LaunchStatus RaiseWgmmaPrefillSmemLimit() {
  static SmemLimitFlags smem_raised;
  return RaiseSmemLimitOnce(PagedPrefillWgmmaKernel<T, TIO, D, kVariant, kTmaKv>,
                            WgmmaPrefillConfig<T, D>::SmemBytes(), smem_raised,
                            "prefill attention (wgmma)");
}

// The persistent kernels' launch: K/V through TMA where the pages allow and the pools' tensor
// maps could be made, else by cp.async.
template <typename T, typename TIO, int D, bool kVariant>
LaunchStatus LaunchPersistentPrefillWgmma(const PagedAttentionParams& params,
                                          cudaStream_t stream, Launcher& launcher) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  if (params.prefill_jobs == nullptr || params.prefill_job_start == nullptr ||
      params.num_prefill_blocks <= 0) {
    return LaunchStatus::Unsupported(
        "the Hopper prefill kernel needs a job schedule (SchedulePrefillJobs with the blocks "
        "QueryPlanLimits gives)");
  }
  PagedAttentionParams tma = params;
  tma.kv_box_rows = 0;
  const int box_rows = PrefillTmaBoxRows(params.page_size, params.window, Cfg::kTileKv);
  if (box_rows > 0 && EncodePoolTensorMap(params.k_cache, D, box_rows, tma.kv_maps.k) &&
      EncodePoolTensorMap(params.v_cache, D, box_rows, tma.kv_maps.v)) {
    tma.kv_box_rows = box_rows;
  }
  auto launch = [&](auto kernel, LaunchStatus raised) {
    if (!raised.ok()) return raised;
    return launcher.Launch(kernel, dim3(static_cast<unsigned>(params.num_prefill_blocks)),
                           dim3(Cfg::kLaunchThreads), Cfg::SmemBytes(), stream, tma,
                           "prefill attention (wgmma)");
  };
  return tma.kv_box_rows > 0
             ? launch(PagedPrefillWgmmaKernel<T, TIO, D, kVariant, true>,
                      RaiseWgmmaPrefillSmemLimit<T, TIO, D, kVariant, true>())
             : launch(PagedPrefillWgmmaKernel<T, TIO, D, kVariant, false>,
                      RaiseWgmmaPrefillSmemLimit<T, TIO, D, kVariant, false>());
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
  } else {
    return LaunchPersistentPrefillWgmma<T, TIO, D, kVariant>(params, stream, launcher);
  }
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
template <typename T, typename TIO, int D, bool kVariant, bool kTmaKv>
LaunchStatus WgmmaPrefillBlocksPerSm(int* blocks) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  if (LaunchStatus st = RaiseWgmmaPrefillSmemLimit<T, TIO, D, kVariant, kTmaKv>(); !st.ok()) {
    return st;
  }
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks, PagedPrefillWgmmaKernel<T, TIO, D, kVariant, kTmaKv>, Cfg::kLaunchThreads,
      Cfg::SmemBytes());
  return err == cudaSuccess
             ? LaunchStatus::Ok()
             : LaunchStatus::CudaError(std::string("occupancy of the Hopper prefill kernel: ") +
                                       cudaGetErrorString(err));
}

// Blocks of the Hopper prefill kernel one SM holds (shared memory and registers), the fewest of
// its kernels (q in float or in T, plain or variant layer, and where it is persistent K/V by TMA
// or cp.async: one schedule serves each), and whether it runs persistent (a job schedule) or one
// block per item.
template <typename T, int D>
LaunchStatus PrefillWgmmaOccupancy(int* blocks_per_sm, bool* persistent) {
  using Cfg = WgmmaPrefillConfig<T, D>;
  *blocks_per_sm = 0;
  *persistent = Cfg::kPersistent;
  int blocks[8] = {};
  LaunchStatus st = WgmmaPrefillBlocksPerSm<T, float, D, false, false>(&blocks[0]);
  if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, T, D, false, false>(&blocks[1]);
  if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, float, D, true, false>(&blocks[2]);
  if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, T, D, true, false>(&blocks[3]);
  int kernels = 4;
  if constexpr (Cfg::kPersistent) {
    if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, float, D, false, true>(&blocks[4]);
    if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, T, D, false, true>(&blocks[5]);
    if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, float, D, true, true>(&blocks[6]);
    if (st.ok()) st = WgmmaPrefillBlocksPerSm<T, T, D, true, true>(&blocks[7]);
    kernels = 8;
  }
  if (!st.ok()) return st;
  *blocks_per_sm = *std::min_element(blocks, blocks + kernels);
  return LaunchStatus::Ok();
}

#define PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(T, D)                                         \
  template LaunchStatus LaunchPrefillTilesWgmma<T, float, D>(const PagedAttentionParams&, \
                                                             cudaStream_t, Launcher&);    \
  template LaunchStatus LaunchPrefillTilesWgmma<T, T, D>(const PagedAttentionParams&,     \
                                                         cudaStream_t, Launcher&);        \
  template LaunchStatus PrefillWgmmaOccupancy<T, D>(int*, bool*);

}  // namespace pagedattn::kernels
