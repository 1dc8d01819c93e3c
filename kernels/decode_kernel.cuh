// The decode tile kernels (16 rows, and 32 for wide GQA groups): their configuration, the math of
// one warp's rows, the device body, the thin __global__ wrappers and the host launcher.
//
// Included only by the per-head-dim instantiation files. A block takes one work item: up to
// kRowWarps * 16 query rows (row = query * group + head in group, all of one kv head) against a KV
// range, streamed through a cp.async pipeline of 64-position tiles (128 for an FP8 cache at head
// dims up to 128) gathered through the page table. S = Q.K^T and O += P.V run on tensor cores
// (mma.m16n8k16, f32 accumulators) with an online softmax between them. The kKvWarps warps that
// share a row slice split each KV tile and combine their softmax states at the end, so each K/V
// byte is read once for every head of its GQA group. An FP8 cache's tiles are copied as stored
// (half the bytes) and DecodeFp8Math reads them straight into float16 fragments; a block of at
// most 8 rows takes the step transposed (DecodeFp8NarrowMath). Where every 16-row tile of a launch
// has at most 8 rows, an FP8 cache's tiles may run as the narrow tile: eight warps on the KV
// tile, the transposed step alone (RunsNarrowDecode).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/device/dtype.cuh"
#include "kernels/device/profile.cuh"
#include "kernels/device/ptx.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// ---- Tile configuration -------------------------------------------------------------------

// Pipeline depth by head_dim: 3 stages at 64 (four blocks an SM) and 128 (two), 5 at 80 and 4 at
// 96 (two blocks an SM: their rows unpadded, DecodeOffset, so that two blocks have as many bytes
// in flight as at 64 and 128), 2 at 192 and 256; a fourth stage at 64 costs a block an SM
// (kernels/README.md#occupancy). At 80 a fourth stage (padded rows) turned three blocks an SM into
// two, and the batch of 64 x 8 kv heads from 1.3 waves into 1.9: 0.68x -> 0.86x of head_dim 128's
// TB/s (docs/PERFORMANCE.md#head-dims).
constexpr int DecodeStages(int head_dim) {
  return head_dim == 80 ? 5 : head_dim == 96 ? 4 : head_dim <= 128 ? 3 : 2;
}
// An FP8 cache's stages hold half the bytes of a 16-bit tile's. Up to head_dim 128 a tile then
// takes 128 positions (DecodeTilePositions), as many bytes as a 16-bit tile of 64: a tile's fixed
// costs (a barrier, the softmax's shuffles, the wait) are paid once for twice the positions.
// Stages: 4 at 64, 3 at 80, 2 at 96 and 128 (three blocks an SM each; a third stage at 96 or 128
// would leave two), 3 at 192 (two blocks) and 256 (one).
constexpr int Fp8DecodeStages(int head_dim) {
  return head_dim == 64 ? 4 : head_dim == 80 || head_dim >= 192 ? 3 : 2;
}
// The narrow tile (RunsNarrowDecode; two blocks an SM): 2 stages. A third ran the two short
// default shapes in 1.04-1.09x the time at head_dim 128 (1.02-1.04x at 64), the long ones in
// 0.99-1.01x (docs/PERFORMANCE.md#tried).
constexpr int kNarrowDecodeStages = 2;
// Positions a decode tile's stage holds: 128 for an FP8 cache up to head_dim 128
// (docs/PERFORMANCE.md#design-decisions), 64 otherwise.
constexpr int DecodeTilePositions(bool fp8, int head_dim) {
  return fp8 && head_dim <= 128 ? 2 * kKvTileRows : kKvTileRows;
}

// The decode tile's shared-memory rows: SwizzledOffset's where rows are whole 64-element blocks; at
// head dims 80 and 96 unpadded (160 and 192 bytes, not kSmemRowElems' 176 and 208: a stage more
// fits two blocks an SM), the chunk index XORed so that the eight rows an ldmatrix reads (aligned
// to 8) hit eight bank groups: rows of 10 chunks start two groups apart, those of 12 four apart.
template <int D>
__device__ __forceinline__ int DecodeOffset(int row, int chunk) {
  if constexpr (kSwizzledRows<D>) {
    return SwizzledOffset<D>(row, chunk);
  } else {
    constexpr int kChunks = D / 8;
    static_assert(kChunks % 8 == 2 || kChunks % 8 == 4, "rows two or four bank groups apart");
    const int x = kChunks % 8 == 2 ? (row >> 2) & 1 : (row >> 1) & 3;
    return row * D + ((chunk ^ x) << 3);
  }
}

// How a 16-bit tile whose rows are not a power of two of 16-byte chunks (head dims 80 and 96: 10
// and 12) is copied: its kTileKv x kChunks chunks dealt to the threads in order, copy i of thread
// t taking chunk e = t + i * kThreads (row e / kChunks, chunk e % kChunks). Every lane of every
// copy moves a chunk: 5 and 6 copies a thread a tile, where KvCopyLayout's power-of-two columns
// take 8 and leave 6 and 4 of each 16 threads idle (docs/PERFORMANCE.md#design-decisions). The 32
// chunks of a warp's copy i lie in at most kPassRows rows from PassRow0: lane i * kPassRows + k
// finds the pool row of the k-th.
template <int D, int kThreads, int kTileKv>
struct PackedKvCopy {
  static constexpr int kChunks = D / 8;
  static constexpr int kPerThread = kTileKv * kChunks / kThreads;
  // Rows 32 consecutive chunks touch at most: ceil((kChunks - 1 + 32) / kChunks).
  static constexpr int kPassRows = (2 * kChunks + 30) / kChunks;
  static_assert(kTileKv * kChunks % kThreads == 0 && kThreads % 32 == 0, "whole copies");
  static_assert(kPerThread * kPassRows <= 32, "a lane finds each row of its warp's copies");
  __device__ __forceinline__ static int PassRow0(int warp, int i) {
    return (32 * warp + i * kThreads) / kChunks;
  }
  // The tile row lane `lane` of warp `warp` finds (lanes past the last copy's: a row of it).
  __device__ __forceinline__ static int LaneRow(int warp, int lane) {
    const int i = min(lane / kPassRows, kPerThread - 1);
    return min(PassRow0(warp, i) + lane % kPassRows, kTileKv - 1);
  }
};

// S: the cache's element type as stored (T, or Fp8); T: the tiles' (TileType<S>).
template <typename S, int D, int kRowWarps, int kKvWarps>
struct DecodeTileConfig {
  static_assert(kRowWarps * kKvWarps == 4 || (kRowWarps == 1 && kKvWarps == kDecodeNarrowKvWarps),
                "four warps a block, or the narrow tile's eight on one 16-row slice");
  static_assert(kKvWarps > 1, "the decode tiles split each KV tile among warps");
  using T = TileType<S>;
  static constexpr bool kFp8 = kIsFp8<S>;
  // FP8: K and V go from the stages straight into the mma fragments (DecodeFp8Math).
  static_assert(!kFp8 || kFp8Fragments<D>, "an FP8 decode tile's head dim");
  // head_dim 512 (SplitsColumns): a tile runs as two neighbouring blocks, each with all of K
  // (the scores) and kDv of V's and O's columns; the two run as a cluster and read each K page
  // side by side (DecodeTileKernelPair). Its stages (64 KB of K, 32 of V) fit H100/H200's 227 KB
  // but not an A100's 163 KB, where such spans run on prefill tiles (QueryPlanLimits).
  static constexpr int kColSplit = DecodeTileBlocks(D);
  static constexpr int kDv = D / kColSplit;  // V's and O's columns per block
  static_assert(kColSplit == 1 || !kFp8, "FP8 at a split head_dim runs on prefill tiles");
  static constexpr int kThreads = 32 * kRowWarps * kKvWarps;
  static constexpr int kTileKv = DecodeTilePositions(kFp8, D);  // positions per stage
  static constexpr int kWarpKv = kTileKv / kKvWarps;  // positions per warp per stage
  static constexpr int kSteps = kWarpKv / 16;         // 16-position mma steps per warp per stage
  static constexpr int kRows = kRowWarps * 16;        // query rows per block
  using Copy = KvCopyLayout<D, kThreads, kTileKv, 16 / sizeof(S)>;
  static constexpr int kChunks = Copy::kChunks;  // 16-byte chunks per K/V row as stored
  static constexpr int kRowsPerThread = Copy::kRowsPerThread;  // rows each thread copies
  static constexpr int kRowStep = Copy::kRowStep;
  static constexpr bool kNarrowTile = kKvWarps == kDecodeNarrowKvWarps;  // RunsNarrowDecode
  static constexpr int kStages = kNarrowTile ? kNarrowDecodeStages
                                 : kFp8      ? Fp8DecodeStages(D)
                                             : DecodeStages(D);
  // 16-bit rows of 10 or 12 chunks (head dims 80, 96): copied by PackedKvCopy.
  static constexpr bool kPackedCopy = !kFp8 && !kSwizzledRows<D> && kColSplit == 1;
  using Packed = PackedKvCopy<D, kThreads, kTileKv>;  // instantiated where kPackedCopy only
  static constexpr int kPackedCopies = kPackedCopy ? kTileKv * (D / 8) / kThreads : 1;
  static constexpr bool kQInRegisters = D <= 128;
  static constexpr int kRowElems = D;      // a K or Q row in shared memory (DecodeOffset)
  static constexpr int kVRowElems = kDv;   // a V row (of kDv columns)
  static constexpr int kTileElems = kTileKv * kRowElems;  // the K tile; the V tile after it
  static constexpr int kStageElems = kTileElems + kTileKv * kVRowElems;
  // A stage: the K then V tile (16-bit caches); an FP8 cache's K then V rows as stored (16-byte
  // chunk c of row r at Fp8TileOffset), then K's and V's row scales (PER_TOKEN).
  static constexpr size_t kFp8StageBytes = 2 * size_t{kTileKv} * D + 2 * kTileKv * sizeof(float);
  static constexpr size_t kStageBytes = kFp8 ? kFp8StageBytes : kStageElems * sizeof(T);
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageBytes;
  static constexpr int kRedStride = kDv + 8;  // padded O rows: a warp's 8 rows hit distinct banks
  static constexpr size_t kReduceFloats = size_t{kKvWarps} * kRows * (kRedStride + 2);
  static constexpr size_t kReduceBytes = kReduceFloats * sizeof(float);  // O, max, sum
  // The pipeline's stages, reused for the warps' combine once the last tile is read; then Q.
  static constexpr size_t kQOffset = kPipelineBytes > kReduceBytes ? kPipelineBytes : kReduceBytes;
  static constexpr size_t kQBytes = size_t{kRows} * kRowElems * sizeof(T);
  // FP8: each Q row's power-of-two scale (DecodeFp8Math::QToHalf), after Q.
  static constexpr size_t kQScaleOffset = kQOffset + kQBytes;
  static constexpr size_t SmemBytes() {
    return kQScaleOffset + (kFp8 ? kRows * sizeof(float) : 0);
  }
  static_assert(kWarpKv % 16 == 0, "each warp takes whole 16-position steps");
  static_assert(kFp8StageBytes % 16 == 0, "stages keep 16-byte alignment");
};

