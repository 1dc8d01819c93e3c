// The FP8 decode tile's Q layout (kernels/decode_fp8_math.cuh, DecodeFp8Math): where QToHalf puts
// each pair of Q's dims in fragment order, checked against the mma.m16n8k16 A fragment as PTX
// defines it (register j of lane 4g + t: row g + 8 (j % 2), k slots 2t + 8 (j / 2), + 1) and
// the FP8 tiles' k order (slots 2t, 2t + 1 hold dims 4t, 4t + 1; slots 2t + 8, 2t + 9 dims
// 4t + 2, 4t + 3), read as LoadQFragment reads it: k step kc of the warp's 16 rows, a lane's
// 16-byte word. Host only: runs wherever the CUDA backend builds.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/decode_fp8_math.cuh"

namespace pagedattn::kernels {
namespace {

template <int D>
void ExpectFragmentOrder(int rows) {
  using Math = DecodeFp8Math<D>;
  static_assert(Math::kFragmentOrderQ, "a head dim whose Q is in fragment order");
  // Every pair of dims of every row takes its own word of the tile.
  std::vector<int> held(static_cast<size_t>(rows) * D / 2, -1);  // row * D + first dim
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < D; d += 2) {
      const int w = Math::FragmentWord(r, d);
      ASSERT_GE(w, 0);
      ASSERT_LT(w, static_cast<int>(held.size())) << "row " << r << " dim " << d;
      ASSERT_EQ(held[w], -1) << "row " << r << " dim " << d << " on a word already taken";
      held[w] = r * D + d;
    }
  }
  for (int warp = 0; warp < rows / 16; ++warp) {
    for (int kc = 0; kc < D / 16; ++kc) {
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < 4; ++j) {
          const int g = lane / 4, t = lane % 4;
          const int row = warp * 16 + g + 8 * (j % 2);
          const int slot = 2 * t + 8 * (j / 2);
          const int dim = 16 * kc + (slot < 8 ? 4 * (slot / 2) : 4 * ((slot - 8) / 2) + 2);
          const int word = ((warp * (D / 16) + kc) * 32 + lane) * 4 + j;
          EXPECT_EQ(held[word], row * D + dim)
              << "D " << D << ", warp " << warp << ", k step " << kc << ", lane " << lane
              << ", register " << j;
        }
      }
    }
  }
}

TEST(DecodeFp8Layout, QWordsAreTheMmaAFragments) {
  for (int rows : {16, 32}) {  // the 16-row tile and the 32-row (kRowWarps 2)
    SCOPED_TRACE(rows);
    ExpectFragmentOrder<64>(rows);
    ExpectFragmentOrder<80>(rows);
    ExpectFragmentOrder<96>(rows);
    ExpectFragmentOrder<192>(rows);
    ExpectFragmentOrder<256>(rows);
  }
}

}  // namespace
}  // namespace pagedattn::kernels
