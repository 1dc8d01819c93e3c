// The Hopper prefill kernel's K/V copies (kernels/prefill_wgmma_kernel.cuh, IssueTileRows): for
// every thread of each copy layout the kernel uses (the producer warpgroup's, the per-item
// body's), each copy lands where Sw128Offset puts the row and 16-byte chunk it reads from the
// pool row, and the threads together write every chunk of a [kTileKv][D] tile exactly once
// (none past the row at head dims 80 and 96, whose tiles are 128 wide). Host only: runs
// wherever the CUDA backend builds.
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

}  // namespace
}  // namespace pagedattn::kernels