// Whether a block of this tile whose item has at most 8 rows takes DecodeFp8NarrowMath's
// transposed step: an FP8 cache's 16-row tile up to head_dim 128 (the default decode shapes' GQA
// groups of 4 and 8).
template <typename Cfg, int kRowWarps>
inline constexpr bool kNarrowFp8Decode = Cfg::kFp8 && Cfg::kColSplit == 1 && kRowWarps == 1 &&
                                         Cfg::kRowElems <= 128;

// ---- One warp's 16 rows: what they see and their softmax state ----------------------------

// The decode tile's softmax base is lazy (kRescaleSlack) from head_dim 80 on, where the skipped
// rescale of O is D/2 multiplies a step; at 64 the vote costs more than it saves
// (docs/PERFORMANCE.md#tried).
constexpr bool LazyRescale(int head_dim) { return head_dim >= 80; }

// The positions a thread's two rows (quad_row and quad_row + 8 of its warp's 16) may see.
struct DecodeRows {
  int q_pos[2];        // last position each row sees; -1 past the span
  int first_pos[2];    // first position each row sees (a sliding window's; INT32_MIN: all)
  int warp_max_pos;    // last position any row of the warp sees (-1: no rows): steps past it skip
  int warp_min_first;  // first position any row of the warp sees: steps before it skip
  int all_see_last;    // every live row of the warp sees the positions from all_see_first
  int all_see_first;   // to all_see_last: a step inside them needs no mask
};

// Rows span_row = row_start + row_warp * 16 + first_row (+ row_step) of a span whose first query
// is at position first_q_pos and whose rows end at span_rows: a 16-row step's quad_row and
// quad_row + 8, a narrow FP8 step's 2 quad_col and 2 quad_col + 1.
__device__ __forceinline__ DecodeRows DecodeRowsOf(const PagedAttentionParams& p,
                                                   const AttentionWorkItem& item, int group,
                                                   int span_rows, int first_q_pos, int row_warp,
                                                   int first_row, int row_step) {
  DecodeRows rows;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int span_row = item.row_start + row_warp * 16 + first_row + row_step * i;
    rows.q_pos[i] =
        span_row >= span_rows ? -1 : (p.causal ? first_q_pos + span_row / group : INT32_MAX);
    rows.first_pos[i] = WindowFirst(p, first_q_pos + span_row / group);
  }
  const int warp_first_row = item.row_start + row_warp * 16;
  const int warp_last_row = min(warp_first_row + 15, span_rows - 1);
  rows.warp_max_pos = warp_last_row < warp_first_row
                          ? -1
                          : (p.causal ? first_q_pos + warp_last_row / group : INT32_MAX);
  rows.warp_min_first = WindowFirst(p, first_q_pos + warp_first_row / group);
  // A row's last and first visible positions grow with the row (its query's position).
  rows.all_see_last = p.causal ? first_q_pos + warp_first_row / group : INT32_MAX;
  rows.all_see_first = WindowFirst(p, first_q_pos + warp_last_row / group);
  return rows;
}

// A thread's part of its rows' online softmax: columns 2*quad_col..+1 of each 8-wide n tile of
// O, and the rows' running max (log2 units) and sum.
template <int D>
struct DecodeState {
  float o[D / 8][4];
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ void Start() {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }
};

// The arithmetic of one 16-position step of one warp: S = Q.K^T, mask and scale, the online
// softmax update, O += P.V. s holds the step's scores, then its weights P.
// DV: the columns of V and O a block holds (DecodeTileConfig::kDv).
template <typename T, int D, int DV = D>
struct DecodeTileMath {
  // S = Q K^T over the 16 positions at row0 of the K tile sk: two n8 tiles, each summed over
  // head_dim in two accumulators (even and odd k chunks) up to head_dim 128 and at 512, so that
  // the dependent mma chain before the softmax is D/32 deep rather than D/16 (at 192 and 256 the
  // registers are spent).
  static constexpr bool kTwoChains = D <= 128 || DV < D;
  template <typename QFragment>
  __device__ __forceinline__ static void ScoreQK(const QFragment& q_fragment, const T* sk, int row0,
                                                 int lane, float (&s)[2][4]) {
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t a[4];
      q_fragment(kc, a);
      uint32_t b[4];
      const int r = row0 + (lane & 7) + 8 * (lane >> 4);
      LdMatrixX4(b, SmemAddr(sk + DecodeOffset<D>(r, 2 * kc + ((lane >> 3) & 1))));
      float(&acc)[2][4] = (kTwoChains && (kc & 1)) ? s_odd : s;
      Mma16816<T>(acc[0], a, b[0], b[1]);
      Mma16816<T>(acc[1], a, b[2], b[3]);
    }
    if constexpr (kTwoChains) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
      }
    }
  }

  // Soft-caps the scores (when the layer has a cap), masks the positions past the split's end,
  // past a row's last (causal) or before its first (window), and scales the rest to log2 units.
  // A step that every live row of the warp sees whole (all but a range's last, in decode) skips
  // the per-score tests (a warp-uniform branch); rows past the span are not written. q_rows: a
  // factor of each of the thread's rows still to apply (an FP8 tile's power-of-two Q row scales;
  // 1 otherwise), folded into the rows' log2 units where there is no cap (a power of two times
  // scale_log2, exact), so that it costs no multiply a score.
  __device__ __forceinline__ static void MaskAndScale(float (&s)[2][4], int pos0, int kv_end,
                                                      const DecodeRows& rows, int quad_col,
                                                      const Softcap& softcap, float scale_log2,
                                                      const float (&q_rows)[2] = {1.f, 1.f}) {
    float unit[2] = {q_rows[0] * scale_log2, q_rows[1] * scale_log2};
    if (softcap.on) {  // block-uniform: the cap takes the score itself
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= q_rows[e >> 1];
      }
      softcap.Apply(s);
      unit[0] = unit[1] = scale_log2;
    }
    if (pos0 + 15 < kv_end && pos0 + 15 <= rows.all_see_last && pos0 >= rows.all_see_first) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = SaturatedScore(s[nt][e] * unit[e >> 1]);
      }
      return;
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos0 + nt * 8 + 2 * quad_col + (e & 1);
        const bool visible =
            pos < kv_end && pos <= rows.q_pos[e >> 1] && pos >= rows.first_pos[e >> 1];
        s[nt][e] = visible ? SaturatedScore(s[nt][e] * unit[e >> 1]) : -INFINITY;
      }
    }
  }

  // P = 2^(s - base), the running sums, and O rescaled when the base moves. With LazyRescale(D)
  // the base (row_max) is raised to the row's max only when some row of the warp has a score
  // more than kRescaleSlack above its base; otherwise P stays below 2^kRescaleSlack, well within
  // f32 and the P operand's exponent range, and the common step (the max settles after the
  // first tiles) skips the rescale of O. Without it, every step raises the base and rescales.
  // Each thread tests its own scores (some score of a row is over the bar exactly when the row's
  // max is), so the row's max across its quad is found only when the base is raised.
  __device__ __forceinline__ static void OnlineSoftmax(float (&s)[2][4], DecodeState<DV>& st) {
    float mx[2];
    bool raise = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(fmaxf(s[0][2 * i], s[0][2 * i + 1]), fmaxf(s[1][2 * i], s[1][2 * i + 1]));
      raise = raise || mx[i] > st.row_max[i] + kRescaleSlack;
    }
    if (!LazyRescale(D) || __any_sync(0xffffffffu, raise)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float new_max = fmaxf(st.row_max[i], mx[i]);
        const float alpha = FastExp2(st.row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
        st.row_max[i] = new_max;
        st.row_sum[i] *= alpha;
#pragma unroll
        for (int dt = 0; dt < DV / 8; ++dt) {
          st.o[dt][2 * i] *= alpha;
          st.o[dt][2 * i + 1] *= alpha;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float base = st.row_max[i] == -INFINITY ? 0.f : st.row_max[i];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        s[nt][2 * i] = FastExp2(s[nt][2 * i] - base);
        s[nt][2 * i + 1] = FastExp2(s[nt][2 * i + 1] - base);
      }
      st.row_sum[i] += s[0][2 * i] + s[0][2 * i + 1] + s[1][2 * i] + s[1][2 * i + 1];
    }
  }

  // O += P V over the 16 positions at row0 of the V tile sv: P's accumulator layout is the A
  // operand layout of the next mma.
  __device__ __forceinline__ static void AccumulatePV(const float (&s)[2][4], const T* sv, int row0,
                                                      int lane, DecodeState<DV>& st) {
    const uint32_t pa[4] = {PackPair<T>(s[0][0], s[0][1]), PackPair<T>(s[0][2], s[0][3]),
                            PackPair<T>(s[1][0], s[1][1]), PackPair<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int dt = 0; dt < DV / 8; dt += 2) {
      uint32_t b[4];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4Trans(b, SmemAddr(sv + DecodeOffset<DV>(r, dt + (lane >> 4))));
      Mma16816<T>(st.o[dt], pa, b[0], b[1]);
      Mma16816<T>(st.o[dt + 1], pa, b[2], b[3]);
    }
  }
};

// The FP8 tiles' arithmetic with K and V read straight from the stages into the mma fragments
// (an FP8 cache's decode tiles); scores and weights as DecodeTileMath's. An ldmatrix of FP8
// rows hands each thread four bytes where a 16-bit fragment takes two values:
// - S = Q.K^T in float16: cvt.rn.f16x2.e4m3x2 turns a thread's four bytes of K (dims 4t..4t + 3
//   of a 16-dim step) into the two pairs its B fragment takes, exactly, one instruction a pair;
//   the sum over head_dim takes dims 4t, 4t + 1 in the first k slots and 4t + 2, 4t + 3 in the
//   second, and Q's fragment is loaded in the same order (LoadQFragment). Q is float16 too,
//   each row scaled by a power of two into float16's range (QToHalf); the scores get it back.
// - O += P.V in float16 too. An ldmatrix.trans of FP8 rows gives a thread two positions of two
//   neighbouring dims; one byte permute and two conversions make them an even and an odd pair
//   (E4m3x4ToHalfPairs). The even dims make one n8 tile of O, the odd dims another, so a
//   thread's O holds dims 16c + 4t .. 16c + 4t + 3 as (o[2c][0], o[2c + 1][0], o[2c][1],
//   o[2c + 1][1]) (rows quad_row; [2], [3] for quad_row + 8): CombineKvWarpsAndWrite reads it
//   that way. V's per-position scales go into P, relative to a reference scale the warp raises
//   lazily (VScales), so that P stays within float16: P <= 2^8 (the lazy softmax base) times a
//   scale at most 2^7 times the reference.
// The scales apply once, in float: K's (and Q's row scales) to the scores, V's to P before P is
// packed, the reference to O at the end. In bfloat16 instead, the conversions took 4.5
// instructions a pair of V and 3.5 of K, the most of a step's: 1.32-1.50x bf16's rate on the
// default shapes against 1.07-1.51x.
// No pass over shared memory and no barrier between the copies and the math: the staging pass
// this replaces cost what FP8's halved bytes save (docs/PERFORMANCE.md#design-decisions).
template <int D>
struct DecodeFp8Math {
  using T = __half;

