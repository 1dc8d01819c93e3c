// The decode tile kernels (16 rows, and 32 for wide GQA groups): the warps' combine, the device
// body, the thin __global__ wrappers and the host launcher. Their configuration is in
// decode_config.cuh, a warp's step in decode_math.cuh (16-bit caches) and decode_fp8_math.cuh.
//
// Included by the per-head-dim instantiation files (and kernels/bench/profile_check.cu). A block
// takes one work item: up to kRowWarps * 16 query rows (row = query * group + head in group, all of
// one kv head) against a KV range, streamed through a cp.async pipeline of 64-position tiles (128
// for an FP8 cache at head dims up to 128) gathered through the page table. S = Q.K^T and O += P.V
// run on tensor cores (mma.m16n8k16, f32 accumulators) with an online softmax between them. The
// kKvWarps warps that share a row slice split each KV tile and combine their softmax states at the
// end, so each K/V byte is read once for every head of its GQA group. An FP8 cache's tiles are
// copied as stored (half the bytes) and DecodeFp8Math reads them straight into float16 fragments; a
// block of at most 8 rows takes the step transposed (DecodeFp8NarrowMath). Where every 16-row tile
// of a launch has at most 8 rows, an FP8 cache's tiles may run as the narrow tile: eight warps on
// the KV tile, the transposed step alone (RunsNarrowDecode).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/decode_config.cuh"
#include "kernels/decode_fp8_math.cuh"
#include "kernels/decode_math.cuh"
#include "kernels/device/dtype.cuh"
#include "kernels/device/profile.cuh"
#include "kernels/device/ptx.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

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
// kPairMerge (DecodeTileKernelNarrowPair): the block and the other of its cluster are a tile's
// two splits; the (row, 4 dims) elements of the tile are dealt over both blocks' threads, first
// block first (a narrow tile's 8 rows of up to 128 dims fill its 256 threads, so the other only
// waits), each combining both blocks' warps, the other's read from its shared memory, and
// writing them finished: no partials, no merge after.
template <typename TIO, typename Cfg, int D, int kKvWarps, bool kPairMerge = false,
          typename StoreRows>
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
  // The warps' states of each source block: this block's, and with kPairMerge the other's.
  constexpr int kSources = kPairMerge ? 2 : 1;
  const float* src_o[kSources];
  const float* src_max[kSources];
  const float* src_sum[kSources];
  int first_e = tid, e_step = Cfg::kThreads;
  if constexpr (kPairMerge) {
    // Both blocks' states stored and visible cluster-wide; the other's read in place.
    const unsigned rank = ClusterRank();
    ClusterSync();
    first_e += static_cast<int>(rank) * Cfg::kThreads;
    e_step *= 2;
    for (int b = 0; b < 2; ++b) {
      const unsigned from = rank ^ static_cast<unsigned>(b);
      src_o[b] = ClusterPeerPointer(red_o, from);
      src_max[b] = ClusterPeerPointer(red_max, from);
      src_sum[b] = ClusterPeerPointer(red_sum, from);
    }
  } else {
    __syncthreads();
    src_o[0] = red_o;
    src_max[0] = red_max;
    src_sum[0] = red_sum;
  }
  // Rows finished here: an unsplit tile's, or a pair's.
  const bool finished = kPairMerge || item.partial_row < 0;
  constexpr int kQuads = DV / 4;
  for (int e = first_e; e < live_rows * kQuads; e += e_step) {
    const int r = e / kQuads, c = (e % kQuads) * 4;
    float m = -INFINITY;
#pragma unroll
    for (int b = 0; b < kSources; ++b)
#pragma unroll
      for (int w = 0; w < kKvWarps; ++w) m = fmaxf(m, src_max[b][w * Cfg::kRows + r]);
    const float base = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int b = 0; b < kSources; ++b)
