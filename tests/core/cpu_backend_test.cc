// CPU backend attention against the float64 reference, through Cache::Forward: page sizes,
// head dims, GQA ratios, ragged prefill / chunked prefill / decode mixes, causal or not,
// sm_scale and LSE, float32 and bfloat16.
#include <gtest/gtest.h>

#include <tuple>

#include "server/core/cpu_backend.h"
#include "tests/test_util.h"

namespace pagedattn {
namespace {

using testing::ForwardModel;
using testing::MakeGeometry;
using testing::ToleranceFor;

CpuBackend& SharedBackend() {
  static CpuBackend* backend = new CpuBackend();
  return *backend;
}

std::unique_ptr<Cache> MakeCache(const CacheGeometry& g) {
  auto pool = SharedBackend().AllocatePool(g, StopToken());
  EXPECT_TRUE(pool.ok());
  return std::make_unique<Cache>("test", "", "", g, *std::move(pool), &SharedBackend(), 0);
}

void ExpectClose(const ForwardModel::Outcome& o, DType io, const std::string& what) {
  ASSERT_TRUE(o.status.ok()) << what << ": " << o.status;
  EXPECT_FALSE(o.any_nan) << what;
  EXPECT_LE(o.max_rel_error, ToleranceFor(io)) << what;
  EXPECT_LE(o.max_lse_error, 10 * ToleranceFor(io)) << what;
}

// (page_size, head_dim, gqa ratio)
class CpuAttentionSweep : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(CpuAttentionSweep, RaggedMixedBatchesMatchReference) {
  const auto [page, dim, gqa] = GetParam();
  const int hkv = 2;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    CacheGeometry g = MakeGeometry(2, hkv * gqa, hkv, dim, page, dtype, /*pages=*/600 / page + 40);
    auto cache = MakeCache(g);
    ForwardModel model(g, dtype, /*seed=*/page * 1000 + dim + gqa);
    const std::string what =
        absl::StrCat("page ", page, " dim ", dim, " gqa ", gqa, " ", DTypeName(dtype));
    // Prefills of ragged lengths (one not a multiple of anything, one of a single token).
    ExpectClose(model.Run(*cache, 0, {{1, 0, 37, 37}, {2, 0, 1, 1}, {3, 0, 70, 70}}), dtype,
                what + " prefill");
    // Decode, chunked prefill and a fresh prefill in one batch.
    ExpectClose(model.Run(*cache, 0, {{1, 37, 1, 1}, {2, 1, 50, 50}, {4, 0, 9, 9}}), dtype,
                what + " mixed");
    // Non-causal with a custom scale; a span attending the cache only.
    ExpectClose(model.Run(*cache, 0, {{3, 70, 5, 5}, {1, 38, 0, 3}}, /*causal=*/false, 0.05f),
                dtype, what + " non-causal");
    // The other layer, with queries fewer than new tokens (chunk end only).
    ExpectClose(model.Run(*cache, 1, {{1, 0, 40, 4}, {2, 0, 3, 0}}), dtype, what + " layer 1");
  }
}

INSTANTIATE_TEST_SUITE_P(PageDimGqa, CpuAttentionSweep,
                         ::testing::Combine(::testing::Values(1, 3, 16, 32, 256),
                                            ::testing::Values(64, 128, 256),
                                            ::testing::Values(1, 4, 8)),
                         [](const auto& info) {
                           return absl::StrCat("page", std::get<0>(info.param), "_dim",
                                               std::get<1>(info.param), "_gqa",
                                               std::get<2>(info.param));
                         });

TEST(CpuAttentionTest, Float16CacheWithFloat32Io) {
  CacheGeometry g = MakeGeometry(1, 8, 2, 128, 16, DType::kFloat16, 64);
  auto cache = MakeCache(g);
  // The model rounds K/V through the cache dtype, so the output is float32-accurate.
  ForwardModel model(g, DType::kFloat32, 7);
  ExpectClose(model.Run(*cache, 0, {{1, 0, 100, 100}, {2, 0, 33, 1}}), DType::kFloat32,
              "f16 cache");
}

TEST(CpuAttentionTest, OddGqaRatios) {
  for (const auto& [hq, hkv] :
       std::vector<std::pair<int, int>>{{28, 4}, {40, 8}, {12, 4}, {6, 1}}) {
    CacheGeometry g = MakeGeometry(1, hq, hkv, 64, 7, DType::kBFloat16, 64);
    auto cache = MakeCache(g);
    ForwardModel model(g, DType::kFloat32, hq);
    const std::string what = absl::StrCat(hq, "/", hkv);
    ExpectClose(model.Run(*cache, 0, {{1, 0, 45, 45}, {2, 0, 9, 1}}), DType::kFloat32, what);
    ExpectClose(model.Run(*cache, 0, {{1, 45, 3, 3}, {2, 9, 1, 1}}), DType::kFloat32, what);
  }
}

TEST(CpuAttentionTest, LongSequenceDecode) {
  CacheGeometry g = MakeGeometry(1, 8, 1, 64, 16, DType::kBFloat16, 700);
  auto cache = MakeCache(g);
  ForwardModel model(g, DType::kFloat32, 11);
  ExpectClose(model.Run(*cache, 0, {{1, 0, 10000, 0}}), DType::kFloat32, "10k append");
  ExpectClose(model.Run(*cache, 0, {{1, 10000, 1, 1}}), DType::kFloat32, "10k decode");
}

}  // namespace
}  // namespace pagedattn