  // Whether QToHalf leaves Q in fragment order (FragmentWord): each 16-row warp's A fragments
  // one after another, a lane's four registers of a k step in one 16-byte word, so that
  // LoadQFragment is one load into four registers the mma takes as they are. Loaded from pairs of
  // rows, the fragments came in pairs of registers that ptxas moved into place for every mma, a
  // step: 232 of the tile loop's 1818 instructions at head_dim 128. Fragment order: 0.90-0.95x
  // the time at 192, 0.93-0.97x at 256 and 96, 0.96-0.98x at 64 and 80 (b2b); at 128 PER_TOKEN
  // 0.99x, but STATIC 1.02-1.05x on the three longest shapes, so 128 keeps the rows
  // (docs/PERFORMANCE.md#design-decisions).
  static constexpr bool kFragmentOrderQ = D != 128;

  // Rewrites the block's Q tile (kRows rows, bfloat16) in float16, row r times 2^-e_r, and
  // stores 2^e_r at q_scales[r]. e_r puts the row's largest |q| in [2^14, 2^15): float16 holds
  // every value of the row to 2^-24 of it (below, as good as nothing next to the largest, they
  // flush), with 3 more bits than bfloat16 had. In fragment order (kFragmentOrder) or in place
  // (DecodeFp8NarrowMath's). Once per item, by every thread; a barrier after.
  template <int kRows, int kThreads, bool kFragmentOrder = kFragmentOrderQ>
  __device__ __forceinline__ static void QToHalf(__nv_bfloat16* q, float* q_scales, int tid) {
    constexpr int kRowThreads = kThreads / kRows;  // neighbouring lanes of one warp
    constexpr int kChunks = D / 8;                 // 16-byte chunks a row (some threads one less)
    constexpr int kMine = (kChunks + kRowThreads - 1) / kRowThreads;
    const int r = tid / kRowThreads, first = tid % kRowThreads;
    uint4 v[kMine];  // fragment order: the thread's chunks, kept until every chunk is read
    float m = 0.f;
    if constexpr (kFragmentOrder) {
#pragma unroll
      for (int k = 0; k < kMine; ++k) {
        const int c = first + k * kRowThreads;
        v[k] = c < kChunks ? *reinterpret_cast<const uint4*>(q + DecodeOffset<D>(r, c))
                           : make_uint4(0, 0, 0, 0);
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
    } else {
#pragma unroll
      for (int c = first; c < kChunks; c += kRowThreads) {
        const uint4 x = *reinterpret_cast<const uint4*>(q + DecodeOffset<D>(r, c));
        const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
    }
#pragma unroll
    for (int o = 1; o < kRowThreads; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int ex = 0;
    frexpf(m, &ex);                    // m < 2^ex (0 for 0: the row stays as it is)
    const int e = max(ex - 15, -100);  // 2^-e stays a float for rows of tiny values
    const float down = ldexpf(1.f, -e);
    if constexpr (kFragmentOrder) {
      __syncthreads();  // every chunk read before any is moved
      uint32_t* words = reinterpret_cast<uint32_t*>(q);
#pragma unroll
      for (int k = 0; k < kMine; ++k) {
        const int c = first + k * kRowThreads;
        if (c >= kChunks) continue;
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          const __half2 h = __floats2half2_rn(f.x * down, f.y * down);
          words[FragmentWord(r, 8 * c + 2 * j)] = *reinterpret_cast<const uint32_t*>(&h);
        }
      }
    } else {  // in place
#pragma unroll
      for (int c = first; c < kChunks; c += kRowThreads) {
        uint4* chunk = reinterpret_cast<uint4*>(q + DecodeOffset<D>(r, c));
        const uint4 x = *chunk;
        uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          const __half2 h = __floats2half2_rn(f.x * down, f.y * down);
          w[j] = *reinterpret_cast<const uint32_t*>(&h);
        }
        *chunk = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    if (first == 0) q_scales[r] = ldexpf(1.f, e);
  }

  // Where fragment order puts dims d, d + 1 (d even) of row r, in 4-byte words: warp r / 16's k
  // step kc = d / 16, lane (r % 8) * 4 + t (t = d % 16 / 4), register (d % 4 / 2) * 2 + r % 16 / 8.
  __host__ __device__ static constexpr int FragmentWord(int r, int d) {
    const int kc = d / 16, t = d % 16 / 4, h = d % 4 / 2;
    const int rr = r % 16;
    return (((r / 16) * (D / 16) + kc) * 32 + (rr % 8) * 4 + t) * 4 + 2 * h + rr / 8;
  }

  // Q's A fragment (float16, from QToHalf) of k step kc: slots 2t, 2t + 1 hold dims
  // 16kc + 4t, + 1; slots 2t + 8, + 9 dims 16kc + 4t + 2, + 3 (the K fragments' order). warp_q:
  // the warp's part of the tile (16 rows' worth).
  __device__ __forceinline__ static void LoadQFragment(const __nv_bfloat16* warp_q, int kc,
                                                       int lane, uint32_t (&a)[4]) {
    if constexpr (kFragmentOrderQ) {
      const uint4 q = reinterpret_cast<const uint4*>(warp_q)[kc * 32 + lane];
      a[0] = q.x;  // row quad_row, dims 4t, 4t + 1
      a[1] = q.y;  // row quad_row + 8
      a[2] = q.z;  // row quad_row, dims 4t + 2, 4t + 3
      a[3] = q.w;  // row quad_row + 8
    } else {
      const int quad_row = lane >> 2, quad_col = lane & 3;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint2 q = *reinterpret_cast<const uint2*>(
            warp_q + DecodeOffset<D>(quad_row + 8 * i, 2 * kc + (quad_col >> 1)) +
            4 * (quad_col & 1));
        a[i] = q.x;      // dims 4t, 4t + 1
        a[2 + i] = q.y;  // dims 4t + 2, 4t + 3
      }
    }
  }

  // Four E4M3 values (bytes of x) as two pairs of float16, exactly: (b0, b1), (b2, b3). From
  // sm_89 one cvt a pair, the high pair's read from the register's upper half as it stands
  // (F2FP's .H1 operand): a shift less every four bytes of K and V, 32 of an FP8 step's
  // instructions at head_dim 128.
  __device__ __forceinline__ static void E4m3x4ToHalf(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
        "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
#else
    static_assert(sizeof(__nv_fp8x2_storage_t) == 2, "two E4M3 values");
    const __half2_raw l =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3);
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), __NV_E4M3);
    lo = *reinterpret_cast<const uint32_t*>(&l);
    hi = *reinterpret_cast<const uint32_t*>(&h);
#endif
  }

  // S = Q K^T over the 16 positions at row0 of the FP8 K tile sk (unscaled, Q's rows in their
  // float16 scale): one ldmatrix per 32 dims, two accumulators up to head_dim 128 as
  // DecodeTileMath::ScoreQK.
  template <typename QFragment>
  __device__ __forceinline__ static void ScoreQK(const QFragment& q_fragment,
                                                 const unsigned char* sk, int row0, int lane,
                                                 float (&s)[2][4]) {
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kc2 = 0; kc2 < D / 32; ++kc2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 32kc2..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4(m, SmemAddr(sk + Fp8TileOffset<D>(r, 2 * kc2 + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        q_fragment(2 * kc2 + j, a);
        uint32_t b[2][2];
        E4m3x4ToHalf(m[2 * j], b[0][0], b[0][1]);
        E4m3x4ToHalf(m[2 * j + 1], b[1][0], b[1][1]);
        float(&acc)[2][4] = (D <= 128 && j) ? s_odd : s;
        Mma16816<__half>(acc[0], a, b[0][0], b[0][1]);
        Mma16816<__half>(acc[1], a, b[1][0], b[1][1]);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      uint32_t m[2];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX2(m, SmemAddr(sk + Fp8TileOffset<D>(r, D / 16 - 1)));
      uint32_t a[4];
      q_fragment(D / 16 - 1, a);
      uint32_t b[2][2];
      E4m3x4ToHalf(m[0], b[0][0], b[0][1]);
      E4m3x4ToHalf(m[1], b[1][0], b[1][1]);
      Mma16816<__half>(s[0], a, b[0][0], b[0][1]);
      Mma16816<__half>(s[1], a, b[1][0], b[1][1]);
    }
    if constexpr (D <= 128) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
      }
    }
  }

  // A thread's scores or weights (columns 2 quad_col, + 1 of each n8 tile) times their
  // positions' scales: row_scales[row0 + 8nt + 2quad_col + e % 2] (the stage's, in shared
  // memory) where per_token (block-uniform), else `one`. Q's row scales join the scores' log2
  // units (DecodeTileMath::MaskAndScale's q_rows).
  __device__ __forceinline__ static void Scale(float (&s)[2][4], const float* row_scales,
                                               bool per_token, float one, int row0,
                                               int quad_col) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float2 f = make_float2(one, one);
      if (per_token) {
        f = *reinterpret_cast<const float2*>(row_scales + row0 + nt * 8 + 2 * quad_col);
        f.x = fminf(f.x, kMaxTileScale);
        f.y = fminf(f.y, kMaxTileScale);
      }
      s[nt][0] *= f.x;
      s[nt][1] *= f.y;
      s[nt][2] *= f.x;
      s[nt][3] *= f.y;
    }
  }

  // V's scale reference of a warp: the weights P (<= 2^8) are multiplied by their positions'
  // V scales over `ref` before they are packed in float16, and O, summed in units of ref, is
  // multiplied by ref at the end. ref starts at float's smallest normal and is raised to a
  // step's largest scale when that is more than 2^7 times ref (O rescaled then), so that the
  // packed weights stay below 2^15. A step's scales are the same for every row: the raise is
  // warp-uniform. Positions whose scales are 2^-24 of ref or less (V values that small beside
  // the step's largest) flush in float16.
  struct VReference {
    float ref = 0x1p-126f;
    float inv = 0x1p126f;

    // Whether a scale passes the reference by more than 2^7: the only case that raises it.
    __device__ __forceinline__ bool Passes(float mx) const { return mx > ref * 0x1p7f; }
    // Whether any lane's scale Passes: the step's largest scale is then found and raised to.
    __device__ __forceinline__ bool AnyPasses(float mx) const {
      return __any_sync(0xffffffffu, Passes(mx));
    }
    // ref raised to mx, the step's largest scale (the same in every lane), where mx Passes it,
    // a thread's O (kN x 4 values) rescaled with it.
    template <int kN>
    __device__ __forceinline__ void RaiseTo(float mx, float (&o)[kN][4]) {
      if (Passes(mx)) {  // warp-uniform
        const float down = ref / mx;
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[n][e] *= down;
        }
        ref = mx;
        inv = 1.f / mx;
      }
    }
    // O back in its own units, once the last step is summed.
    template <int kN>
    __device__ __forceinline__ void Finish(float (&o)[kN][4]) const {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= ref;
      }
    }
  };
  struct VScales : VReference {
    // p times the V scales of the step at row0 (row_scales[row0 + ...] where per_token, else
    // `one`) over ref.
    __device__ __forceinline__ void Apply(float (&p)[2][4], const float* row_scales,
                                          bool per_token, float one, int row0, int quad_col,
                                          DecodeState<D>& st) {
      float2 f[2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        f[nt] = make_float2(one, one);
        if (per_token) {
          f[nt] = *reinterpret_cast<const float2*>(row_scales + row0 + nt * 8 + 2 * quad_col);
          f[nt].x = fminf(f[nt].x, kMaxTileScale);
          f[nt].y = fminf(f[nt].y, kMaxTileScale);
        }
      }
      // The reference rises only where a scale of the step passes it by 2^7 (rare after the
      // first steps): a vote finds that, and the step's largest scale is found only then.
      float mx = fmaxf(fmaxf(f[0].x, f[0].y), fmaxf(f[1].x, f[1].y));
      if (this->AnyPasses(mx)) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        this->RaiseTo(mx, st.o);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float x = f[nt].x * this->inv, y = f[nt].y * this->inv;
        p[nt][0] *= x;
        p[nt][1] *= y;
        p[nt][2] *= x;
        p[nt][3] *= y;
      }
    }
  };

  // Four E4M3 values (bytes of x) as two pairs of float16, exactly: (b0, b2), (b1, b3).
  __device__ __forceinline__ static void E4m3x4ToHalfPairs(uint32_t x, uint32_t& even,
                                                           uint32_t& odd) {
    E4m3x4ToHalf(__byte_perm(x, 0, 0x3120), even, odd);
  }

  // O += P V over the 16 positions at row0 of the FP8 V tile sv; p: the weights times V's
  // scales over the reference (VScales). O's layout as the struct's comment says.
  __device__ __forceinline__ static void AccumulatePV(const float (&p)[2][4],
                                                      const unsigned char* sv, int row0, int lane,
                                                      DecodeState<D>& st) {
    const uint32_t pa[4] = {PackPair<T>(p[0][0], p[0][1]), PackPair<T>(p[0][2], p[0][3]),
                            PackPair<T>(p[1][0], p[1][1]), PackPair<T>(p[1][2], p[1][3])};
#pragma unroll
    for (int c = 0; c + 1 < D / 16; c += 2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 16c..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, c + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t lo[2], hi[2];  // [0]: dim 2 quad_row of the 16 (even), [1]: + 1 (odd)
        E4m3x4ToHalfPairs(m[2 * j], lo[0], lo[1]);
        E4m3x4ToHalfPairs(m[2 * j + 1], hi[0], hi[1]);
        Mma16816<T>(st.o[2 * (c + j)], pa, lo[0], hi[0]);
        Mma16816<T>(st.o[2 * (c + j) + 1], pa, lo[1], hi[1]);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      constexpr int c = D / 16 - 1;
      uint32_t m[2];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX2Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, c)));
      uint32_t lo[2], hi[2];
      E4m3x4ToHalfPairs(m[0], lo[0], lo[1]);
      E4m3x4ToHalfPairs(m[1], hi[0], hi[1]);
      Mma16816<T>(st.o[2 * c], pa, lo[0], hi[0]);
      Mma16816<T>(st.o[2 * c + 1], pa, lo[1], hi[1]);
    }
  }
};