#pragma unroll
      for (int w = 0; w < kKvWarps; ++w) {
        const float f = exp2f(src_max[b][w * Cfg::kRows + r] - base);
        sum += src_sum[b][w * Cfg::kRows + r] * f;
        const float4 v =
            *reinterpret_cast<const float4*>(src_o[b] + (w * Cfg::kRows + r) * Cfg::kRedStride + c);
        acc.x += v.x * f;
        acc.y += v.y * f;
        acc.z += v.z * f;
        acc.w += v.w * f;
      }
    // A sink joins the row's softmax once, where the row is finished: here for an unsplit tile
    // or a pair, in the merge for a split one.
    const float sink = finished ? SinkLog2(p, kv_head, group, item.row_start + r) : -INFINITY;
    const RowNorm norm = NormalizeRow(sum, base, sink);
    const float inv = norm.inv, lse = norm.lse;
    const bool writes_lse = c == 0 && col0 == 0;
    if constexpr (!std::is_same_v<TIO, float>) {  // out in the cache's type: 4 values, 8 bytes
      if (finished) {
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
                          lse_dst, finished);
    *reinterpret_cast<float4*>(dst + col0 + c) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (lse_dst && writes_lse) *lse_dst = lse;
  }
  // The other block's states stay until this block has read them.
  if constexpr (kPairMerge) ClusterSync();
}

// ---- Device body --------------------------------------------------------------------------

// kPairMerge: DecodeTileKernelNarrowPair's, a tile's two splits a cluster
// (AttentionWork::pair_merge).
template <typename S, typename TIO, int D, int kRowWarps, int kKvWarps, bool kPairMerge = false>
__device__ __forceinline__ void DecodeTileBody(const PagedAttentionParams& p,
                                               const AttentionWorkItem* items,
                                               const ItemFirstPages* first_pages) {
  using Cfg = DecodeTileConfig<S, D, kRowWarps, kKvWarps>;
  static_assert(!kPairMerge || Cfg::kNarrowTile, "pairs merge in the narrow tile");
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
  // A pair launch's blocks 2u and 2u + 1 are items 2i and 2i + 1 (a tile's two splits) of one kv
  // head, the pairs in item-major order.
  const ItemMajorBlock block =
      kPairMerge ? PairMajorAt(p, blockIdx.x) : ItemMajorAt(p, blockIdx.x / Cfg::kColSplit);
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
  // A column past the row (head_dim 192, and 80 and 96 on an FP8 cache; a 16-bit cache's 80 and
  // 96 copy as PackedKvCopy, every thread).
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
      CombineKvWarpsAndWrite<TIO, Cfg, D, kKvWarps, kPairMerge>(
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
    // the first tile's S), read again from shared memory (ldmatrix) above 128 (192, 256, 512),
    // where registers are spent.
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
  if constexpr (Cfg::kColSplit == 1 && !kPairMerge) {
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
// The narrow tile of a pair-merge plan (AttentionWork::pair_merge): a tile's two splits as a
// cluster of two, merged through each other's shared memory at the end (CombineKvWarpsAndWrite)
// rather than through partials in L2, a fence, a count and the last split's reads.
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
__global__ void __launch_bounds__(32 * kDecodeNarrowKvWarps, 2) __cluster_dims__(2, 1, 1)
    DecodeTileKernelNarrowPair(const __grid_constant__ PagedAttentionParams params) {
  DecodeTileBody<T, TIO, D, kRowWarps, kKvWarps, true>(params, DecodeItems<kRowWarps>(params),
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
  // A pair-merge plan's narrow tiles: each tile's two splits a cluster (AttentionWork::pair_merge;
  // the items come in pairs). Each kernel raises its own shared-memory limits.
  bool pairs = false;
  if constexpr (Cfg::kNarrowTile) {
    pairs = params.pair_merge && !params.separate_merge && num_items % 2 == 0;
    if (pairs) kernel = DecodeTileKernelNarrowPair<T, TIO, D, kRowWarps, kKvWarps>;
  }
  size_t smem = Cfg::SmemBytes();
  static SmemLimitFlags smem_raised, pair_smem_raised;
  if (LaunchStatus st = RaiseSmemLimitOnce(kernel, smem, pairs ? pair_smem_raised : smem_raised,
                                           "paged attention");
      !st.ok()) {
    return st;
  }
  // Fewer blocks an SM than fit (AttentionWork::decode_blocks_per_sm): the launch asks for as
  // much shared memory as leaves no room for one more.
  if (params.decode_blocks_per_sm > 0) {
    if (LaunchStatus st = SmemForBlocksPerSm(smem, params.decode_blocks_per_sm, &smem); !st.ok()) {
      return st;
    }
    static SmemLimitFlags fewer_raised, pair_fewer_raised;
    if (LaunchStatus st = RaiseSmemLimitOnce(kernel, smem, pairs ? pair_fewer_raised : fewer_raised,
                                             "paged attention");
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
