// The Hopper prefill kernel's K/V copies (kernels/prefill_wgmma_kernel.cuh, IssueTileRows): for
// every thread of each copy layout the kernel uses (the producer warpgroup's, the per-item
// body's), each copy lands where Sw128Offset puts the row and 16-byte chunk it reads from the
// pool row, and the threads together write every chunk of a [kTileKv][D] tile exactly once
// (none past the row at head dims 80 and 96, whose tiles are 128 wide); the same for the TMA
// producer's boxes. Host only: runs wherever the CUDA backend builds.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/prefill_wgmma_kernel.cuh"

namespace pagedattn::kernels {
namespace {

template <int D, typename Copy, int kThreads>
void ExpectEveryChunkOnce(const std::string& layout) {
  using Cfg = WgmmaPrefillConfig<__nv_bfloat16, D>;
  constexpr int kTileKv = Cfg::kTileKv, kRowChunks = D / 8;
  constexpr int kSlices = CopySlices<Copy>();
  SCOPED_TRACE(layout + " at head_dim " + std::to_string(D));
  std::vector<int> writes(static_cast<size_t>(kTileKv) * kRowChunks, 0);
  for (int tid = 0; tid < kThreads; ++tid) {
    const int copy_chunk = tid % Copy::kSlots, copy_row0 = tid / Copy::kSlots;
    if (kSlices == 1 && copy_chunk >= Cfg::kChunks) continue;  // IssueTileRows' early return
    const int first = Sw128Offset<kTileKv>(copy_row0, copy_chunk);
    for (int sl = 0; sl < kSlices; ++sl) {
      for (int i = 0; i < Copy::kRowsPerThread; ++i) {
        const int row = copy_row0 + i * Copy::kRowStep;
        const int column = TileCopyColumn(copy_chunk, sl);
        ASSERT_LT(row, kTileKv) << "thread " << tid;
        ASSERT_EQ(column % 8, 0) << "thread " << tid;
        ASSERT_LT(column, D) << "thread " << tid << " copies past the row";
        const int lands = first + TileCopyStep<kTileKv, Copy>(sl, i);
        EXPECT_EQ(lands, Sw128Offset<kTileKv>(row, column / 8))
            << "thread " << tid << " slice " << sl << " copy " << i << ": row " << row
            << " chunk " << column / 8 << " lands elsewhere";
        ++writes[row * kRowChunks + column / 8];
      }
    }
  }
  for (int row = 0; row < kTileKv; ++row) {
    for (int chunk = 0; chunk < kRowChunks; ++chunk) {
      EXPECT_EQ(writes[row * kRowChunks + chunk], 1) << "row " << row << " chunk " << chunk;
    }
  }
}

template <int D>
void ExpectProducerCopies() {
  using Cfg = WgmmaPrefillConfig<__nv_bfloat16, D>;
  ExpectEveryChunkOnce<D, typename Cfg::ProducerCopy, Cfg::kProducerThreads>("producer");
}

TEST(PrefillCopyLayout, ProducerWritesEveryChunkOnce) {
  ExpectProducerCopies<80>();
  ExpectProducerCopies<96>();
  ExpectProducerCopies<128>();
  ExpectProducerCopies<192>();
  ExpectProducerCopies<256>();
}

TEST(PrefillCopyLayout, PerItemBodyWritesEveryChunkOnce) {
  using Cfg = WgmmaPrefillConfig<__nv_bfloat16, 64>;
  static_assert(!Cfg::kPersistent, "head_dim 64 runs one block a job");
  ExpectEveryChunkOnce<64, Cfg::Copy, Cfg::kThreads>("per-item body");
}

// The TMA producer's boxes (ProduceKvTma): every box size the launcher picks, each element of
// each box where TMA's 128-byte swizzle puts it (the 16-byte chunk bits of its linear shared
// address XORed with the 128-byte row bits) is where Sw128Offset puts the tile's row and chunk,
// and the boxes write each chunk of the tile once.
template <int D>
void ExpectTmaBoxes() {
  using Cfg = WgmmaPrefillConfig<__nv_bfloat16, D>;
  constexpr int kTileKv = Cfg::kTileKv, kWidthChunks = Cfg::kSlices * 8;
  for (int box_rows = kTmaMinBoxRows; box_rows <= kTileKv; box_rows *= 2) {
    SCOPED_TRACE("head_dim " + std::to_string(D) + ", boxes of " + std::to_string(box_rows));
    std::vector<int> writes(static_cast<size_t>(kTileKv) * kWidthChunks, 0);
    for (int slice = 0; slice < Cfg::kSlices; ++slice) {
      for (int box = 0; box < kTileKv / box_rows; ++box) {
        const int base = TmaBoxOffset<kTileKv>(slice, box, box_rows) * 2;  // bytes
        ASSERT_EQ(base % 1024, 0) << "slice " << slice << " box " << box;
        for (int r = 0; r < box_rows; ++r) {
          for (int c = 0; c < 8; ++c) {
            const int linear = base + r * 128 + c * 16;
            const int swizzled = linear ^ (((linear >> 7) & 7) << 4);
            const int row = box * box_rows + r, chunk = slice * 8 + c;
            EXPECT_EQ(swizzled, Sw128Offset<kTileKv>(row, chunk) * 2)
                << "slice " << slice << " box " << box << " row " << r << " chunk " << c;
            ++writes[row * kWidthChunks + chunk];
          }
        }
      }
    }
    for (int i = 0; i < kTileKv * kWidthChunks; ++i) EXPECT_EQ(writes[i], 1) << "chunk " << i;
  }
}

TEST(PrefillCopyLayout, TmaBoxesLandAsTheSwizzleSays) {
  ExpectTmaBoxes<80>();
  ExpectTmaBoxes<96>();
  ExpectTmaBoxes<128>();
  ExpectTmaBoxes<192>();
  ExpectTmaBoxes<256>();
}

// Page sizes in TMA boxes of their largest power-of-two factor, at most a tile; the rest (no
// factor 8, a window) copied by rows.
TEST(PrefillCopyLayout, TmaBoxRowsFollowThePageSize) {
  EXPECT_EQ(PrefillTmaBoxRows(16, 0, 128), 16);
  EXPECT_EQ(PrefillTmaBoxRows(8, 0, 128), 8);
  EXPECT_EQ(PrefillTmaBoxRows(48, 0, 128), 16);
  EXPECT_EQ(PrefillTmaBoxRows(1024, 0, 128), 128);
  EXPECT_EQ(PrefillTmaBoxRows(1024, 0, 64), 64);
  for (int page : {1, 3, 4, 7, 12, 100}) EXPECT_EQ(PrefillTmaBoxRows(page, 0, 128), 0) << page;
  EXPECT_EQ(PrefillTmaBoxRows(16, 4096, 128), 0);
  EXPECT_EQ(PrefillTmaBoxRows(0, 0, 128), 0);
}

}  // namespace
}  // namespace pagedattn::kernels