// An FP8 tile's step where a warp has at most 8 live rows (GQA groups up to 8 in decode):
// transposed, S^T = K.Q^T and O^T = V^T.P^T, so that the 8 rows are the mma's n8 and K and V
// its m16 (16 positions, 16 dims). The 16-row step computes 16 rows of which such a warp keeps
// 4 or 8; this one half of its mma's, O in half the registers (D / 4, not D / 2), Q^T's
// fragments in 2 registers a k step (one 8-byte load of a row, no moves) and 4 scores a thread.
// Per lane (g = lane / 4, t = lane % 4):
// - K's A fragment: a non-transposed ldmatrix gives position g (and g + 8) dims 4t .. 4t + 3 of
//   a 16-dim step, converted as DecodeFp8Math's (the sum ordered around the bytes); Q^T's B
//   fragment: row g, dims 4t .. 4t + 3, in float16 in place (QToHalf unordered).
// - S^T's accumulator: s[0][0], [1]: position g, rows 2t, 2t + 1; [2], [3]: position g + 8.
//   Each row's softmax reduces across the 8 lanes of its t (xor 4, 8, 16).
// - P^T as the B operand: the weights packed as S^T lies, each 8x8 half transposed
//   (MovMatrixTrans) to row g, positions 2t, 2t + 1 (and + 8).
// - V^T's A fragment: an ldmatrix.trans gives positions 2t, 2t + 1 of dims 2g, 2g + 1, one
//   byte permute and two conversions make the even dim's pair and the odd's (E4m3x4ToHalfPairs);
//   m tile i takes dims 16i + 2g (m = g) and 16i + 2g + 1 (m = g + 8).
// - O^T: o[i][0], [1]: dim 16i + 2g, rows 2t, 2t + 1; [2], [3]: dim 16i + 2g + 1.
// Scales as DecodeFp8Math's: K's on the scores, V's in P against a lazily raised reference.
template <int D>
struct DecodeFp8NarrowMath {
  using Fp8 = DecodeFp8Math<D>;
  static constexpr int kRows = 8;

  struct State {
    float o[D / 16][4];
    float row_max[2];  // rows 2t, 2t + 1 (log2 units)
    float row_sum[2];  // the lane's part; StoreRows sums the 8 lanes of a row

    __device__ __forceinline__ void Start() {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
      row_max[0] = row_max[1] = -INFINITY;
      row_sum[0] = row_sum[1] = 0.f;
    }
  };

  // Q^T's B fragments from the warp's Q rows (float16 in place, QToHalf unordered): k step kc,
  // row g, dims 16kc + 4t, + 1 (q[kc][0]) and + 2, + 3 (q[kc][1]).
  __device__ __forceinline__ static void LoadQ(const __nv_bfloat16* warp_q, int lane,
                                               uint32_t (&q)[D / 16][2]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      const uint2 v = *reinterpret_cast<const uint2*>(
          warp_q + DecodeOffset<D>(g, 2 * kc + (t >> 1)) + 4 * (t & 1));
      q[kc][0] = v.x;
      q[kc][1] = v.y;
    }
  }

  // S^T = K Q^T over the 16 positions at row0 of the FP8 K tile sk (unscaled; Q's rows in their
  // float16 scale), in two accumulators (even and odd k steps) so that the chain is D / 32 deep.
  __device__ __forceinline__ static void ScoreKQ(const uint32_t (&q)[D / 16][2],
                                                 const unsigned char* sk, int row0, int lane,
                                                 float (&s)[1][4]) {
    float s_odd[4] = {0.f, 0.f, 0.f, 0.f};
    const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kc2 = 0; kc2 < D / 32; ++kc2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 32kc2..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      LdMatrixX4(m, SmemAddr(sk + Fp8TileOffset<D>(r, 2 * kc2 + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        Fp8::E4m3x4ToHalf(m[2 * j], a[0], a[2]);
        Fp8::E4m3x4ToHalf(m[2 * j + 1], a[1], a[3]);
        Mma16816<__half>(j ? s_odd : s[0], a, q[2 * kc2 + j][0], q[2 * kc2 + j][1]);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      uint32_t m[2];
      LdMatrixX2(m, SmemAddr(sk + Fp8TileOffset<D>(r, D / 16 - 1)));
      uint32_t a[4];
      Fp8::E4m3x4ToHalf(m[0], a[0], a[2]);
      Fp8::E4m3x4ToHalf(m[1], a[1], a[3]);
      Mma16816<__half>(s[0], a, q[D / 16 - 1][0], q[D / 16 - 1][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][e] += s_odd[e];
  }

  // The scale of each of the lane's two positions (row0 + g, + 8): row_scales' (the stage's, in
  // shared memory) where per_token (block-uniform), else `one`.
  __device__ __forceinline__ static float2 PositionScales(const float* row_scales, bool per_token,
                                                          float one, int row0, int g) {
    if (!per_token) return make_float2(one, one);
    return make_float2(fminf(row_scales[row0 + g], kMaxTileScale),
                       fminf(row_scales[row0 + g + 8], kMaxTileScale));
  }

  // S^T times K's scales of the lane's positions.
  __device__ __forceinline__ static void ScaleK(float (&s)[1][4], const float* row_scales,
                                                bool per_token, float one, int row0, int g) {
    const float2 f = PositionScales(row_scales, per_token, one, row0, g);
    s[0][0] *= f.x;
    s[0][1] *= f.x;
    s[0][2] *= f.y;
    s[0][3] *= f.y;
  }

  // As DecodeTileMath::MaskAndScale, for S^T's layout: rows.q_pos / first_pos are rows 2t and
  // 2t + 1 (DecodeRowsOf with row_step 1).
  __device__ __forceinline__ static void MaskAndScale(float (&s)[1][4], int pos0, int kv_end,
                                                      const DecodeRows& rows, int g,
                                                      const Softcap& softcap, float scale_log2,
                                                      const float (&q_rows)[2]) {
    float unit[2] = {q_rows[0] * scale_log2, q_rows[1] * scale_log2};
    if (softcap.on) {  // block-uniform: the cap takes the score itself
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][e] *= q_rows[e & 1];
      softcap.Apply(s);
      unit[0] = unit[1] = scale_log2;
    }
    if (pos0 + 15 < kv_end && pos0 + 15 <= rows.all_see_last && pos0 >= rows.all_see_first) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][e] = SaturatedScore(s[0][e] * unit[e & 1]);
      return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = pos0 + g + 8 * (e >> 1), i = e & 1;
      const bool visible = pos < kv_end && pos <= rows.q_pos[i] && pos >= rows.first_pos[i];
      s[0][e] = visible ? SaturatedScore(s[0][e] * unit[i]) : -INFINITY;
    }
  }

  // DecodeTileMath::OnlineSoftmax's lazy base, each row's max found across its 8 lanes.
  __device__ __forceinline__ static void OnlineSoftmax(float (&s)[1][4], State& st) {
    float mx[2];
    bool raise = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(s[0][i], s[0][2 + i]);
      raise = raise || mx[i] > st.row_max[i] + kRescaleSlack;
    }
    if (!LazyRescale(D) || __any_sync(0xffffffffu, raise)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int x = 4; x < 32; x *= 2) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], x));
        const float new_max = fmaxf(st.row_max[i], mx[i]);
        const float alpha = FastExp2(st.row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
        st.row_max[i] = new_max;
        st.row_sum[i] *= alpha;
#pragma unroll
        for (int d = 0; d < D / 16; ++d) {
          st.o[d][i] *= alpha;
          st.o[d][2 + i] *= alpha;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float base = st.row_max[i] == -INFINITY ? 0.f : st.row_max[i];
      s[0][i] = FastExp2(s[0][i] - base);
      s[0][2 + i] = FastExp2(s[0][2 + i] - base);
      st.row_sum[i] += s[0][i] + s[0][2 + i];
    }
  }

  // DecodeFp8Math::VScales for S^T's layout: a lane's two positions, the step's largest scale
  // found across the lanes of its positions (xor 4, 8, 16).
  struct VScales : Fp8::VReference {
    __device__ __forceinline__ void Apply(float (&p)[1][4], const float* row_scales,
                                          bool per_token, float one, int row0, int g, State& st) {
      const float2 f = PositionScales(row_scales, per_token, one, row0, g);
      float mx = fmaxf(f.x, f.y);
      if (this->AnyPasses(mx)) {  // as DecodeFp8Math::VScales
#pragma unroll
        for (int x = 4; x < 32; x *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
        this->RaiseTo(mx, st.o);
      }
      const float x = f.x * this->inv, y = f.y * this->inv;
      p[0][0] *= x;
      p[0][1] *= x;
      p[0][2] *= y;
      p[0][3] *= y;
    }
  };

  // O^T += V^T P^T over the 16 positions at row0 of the FP8 V tile sv; p: the weights times V's
  // scales over the reference (VScales).
  __device__ __forceinline__ static void AccumulatePV(const float (&p)[1][4],
                                                      const unsigned char* sv, int row0, int lane,
                                                      State& st) {
    const uint32_t b0 = MovMatrixTrans(PackPair<__half>(p[0][0], p[0][1]));  // positions 0-7
    const uint32_t b1 = MovMatrixTrans(PackPair<__half>(p[0][2], p[0][3]));  // 8-15
    const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int c = 0; c + 1 < D / 16; c += 2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 16c..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      LdMatrixX4Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, c + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        Fp8::E4m3x4ToHalfPairs(m[2 * j], a[0], a[1]);
        Fp8::E4m3x4ToHalfPairs(m[2 * j + 1], a[2], a[3]);
        Mma16816<__half>(st.o[c + j], a, b0, b1);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      uint32_t m[2];
      LdMatrixX2Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, D / 16 - 1)));
      uint32_t a[4];
      Fp8::E4m3x4ToHalfPairs(m[0], a[0], a[1]);
      Fp8::E4m3x4ToHalfPairs(m[1], a[2], a[3]);
      Mma16816<__half>(st.o[D / 16 - 1], a, b0, b1);
    }
  }

  // The warp's rows into the combine's shared arrays (CombineKvWarpsAndWrite's layout): each
  // row's sum across its 8 lanes, then its max and sum from lane t, its O from the 8 lanes.
  __device__ __forceinline__ static void StoreRows(State& st, float* red_o, float* red_max,
                                                   float* red_sum, int red_stride, int row_offset,
                                                   int live_rows, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int x = 4; x < 32; x *= 2) st.row_sum[i] += __shfl_xor_sync(0xffffffffu, st.row_sum[i], x);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 2 * t + i;
      if (r >= live_rows) continue;
      if (g == 0) {
        red_max[row_offset + r] = st.row_max[i];
        red_sum[row_offset + r] = st.row_sum[i];
      }
      float* red_row = red_o + (row_offset + r) * red_stride;
