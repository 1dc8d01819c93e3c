// The decode tiles' configuration: pipeline depth and positions a stage by head dim, the
// shared-memory row layout (DecodeOffset), the copy layouts and DecodeTileConfig.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "kernels/device/dtype.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

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
// would leave two), 3 at 192 and 256 (two blocks an SM; the 32-row tile one at 256).
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

}  // namespace pagedattn::kernels