#pragma unroll
      for (int d = 0; d < D / 16; ++d) {
        *reinterpret_cast<float2*>(red_row + 16 * d + 2 * g) = make_float2(st.o[d][i], st.o[d][2 + i]);
      }
    }
  }
};

// ---- Combine and write ----------------------------------------------------------------------

// The kKvWarps warps that split each KV tile combine their (max, sum, O) through shared memory
// (the pipeline's, free once the last tile is read): each stores its state for the tile's live
// rows (rows past the span are skipped), then all threads combine 4-dim slices of those rows and
// write them, normalized: to out (4 TIO in one store) / lse for an unsplit tile, to the partial
// buffers (a float4) of its split otherwise.
// A block of a split head_dim (Cfg::kColSplit) writes its kDv columns from col0 on, and the
// rows' LSE only from the block at column 0.
// A warp's 16 rows of DecodeState into the combine's shared arrays: each row's sum across its
// quad, then its max, sum and O (row r of the block at row_offset + r).
template <typename Cfg, int D>
__device__ __forceinline__ void StoreDecodeRows(DecodeState<Cfg::kDv>& st, float* red_o,
                                                float* red_max, float* red_sum, int row_offset,
                                                int live_rows, int row_warp, int lane) {
  constexpr int DV = Cfg::kDv;
  const int quad_row = lane >> 2, quad_col = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    st.row_sum[i] += __shfl_xor_sync(0xffffffffu, st.row_sum[i], 1);
    st.row_sum[i] += __shfl_xor_sync(0xffffffffu, st.row_sum[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row_warp * 16 + quad_row + 8 * i;
    if (r >= live_rows) continue;
    if (quad_col == 0) {
      red_max[row_offset + r] = st.row_max[i];
      red_sum[row_offset + r] = st.row_sum[i];
    }
    float* red_row = red_o + (row_offset + r) * Cfg::kRedStride;
    if constexpr (Cfg::kFp8) {  // DecodeFp8Math's layout: dims 16c + 4 quad_col .. + 3
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        *reinterpret_cast<float4*>(red_row + 16 * c + 4 * quad_col) =
            make_float4(st.o[2 * c][2 * i], st.o[2 * c + 1][2 * i], st.o[2 * c][2 * i + 1],
                        st.o[2 * c + 1][2 * i + 1]);
      }
    } else {
#pragma unroll
      for (int dt = 0; dt < DV / 8; ++dt) {
        *reinterpret_cast<float2*>(red_row + dt * 8 + 2 * quad_col) =
            make_float2(st.o[dt][2 * i], st.o[dt][2 * i + 1]);
      }
    }
  }
}

// store_rows(red_o, red_max, red_sum, row_offset, live_rows): the warp's rows into the shared
// arrays (StoreDecodeRows, DecodeFp8NarrowMath::StoreRows).
template <typename TIO, typename Cfg, int D, int kKvWarps, typename StoreRows>
__device__ __forceinline__ void CombineKvWarpsAndWrite(const PagedAttentionParams& p,
                                                       const AttentionWorkItem& item, int kv_head,
                                                       int group, StoreRows&& store_rows,
                                                       unsigned char* smem_raw, int kv_warp,
                                                       int tid, int col0) {
  constexpr int DV = Cfg::kDv;
  const int span_rows = item.span_info.num_queries * group;
  __syncthreads();  // every warp is done with the pipeline's shared memory
  float* red_o = reinterpret_cast<float*>(smem_raw);  // [kKvWarps][kRows][kRedStride]
  float* red_max = red_o + kKvWarps * Cfg::kRows * Cfg::kRedStride;  // [kKvWarps][kRows]
  float* red_sum = red_max + kKvWarps * Cfg::kRows;                  // [kKvWarps][kRows]
  const int live_rows = min(Cfg::kRows, span_rows - item.row_start);
  store_rows(red_o, red_max, red_sum, kv_warp * Cfg::kRows, live_rows);
  __syncthreads();
  constexpr int kQuads = DV / 4;
  for (int e = tid; e < live_rows * kQuads; e += Cfg::kThreads) {
    const int r = e / kQuads, c = (e % kQuads) * 4;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) m = fmaxf(m, red_max[w * Cfg::kRows + r]);
    const float base = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) {
      const float f = exp2f(red_max[w * Cfg::kRows + r] - base);
      sum += red_sum[w * Cfg::kRows + r] * f;
      const float4 v =
          *reinterpret_cast<const float4*>(red_o + (w * Cfg::kRows + r) * Cfg::kRedStride + c);
      acc.x += v.x * f;
      acc.y += v.y * f;
      acc.z += v.z * f;
      acc.w += v.w * f;
    }
    // A sink joins the row's softmax once, where the row is finished: here for an unsplit tile,
    // in the merge for a split one.
    const float sink =
        item.partial_row < 0 ? SinkLog2(p, kv_head, group, item.row_start + r) : -INFINITY;
    const RowNorm norm = NormalizeRow(sum, base, sink);
    const float inv = norm.inv, lse = norm.lse;
    const bool writes_lse = c == 0 && col0 == 0;
    if constexpr (!std::is_same_v<TIO, float>) {  // out in the cache's type: 4 values, 8 bytes
      if (item.partial_row < 0) {
        const int64_t out_row =
            OutputRow(p, item.span_info.q_offset, item.row_start + r, kv_head, group);
        *reinterpret_cast<uint2*>(static_cast<TIO*>(p.out) + out_row * D + col0 + c) =
            make_uint2(PackOutputPair<TIO>(acc.x * inv, acc.y * inv),
                       PackOutputPair<TIO>(acc.z * inv, acc.w * inv));
        if (p.lse && writes_lse) p.lse[out_row] = lse;
        continue;
      }
    }
    float* dst;  // out in float, or the split's partial buffers
    float* lse_dst;
    TileRowDestination<D>(p, item, item.span_info, kv_head, group, r, item.row_start + r, dst,
                          lse_dst);
    *reinterpret_cast<float4*>(dst + col0 + c) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (lse_dst && writes_lse) *lse_dst = lse;
  }
}

// ---- Device body --------------------------------------------------------------------------

template <typename S, typename TIO, int D, int kRowWarps, int kKvWarps>
__device__ __forceinline__ void DecodeTileBody(const PagedAttentionParams& p,
                                               const AttentionWorkItem* items,
                                               const ItemFirstPages* first_pages) {
  using Cfg = DecodeTileConfig<S, D, kRowWarps, kKvWarps>;
  using T = typename Cfg::T;
  using Math = DecodeTileMath<T, D, Cfg::kDv>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem_q = reinterpret_cast<T*>(smem_raw + Cfg::kQOffset);

  // A profile build's stamps (kernels/device/profile.cuh): this kernel's region and block.
#define PAGEDATTN_TILE_STAMP(event)                                                           \
  PAGEDATTN_STAMP(p,                                                                          \
                  profile::SlotOf(kRowWarps == kDecodeWideRowWarps ? profile::kDecodeWideTiles \
                                                                   : profile::kDecodeTiles,   \
                                  blockIdx.x),                                                \
                  profile::event)
  PAGEDATTN_TILE_STAMP(kTileEntry);
  // A separate merge launched after these tiles (Launcher::LaunchPair) may be scheduled
  // now: its blocks wait for this grid's end in griddepcontrol.wait.
  AllowDependentLaunch();
  // Blocks go item-major (TileGridBlocks): the kv heads of one work item are neighbours in
  // launch order, so the blocks that run at once read whole pages (a page holds every kv head's
  // rows, one after another) rather than one kv head's part of many pages
  // (docs/PERFORMANCE.md#design-decisions). The blocks of one tile (kColSplit) are neighbours too.
  const ItemMajorBlock block = ItemMajorAt(p, blockIdx.x / Cfg::kColSplit);
  const int col0 = static_cast<int>(blockIdx.x % Cfg::kColSplit) * Cfg::kDv;  // of V and O
  const uint32_t item_index = block.item;
  const AttentionWorkItem item = items[item_index];
  const int kv_head = block.kv_head;
  const AttentionSpan span = item.span_info;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int span_rows = span.num_queries * group;
  const int first_q_pos = span.kv_len - span.num_queries;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int row_warp = warp % kRowWarps, kv_warp = warp / kRowWarps;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  // ---- The K/V pipeline: tile t of the item's KV range goes to stage t % kStages, kStages - 1
  // tiles ahead of the arithmetic; each thread copies the same 16-byte chunk column of
  // kRowsPerThread rows of every tile (at head dims 80 and 96 PackedKvCopy's chunks). K and V are
  // read once per launch (each (span, kv head) has one decode tile): their lines leave L2 first,
  // so the work items, page table and split partials stay there
  // (docs/PERFORMANCE.md#design-decisions).
  const uint64_t read_once = EvictFirstPolicy();
  const int copy_chunk = tid % Cfg::Copy::kSlots, copy_row0 = tid / Cfg::Copy::kSlots;
  // A column past the row (head_dim 192; 80 and 96 copy as PackedKvCopy, every thread).
  const bool copies = Cfg::kPackedCopy || copy_chunk < Cfg::kChunks;
  // A split head_dim's V: the chunk of this block's columns a thread's K chunk lies over (V rows
  // are addressed as K's), out of range for the threads of the other half's columns.
  const int v_chunk = copy_chunk - col0 / 8;
  const int num_tiles = (item.kv_end - item.kv_start + Cfg::kTileKv - 1) / Cfg::kTileKv;
  const int32_t* pages = p.page_table + span.page_table_offset;
  // A tile's rows are found once each, not once per thread that copies a chunk of them: lane j
  // of a warp finds the pool row (row = (page * kv_heads + kv_head) * page_size + in_page) of
  // the warp's j-th row, and each thread takes its rows' from their lanes by a shuffle, which
  // leaves it one multiply-add per copy's address. A lane loads its page id one tile ahead of
  // the copies, so that the load's latency stays hidden. Rows past the range: row 0, so that
  // every address stays in the pool. Pool rows fit in 32 bits: K's and V's pools of 2^32 rows
  // of at least 64 bytes (FP8 at head_dim 64) would take 512 GiB.
  using Copy = typename Cfg::Copy;
  constexpr int kRowsAtOnce = Copy::kSlots >= 32 ? 1 : 32 / Copy::kSlots;  // a warp's, per pass
  constexpr int kWarpRows = Cfg::kRowsPerThread * kRowsAtOnce;
  static_assert(kWarpRows <= 32, "a lane finds each of its warp's rows");
  const int warp_row0 = warp * 32 / Copy::kSlots;  // lane 0's copy_row0
  const int lane_slot = lane % kWarpRows;           // the warp's row this lane finds
  int lane_row = warp_row0 + lane_slot % kRowsAtOnce + lane_slot / kRowsAtOnce * Cfg::kRowStep;
  const int my_first_slot = copy_row0 - warp_row0;  // slot of this thread's first row
  // PackedKvCopy: each copy's tile row, its byte offsets (the K tile's in shared memory, the
  // chunk's in a pool row) and the lane that finds its row; the same every tile.
  int packed_row[Cfg::kPackedCopies];
  uint32_t packed_smem[Cfg::kPackedCopies], packed_chunk_bytes[Cfg::kPackedCopies];
  int packed_src[Cfg::kPackedCopies];
  if constexpr (Cfg::kPackedCopy) {
    using Packed = typename Cfg::Packed;
    lane_row = Packed::LaneRow(warp, lane);
#pragma unroll
    for (int i = 0; i < Cfg::kPackedCopies; ++i) {
      const int e = tid + i * Cfg::kThreads;
      const int row = e / Packed::kChunks, chunk = e % Packed::kChunks;
      packed_row[i] = row;
      packed_smem[i] = DecodeOffset<D>(row, chunk) * sizeof(T);
      packed_chunk_bytes[i] = chunk * 16;
      packed_src[i] = i * Packed::kPassRows + row - Packed::PassRow0(warp, i);
    }
  }
  // The thread's chunk of row 0 of each pool, in registers (opaque to the compiler, which
  // would otherwise add the pool's base to each address again): an address is then one
  // multiply-add.
  const int chunk_bytes = Cfg::kPackedCopy ? 0 : copy_chunk * 16;  // packed: per copy
  const char* k_bytes = static_cast<const char*>(p.k_cache) + chunk_bytes;
  const char* v_bytes = static_cast<const char*>(p.v_cache) + chunk_bytes;
  asm("" : "+l"(k_bytes), "+l"(v_bytes));
  constexpr uint32_t kRowBytes = D * sizeof(S);
  const uint32_t head_rows = static_cast<uint32_t>(kv_head * p.page_size);
  const uint32_t page_rows = static_cast<uint32_t>(p.num_kv_heads * p.page_size);
  // The lane's row of a tile: its page id (0 past the range) and its row within the page's
  // rows (the kv head's, then the position's).
  struct LaneRow {
    int id;
    uint32_t in_page;
  };
  // The item's first pages (AttachFirstPages), lane j holding page j: loaded beside the item, so
  // the first tiles' copies wait for no page-table load (docs/PERFORMANCE.md#design-decisions).
  const bool pages_attached = first_pages != nullptr;
  const int lane_first_page =
      pages_attached && lane < kItemPages ? first_pages[item_index].ids[lane] : 0;
  const uint32_t first_page = p.page_div.Div(item.kv_start);
  // from_item: the page id from the item's first pages (the prologue, when they hold its tiles'
  // pages: carry_first below), otherwise from the page table.
  auto fetch_pages = [&](int tile, LaneRow& rows, auto from_item) {
    const int pos = item.kv_start + tile * Cfg::kTileKv + lane_row;
    const bool valid = tile < num_tiles && pos < item.kv_end;
    const uint32_t page = p.page_div.Div(pos);
    if constexpr (decltype(from_item)::value) {
      const int carried = __shfl_sync(0xffffffffu, lane_first_page, (page - first_page) & 31);
      rows.id = valid ? carried : 0;
    } else {
      rows.id = valid ? pages[page] : 0;
    }
    rows.in_page = valid ? head_rows + (pos - page * p.page_size) : 0;
  };
  unsigned char* const stages = smem_raw;
  // FP8: whether rows carry scales (PER_TOKEN).
  const bool row_scales = Cfg::kFp8 && p.scales.k_rows != nullptr;
  // Where ptxas (CUDA 13.0, sm_90a) may address an evict-first copy [R+UR], with the shared
  // address's uniform part in UR, it misallocates the policy's descriptor register: an illegal
  // instruction at run time (tests/scripts/sass_descriptor_test.sh looks for it in every kernel).
  // The stage's address is kept out of uniform registers: a shuffle's result for the FP8 copies,
  // through an empty asm for the 16-bit ones: in each path the form that ptxas compiles right.
  const uint32_t fp8_stages_addr =
      Cfg::kFp8 ? __shfl_sync(0xffffffffu, SmemAddr(stages), lane) : 0;
  auto issue_tile = [&](int tile, const LaneRow& rows) {
    unsigned char* stage = stages + (tile % Cfg::kStages) * Cfg::kStageBytes;
    const uint32_t found = static_cast<uint32_t>(rows.id) * page_rows + rows.in_page;
    if constexpr (Cfg::kPackedCopy) {
      uint32_t pool_rows[Cfg::kPackedCopies];
#pragma unroll
      for (int i = 0; i < Cfg::kPackedCopies; ++i)
        pool_rows[i] = __shfl_sync(0xffffffffu, found, packed_src[i]);
      const int rows_left = item.kv_end - (item.kv_start + tile * Cfg::kTileKv);
      uint32_t sk = SmemAddr(stage);
      asm("" : "+r"(sk));
      const uint32_t sv = sk + Cfg::kTileElems * sizeof(T);
#pragma unroll
      for (int i = 0; i < Cfg::kPackedCopies; ++i) {
        const bool valid = packed_row[i] < rows_left;
        const uint64_t offset = uint64_t{pool_rows[i]} * kRowBytes + packed_chunk_bytes[i];
        CpAsync16Policy(sk + packed_smem[i], k_bytes + offset, valid, read_once);
        CpAsync16Policy(sv + packed_smem[i], v_bytes + offset, valid, read_once);
      }
    } else {
      uint32_t pool_rows[Cfg::kRowsPerThread];
#pragma unroll
      for (int i = 0; i < Cfg::kRowsPerThread; ++i)
        pool_rows[i] = __shfl_sync(0xffffffffu, found, i * kRowsAtOnce + my_first_slot);
      const int rows_left = item.kv_end - (item.kv_start + tile * Cfg::kTileKv);
      // FP8 PER_TOKEN: each row's K and V scales, copied by the lane that found the row (lanes
      // 0..kWarpRows-1 of the warps find each row of the tile once), zeros past the range.
      if constexpr (Cfg::kFp8) {
        if (row_scales && lane < kWarpRows) {
          float* scales = reinterpret_cast<float*>(stage + 2 * Cfg::kTileKv * D) + lane_row;
          const bool valid = lane_row < rows_left;
          CpAsync4(SmemAddr(scales), p.scales.k_rows + found, valid);
          CpAsync4(SmemAddr(scales + Cfg::kTileKv), p.scales.v_rows + found, valid);
        }
      }
      if (!copies) return;
#pragma unroll
      for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
        const int row = copy_row0 + i * Cfg::kRowStep;
        const bool valid = row < rows_left;
        const uint64_t offset = uint64_t{pool_rows[i]} * kRowBytes;
        if constexpr (Cfg::kFp8) {
          const uint32_t sk = fp8_stages_addr + (tile % Cfg::kStages) * Cfg::kStageBytes +
                              Fp8TileOffset<D>(row, copy_chunk);
          CpAsync16Policy(sk, k_bytes + offset, valid, read_once);
          CpAsync16Policy(sk + Cfg::kTileKv * D, v_bytes + offset, valid, read_once);
        } else {
          uint32_t sk = SmemAddr(stage);
          asm("" : "+r"(sk));
          const uint32_t sv = sk + Cfg::kTileElems * sizeof(T);
          const uint32_t smem_off = DecodeOffset<D>(row, copy_chunk) * sizeof(T);
          CpAsync16Policy(sk + smem_off, k_bytes + offset, valid, read_once);
          if constexpr (Cfg::kColSplit == 1) {
            CpAsync16Policy(sv + smem_off, v_bytes + offset, valid, read_once);
          } else if (v_chunk >= 0 && v_chunk < Cfg::kDv / 8) {  // the threads of V's columns
            CpAsync16Policy(sv + DecodeOffset<Cfg::kDv>(row, v_chunk) * sizeof(T),
                            v_bytes + offset, valid, read_once);
          }
        }
      }
    }
  };
  LaneRow next_rows;  // the lane's row of the next tile to issue
  // The copies of tile + kStages - 1 (one commit group, empty past the range), then the page ids
  // of the tile after it; and the wait until the next tile is in shared memory for every thread.
  auto issue_ahead = [&](int tile) {
    if (tile + Cfg::kStages - 1 < num_tiles) issue_tile(tile + Cfg::kStages - 1, next_rows);
    CpAsyncCommit();
    fetch_pages(tile + Cfg::kStages, next_rows, std::false_type{});
  };
  auto wait_for = [&] {
    CpAsyncWait<Cfg::kStages - 1>();
    __syncthreads();
  };
  auto stage_of = [&](int tile) -> const unsigned char* {
    return stages + (tile % Cfg::kStages) * Cfg::kStageBytes;
  };
  auto k_tile = [&](int tile) -> const T* {
    return reinterpret_cast<const T*>(stages + (tile % Cfg::kStages) * Cfg::kStageBytes);
  };
  auto v_tile = [&](int tile) -> const T* { return k_tile(tile) + Cfg::kTileElems; };

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
  if (carry_first) {
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      LaneRow rows;
      fetch_pages(s, rows, std::true_type{});
      if (s < num_tiles) issue_tile(s, rows);
      CpAsyncCommit();
    }
    fetch_pages(Cfg::kStages - 1, next_rows, std::true_type{});
  } else {
    LaneRow first_rows[Cfg::kStages - 1];
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) fetch_pages(s, first_rows[s], std::false_type{});
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      if (s < num_tiles) issue_tile(s, first_rows[s]);
      CpAsyncCommit();
    }
    fetch_pages(Cfg::kStages - 1, next_rows, std::false_type{});
  }

  // Q tile -> shared memory while those copies fly.
  LoadQTile<T, TIO, D, Cfg::kRows, Cfg::kThreads>(
      p, item, span, kv_head, group, span_rows, smem_q,
      [](int r, int chunk) { return DecodeOffset<D>(r, chunk); }, threadIdx.x);

  // ---- What every row path shares: the rows' visibility, the scores' unit, the scales.
  const Softcap softcap = Softcap::Of(p);
  const float scale_log2 = softcap.scale_log2;  // the scores' unit (capped: cap's)
  // FP8 read straight into fragments: the STATIC scales (PER_TOKEN: rows' own, in the stage).
  const float k_scale = fminf(p.scales.k, kMaxTileScale);
  const float v_scale = fminf(p.scales.v, kMaxTileScale);
  float* const q_scales = reinterpret_cast<float*>(smem_raw + Cfg::kQScaleOffset);
  // A stage's K row scales, then V's (read where row_scales: PER_TOKEN). Never null, so that
  // the step takes them as shared memory, not as a generic pointer tested for null a step.
  auto stage_scales = [&](int tile) -> const float* {
    return reinterpret_cast<const float*>(stage_of(tile) + 2 * Cfg::kTileKv * D);
  };
  // The tiles in order: at_first(), once the first tile is in; then step(tile, row0, pos0) for
  // each of the warp's 16-position steps that some row of the warp sees.
  auto run_tiles = [&](const DecodeRows& rows, auto&& at_first, auto&& step) {
    for (int tile = 0; tile < num_tiles; ++tile) {
      issue_ahead(tile);  // cp.async, kStages - 1 tiles ahead
      wait_for();
      if (tile == 0) {
        PAGEDATTN_TILE_STAMP(kFirstTileLanded);
        at_first();
      }
#pragma unroll
      for (int s = 0; s < Cfg::kSteps; ++s) {
        const int row0 = kv_warp * Cfg::kWarpKv + s * 16;  // first position row in the tile
        const int pos0 = item.kv_start + tile * Cfg::kTileKv + row0;
        if (pos0 >= item.kv_end || pos0 > rows.warp_max_pos || pos0 + 15 < rows.warp_min_first) {
          continue;  // warp-uniform: no row of the warp sees these 16 positions
        }
        step(tile, row0, pos0);
      }
      __syncthreads();  // the stage is overwritten by the next iteration's copies
    }
    CpAsyncWait<0>();
    PAGEDATTN_TILE_STAMP(kLastTileDone);
  };

  // ---- An FP8 tile of at most 8 live rows: the transposed step (DecodeFp8NarrowMath).
  // The narrow tile (RunsNarrowDecode): every block takes the transposed step.
  constexpr bool kNarrowOnly = Cfg::kNarrowTile;
  static_assert(!kNarrowOnly || kNarrowFp8Decode<Cfg, kRowWarps>, "the narrow tile's step");
  bool narrow = kNarrowOnly;
  if constexpr (kNarrowFp8Decode<Cfg, kRowWarps>) {
    if constexpr (!kNarrowOnly) {
      narrow = span_rows - item.row_start <= DecodeFp8NarrowMath<D>::kRows;  // block-uniform
    }
    if (narrow) {
      using Narrow = DecodeFp8NarrowMath<D>;
      // A lane's rows: 2 quad_col and 2 quad_col + 1.
      const DecodeRows rows =
          DecodeRowsOf(p, item, group, span_rows, first_q_pos, row_warp, 2 * quad_col, 1);
      typename Narrow::State state;
      state.Start();
      typename Narrow::VScales v_scales;
      float q_row_scale[2] = {1.f, 1.f};
      uint32_t q[D / 16][2];
      run_tiles(
          rows,
          [&] {
            DecodeFp8Math<D>::template QToHalf<Cfg::kRows, Cfg::kThreads, false>(smem_q, q_scales,
                                                                                 tid);
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 2; ++i) q_row_scale[i] = q_scales[2 * quad_col + i];
            Narrow::LoadQ(smem_q, lane, q);
          },
          [&](int tile, int row0, int pos0) {
            const unsigned char* stage = stage_of(tile);
            const float* scales = stage_scales(tile);
            float s[1][4] = {{0.f, 0.f, 0.f, 0.f}};
            Narrow::ScoreKQ(q, stage, row0, lane, s);                 // S^T = K.Q^T
            Narrow::ScaleK(s, scales, row_scales, k_scale, row0, quad_row);  // K's scales
            Narrow::MaskAndScale(s, pos0, item.kv_end, rows, quad_row, softcap, scale_log2,
                                 q_row_scale);  // Q's row scales with the log2 units
            Narrow::OnlineSoftmax(s, state);
            v_scales.Apply(s, scales + Cfg::kTileKv, row_scales, v_scale, row0, quad_row,
                           state);  // P^T times V's scales over the reference
            Narrow::AccumulatePV(s, stage + Cfg::kTileKv * D, row0, lane, state);  // O^T += V^T.P^T
          });
      v_scales.Finish(state.o);
      CombineKvWarpsAndWrite<TIO, Cfg, D, kKvWarps>(
          p, item, kv_head, group,
          [&](float* red_o, float* red_max, float* red_sum, int row_offset, int live_rows) {
            Narrow::StoreRows(state, red_o, red_max, red_sum, Cfg::kRedStride, row_offset,
                              live_rows, lane);
          },
          smem_raw, kv_warp, tid, col0);
    }
  }

  // ---- The 16-row step: rows quad_row and quad_row + 8 of this warp's 16.
  if (!narrow) {  // (never in the narrow tile: a constant there)
    DecodeState<Cfg::kDv> state;
    state.Start();
    const DecodeRows rows =
        DecodeRowsOf(p, item, group, span_rows, first_q_pos, row_warp, quad_row, 8);
    float q_row_scale[2] = {1.f, 1.f};  // 2^e of the thread's Q rows in float16 (QToHalf)
    typename DecodeFp8Math<D>::VScales v_scales;  // P's V scales

    // The warp's 16 Q rows as mma A fragments: in registers up to head_dim 128 (loaded before
    // the first tile's S), read again from shared memory (ldmatrix) at 256, where registers are
    // spent.
    const T* warp_q = smem_q + row_warp * 16 * Cfg::kRowElems;
    uint32_t q_frag[Cfg::kQInRegisters ? D / 16 : 1][4];
    auto load_q_frag = [&](int kc, uint32_t(&a)[4]) {
      const int r = (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4(a, SmemAddr(warp_q + DecodeOffset<D>(r, 2 * kc + (lane >> 4))));
    };
    auto load_any_q_frag = [&](int kc, uint32_t(&a)[4]) {
      if constexpr (Cfg::kFp8) {
        DecodeFp8Math<D>::LoadQFragment(warp_q, kc, lane, a);
      } else {
        load_q_frag(kc, a);
      }
    };
    auto q_fragment = [&](int kc, uint32_t(&a)[4]) {
      if constexpr (Cfg::kQInRegisters) {
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = q_frag[kc][j];
      } else {
        load_any_q_frag(kc, a);
      }
    };

    run_tiles(
        rows,
        [&] {
          if constexpr (Cfg::kFp8) {  // Q in float16 for S (DecodeFp8Math)
            DecodeFp8Math<D>::template QToHalf<Cfg::kRows, Cfg::kThreads>(smem_q, q_scales, tid);
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              q_row_scale[i] = q_scales[row_warp * 16 + quad_row + 8 * i];
            }
          }
          if constexpr (Cfg::kQInRegisters) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) load_any_q_frag(kc, q_frag[kc]);
          }
        },
        [&](int tile, int row0, int pos0) {
          float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
          if constexpr (Cfg::kFp8) {
            using Fp8Math = DecodeFp8Math<D>;
            const unsigned char* stage = stage_of(tile);
            const float* scales = stage_scales(tile);
            Fp8Math::ScoreQK(q_fragment, stage, row0, lane, s);  // S = Q.K^T, K as stored
            Fp8Math::Scale(s, scales, row_scales, k_scale, row0, quad_col);  // K's scales
            Math::MaskAndScale(s, pos0, item.kv_end, rows, quad_col, softcap, scale_log2,
                               q_row_scale);  // Q's row scales with the log2 units
            Math::OnlineSoftmax(s, state);
            v_scales.Apply(s, scales + Cfg::kTileKv, row_scales, v_scale, row0, quad_col,
                           state);  // P times V's scales over the reference
            Fp8Math::AccumulatePV(s, stage + Cfg::kTileKv * D, row0, lane, state);
          } else {
            Math::ScoreQK(q_fragment, k_tile(tile), row0, lane, s);  // S = Q.K^T
            Math::MaskAndScale(s, pos0, item.kv_end, rows, quad_col, softcap, scale_log2);
            Math::OnlineSoftmax(s, state);  // max, lazy rescale of O, exp2, row sums
            Math::AccumulatePV(s, v_tile(tile), row0, lane, state);  // O += P.V
          }
        });
    if constexpr (Cfg::kFp8) v_scales.Finish(state.o);

    CombineKvWarpsAndWrite<TIO, Cfg, D, kKvWarps>(
        p, item, kv_head, group,
        [&](float* red_o, float* red_max, float* red_sum, int row_offset, int live_rows) {
          StoreDecodeRows<Cfg, D>(state, red_o, red_max, red_sum, row_offset, live_rows, row_warp,
                                  lane);
        },
        smem_raw, kv_warp, tid, col0);
  }
  // A tile of several blocks merges in the separate merge kernel (AttentionPlanLimits::wide_head).
  if constexpr (Cfg::kColSplit == 1) {
    MergeIfLastSplit<TIO, D, DecodeMergeBatch(D, Cfg::kThreads)>(p, item, span, kv_head, group);
  }
  PAGEDATTN_TILE_STAMP(kTileExit);
#undef PAGEDATTN_TILE_STAMP
}

// ---- Kernels and launcher -----------------------------------------------------------------

// The work list of each decode tile shape, told apart by its number of 16-row warps.
template <int kRowWarps>
__host__ __device__ inline const AttentionWorkItem* DecodeItems(const PagedAttentionParams& p) {
  static_assert(kRowWarps == 1 || kRowWarps == 2, "decode tile shapes: 16 or 32 rows");
  return kRowWarps == 1 ? p.decode_items : p.decode_wide_items;
}
template <int kRowWarps>
__host__ __device__ inline const ItemFirstPages* DecodeFirstPages(const PagedAttentionParams& p) {
  return kRowWarps == 1 ? p.decode_first_pages : p.decode_wide_first_pages;
}
template <int kRowWarps>
inline int NumDecodeItems(const PagedAttentionParams& p) {
  return kRowWarps == 1 ? p.num_decode_items : p.num_decode_wide_items;
}

// TIO: q's and out's element type (float, or the cache's T).
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
__global__ void __launch_bounds__(128)
    DecodeTileKernel(const __grid_constant__ PagedAttentionParams params) {
  DecodeTileBody<T, TIO, D, kRowWarps, kKvWarps>(params, DecodeItems<kRowWarps>(params),
                                                 DecodeFirstPages<kRowWarps>(params));
}
// The same kernel held to at most 192 registers a thread, for the 16-row decode tile at head_dim
// 128 (two blocks an SM), so that a separate merge block (64 x 256) is resident beside two tile
// blocks and waits there (kernels/README.md#occupancy). DecodeKernel picks the one a shape uses.
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
__global__ void __maxnreg__(192)
    DecodeTileKernel192(const __grid_constant__ PagedAttentionParams params) {
  DecodeTileBody<T, TIO, D, kRowWarps, kKvWarps>(params, DecodeItems<kRowWarps>(params),
                                                 DecodeFirstPages<kRowWarps>(params));
}
// An FP8 cache's 16-row tile up to head_dim 128 (K and V straight into fragments, stages of half
// the bytes) at 168: three blocks an SM instead of two, 7% faster on the largest default shapes at
// 128 (docs/PERFORMANCE.md#design-decisions); at 96, where ptxas may take up to 175, 0.95x the
// time at 256 x 2048.
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
__global__ void __maxnreg__(168)
    DecodeTileKernel168(const __grid_constant__ PagedAttentionParams params) {
  DecodeTileBody<T, TIO, D, kRowWarps, kKvWarps>(params, DecodeItems<kRowWarps>(params),
                                                 DecodeFirstPages<kRowWarps>(params));
}
// A tile of two blocks (head_dim 512, SplitsColumns) as a cluster of two, so that both blocks
// always run at once and read each K row side by side: 0.92-0.97x the time of two blocks
// scheduled apart at 16 x 4096 and the three longest default shapes, the same DRAM bytes (4.30
// GB at 64 x 4096), DRAM 88% busy against 83% (docs/PERFORMANCE.md#design-decisions).
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
__global__ void __launch_bounds__(128) __cluster_dims__(2, 1, 1)
    DecodeTileKernelPair(const __grid_constant__ PagedAttentionParams params) {
  DecodeTileBody<T, TIO, D, kRowWarps, kKvWarps>(params, DecodeItems<kRowWarps>(params),
                                                 DecodeFirstPages<kRowWarps>(params));
}
// The narrow tile (RunsNarrowDecode): eight warps, two blocks an SM (at most 128 registers).
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
__global__ void __launch_bounds__(32 * kDecodeNarrowKvWarps, 2)
    DecodeTileKernelNarrow(const __grid_constant__ PagedAttentionParams params) {
  DecodeTileBody<T, TIO, D, kRowWarps, kKvWarps>(params, DecodeItems<kRowWarps>(params),
                                                 DecodeFirstPages<kRowWarps>(params));
}
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
constexpr auto DecodeKernel() {
  if constexpr (kKvWarps == kDecodeNarrowKvWarps) {
    return DecodeTileKernelNarrow<T, TIO, D, kRowWarps, kKvWarps>;
  } else if constexpr (DecodeTileBlocks(D) == 2) {
    return DecodeTileKernelPair<T, TIO, D, kRowWarps, kKvWarps>;
  } else if constexpr (D <= 128 && kRowWarps == 1 && kIsFp8<T>) {
    return DecodeTileKernel168<T, TIO, D, kRowWarps, kKvWarps>;
  } else if constexpr (D == 128 && kRowWarps == 1) {
    return DecodeTileKernel192<T, TIO, D, kRowWarps, kKvWarps>;
  } else {
    return DecodeTileKernel<T, TIO, D, kRowWarps, kKvWarps>;
  }
}

// then: a kernel to launch right after the tiles, programmatically dependent on them (the
// separate merge); null for none.
// T: the cache's element type as stored (__half, __nv_bfloat16, Fp8); TIO: float or TileType<T>.
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
LaunchStatus LaunchDecodeTiles(const PagedAttentionParams& params, cudaStream_t stream,
                               const KernelLaunch* then, Launcher& launcher) {
  using Cfg = DecodeTileConfig<T, D, kRowWarps, kKvWarps>;
  const int num_items = NumDecodeItems<kRowWarps>(params);
  if (num_items == 0) return LaunchStatus::Ok();
  if (Cfg::kColSplit > 1 && params.num_merge_tasks > 0 && !params.separate_merge) {
    return LaunchStatus::Unsupported("head_dim " + std::to_string(D) +
                                     ": split decode tiles merge in the separate merge kernel");
  }
  auto kernel = DecodeKernel<T, TIO, D, kRowWarps, kKvWarps>();
  size_t smem = Cfg::SmemBytes();
  static SmemLimitFlags smem_raised;
  if (LaunchStatus st = RaiseSmemLimitOnce(kernel, smem, smem_raised, "paged attention");
      !st.ok()) {
    return st;
  }
  // Fewer blocks an SM than fit (AttentionWork::decode_blocks_per_sm): the launch asks for as
  // much shared memory as leaves no room for one more.
  if (params.decode_blocks_per_sm > 0) {
    if (LaunchStatus st = SmemForBlocksPerSm(smem, params.decode_blocks_per_sm, &smem); !st.ok()) {
      return st;
    }
    static SmemLimitFlags fewer_raised;
    if (LaunchStatus st = RaiseSmemLimitOnce(kernel, smem, fewer_raised, "paged attention");
        !st.ok()) {
      return st;
    }
  }
  unsigned blocks = 0;
  if (LaunchStatus st = TileGridBlocks(int64_t{num_items} * Cfg::kColSplit, params.num_kv_heads,
                                       &blocks);
      !st.ok()) {
    return st;
  }
  const dim3 grid(blocks);
  if (then != nullptr) {
    const KernelLaunch tiles = {reinterpret_cast<const void*>(kernel), grid, dim3(Cfg::kThreads),
                                smem};
    return launcher.LaunchPair(tiles, *then, stream, &params, sizeof(params),
                               "paged attention and split-KV merge");
  }
  return launcher.Launch(kernel, grid, dim3(Cfg::kThreads), smem, stream, params,
                         "paged attention");
}

// Tile blocks of one decode kernel (q in TIO) an SM holds at once (resident), and how many of
// them leave room for one separate-merge block (beside_merge).
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
LaunchStatus DecodeKernelOccupancy(int* resident, int* beside_merge) {
  using Cfg = DecodeTileConfig<T, D, kRowWarps, kKvWarps>;
  auto kernel = DecodeKernel<T, TIO, D, kRowWarps, kKvWarps>();
  constexpr size_t smem = Cfg::SmemBytes();
  cudaFuncAttributes tile = {}, merge = {};
  int device = 0, regs_per_sm = 0;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, Cfg::kThreads, smem);
  }
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&tile, kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&merge, MergeSplitsKernel<TIO, D>);
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

// The decode tile's blocks an SM holds at once (resident), and how many of them leave room for
// one separate-merge block (beside_merge), whose blocks must be resident, waiting, before the
// tiles end (Launcher::LaunchPair): the planner counts the waves of a split plan in the second,
// of a plan without splits (no merge) in the first. Head_dim 128 holds two beside a merge block
// (<= 192 registers); head_dim 64's four fill the register file, so split plans count three
// (kernels/README.md#occupancy). The fewer of the kernels for q in float and in T: one plan
// serves either.
// Both 0 where the device's shared memory cannot hold either decode tile shape (a 512 tile on
// an A100): the planner then runs every span on prefill tiles.
template <typename T, int D, int kRowWarps, int kKvWarps>
LaunchStatus DecodeTileOccupancy(int* resident, int* beside_merge) {
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("shared memory per block: ") +
                                   cudaGetErrorString(err));
  }
  const size_t most = std::max(
      DecodeTileConfig<T, D, kDecodeRowWarps, kDecodeKvWarps>::SmemBytes(),
      DecodeTileConfig<T, D, kDecodeWideRowWarps, kDecodeWideKvWarps>::SmemBytes());
  if (most > static_cast<size_t>(optin)) {
    *resident = *beside_merge = 0;
    return LaunchStatus::Ok();
  }
  int resident_t = 0, beside_t = 0;
  if (LaunchStatus st =
          DecodeKernelOccupancy<T, float, D, kRowWarps, kKvWarps>(resident, beside_merge);
      !st.ok()) {
    return st;
  }
  if (LaunchStatus st =
          DecodeKernelOccupancy<T, TileType<T>, D, kRowWarps, kKvWarps>(&resident_t, &beside_t);
      !st.ok()) {
    return st;
  }
  *resident = std::min(*resident, resident_t);
  *beside_merge = std::min(*beside_merge, beside_t);
  return LaunchStatus::Ok();
}

// Explicit instantiation of both decode tile shapes for one (cache dtype, head_dim), with q in
// float and in the tiles' type (T; bfloat16 for an FP8 cache).
#define PAGEDATTN_INSTANTIATE_DECODE_Q(T, TIO, D)                                              \
  template LaunchStatus LaunchDecodeTiles<T, TIO, D, kDecodeRowWarps, kDecodeKvWarps>(         \
      const PagedAttentionParams&, cudaStream_t, const KernelLaunch*, Launcher&);              \
  template LaunchStatus LaunchDecodeTiles<T, TIO, D, kDecodeWideRowWarps, kDecodeWideKvWarps>( \
      const PagedAttentionParams&, cudaStream_t, const KernelLaunch*, Launcher&);
#define PAGEDATTN_INSTANTIATE_DECODE(T, D)          \
  PAGEDATTN_INSTANTIATE_DECODE_Q(T, float, D)       \
  PAGEDATTN_INSTANTIATE_DECODE_Q(T, TileType<T>, D) \
  template LaunchStatus DecodeTileOccupancy<T, D, kDecodeRowWarps, kDecodeKvWarps>(int*, int*);
// The narrow decode tile (HasNarrowDecodeTiles), q in float and in the tiles' type.
#define PAGEDATTN_INSTANTIATE_DECODE_NARROW(T, D)                                              \
  template LaunchStatus LaunchDecodeTiles<T, float, D, kDecodeRowWarps, kDecodeNarrowKvWarps>( \
      const PagedAttentionParams&, cudaStream_t, const KernelLaunch*, Launcher&);              \
  template LaunchStatus                                                                        \
  LaunchDecodeTiles<T, TileType<T>, D, kDecodeRowWarps, kDecodeNarrowKvWarps>(                 \
      const PagedAttentionParams&, cudaStream_t, const KernelLaunch*, Launcher&);

}  // namespace pagedattn::kernels
