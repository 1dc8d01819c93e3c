// CPU backend attention against the float64 reference, through Cache::Forward: page sizes,
// head dims, GQA ratios, ragged prefill / chunked prefill / decode mixes, causal or not,
// sm_scale and LSE, float32 and bfloat16.
#include "server/core/cpu_backend.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <tuple>

#include "tests/fp8_sweep.h"
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
                                            ::testing::Values(64, 80, 96, 128, 192, 256, 512),
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

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // their shadow memory does not run under RLIMIT_AS
#else
constexpr bool kSanitized = false;
#endif

// The process's address space now (/proc/self/statm's first field, in pages).
int64_t AddressSpaceBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return int64_t{pages} * sysconf(_SC_PAGESIZE);
}

// A decode whose working copies (a 32k-token sequence's K and V in float: 128 MiB) the process
// cannot have is RESOURCE_EXHAUSTED, the cache unchanged, the server's process alive (it
// aborted: std::bad_alloc on a worker thread); with the memory back, the same decode runs.
// Run in a child process (its address space limited by RLIMIT_AS).
TEST(CpuAttentionTest, AForwardWithoutMemoryIsResourceExhausted) {
  if (kSanitized) GTEST_SKIP() << "RLIMIT_AS and a sanitizer's shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        CpuBackendOptions options;
        options.num_threads = 2;
        CpuBackend backend(options);
        const CacheGeometry g = MakeGeometry(1, 8, 1, 512, 64, DType::kFloat32, 520);
        Cache cache("c", "", "", g, *backend.AllocatePool(g, StopToken()), &backend, 0);
        ForwardModel model(g, DType::kFloat32, 3);
        if (!model.Run(cache, 0, {{1, 0, 32768, 0}}).status.ok()) std::_Exit(2);
        const int64_t used = cache.Stats().used_pages;
        rlimit old{};
        getrlimit(RLIMIT_AS, &old);
        rlimit tight = old;
        tight.rlim_cur = static_cast<rlim_t>(AddressSpaceBytes() + (48 << 20));
        setrlimit(RLIMIT_AS, &tight);
        const ForwardModel::Outcome refused = model.Run(cache, 0, {{1, 32768, 1, 1}});
        setrlimit(RLIMIT_AS, &old);
        if (refused.status.code() != absl::StatusCode::kResourceExhausted) {
          std::fprintf(stderr, "got %s\n", refused.status.ToString().c_str());
          std::_Exit(3);
        }
        if (cache.Stats().used_pages != used) std::_Exit(4);
        const ForwardModel::Outcome ran = model.Run(cache, 0, {{1, 32768, 1, 1}});
        if (!ran.status.ok() || ran.max_rel_error > 1e-5) std::_Exit(5);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// Layer attention variants (CacheConfig.layers) against the reference: each option alone and
// all combined, on pages {1, 7, 16, 128} and GQA {1, 4, 5, 8}; prefill, chunked prefill,
// decode and mixed batches; windows shorter and longer than a page, sequences shorter and
// longer than the window. Layer 1 of every cache stays plain (the per-layer table).
struct VariantCase {
  const char* name;
  int32_t window;
  float softcap;
  bool sinks;
};

class CpuVariantSweep : public ::testing::TestWithParam<std::tuple<VariantCase, int, int>> {
};  // page, gqa

TEST_P(CpuVariantSweep, MatchesReference) {
  const auto [variant, page, gqa] = GetParam();
  const int hkv = gqa == 5 ? 1 : 2;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    constexpr int kDims[] = {64, 80, 96, 192, 512};  // 128 and 256: the sweep above
    const int dim = kDims[(page + gqa) % 5];
    CacheGeometry g = MakeGeometry(2, hkv * gqa, hkv, dim, page, dtype, /*pages=*/900 / page + 60);
    LayerAttention a;
    a.sliding_window = variant.window;
    a.logit_softcap = variant.softcap;
    for (int h = 0; variant.sinks && h < g.num_q_heads; ++h) a.sinks.push_back(0.5f * h - 1.f);
    g.layers = {a, LayerAttention{}};
    auto cache = MakeCache(g);
    ForwardModel model(g, dtype, /*seed=*/page * 100 + gqa);
    const std::string what =
        absl::StrCat(variant.name, " page ", page, " gqa ", gqa, " ", DTypeName(dtype));
    // Prefills: shorter than the window, longer, one token.
    ExpectClose(model.Run(*cache, 0, {{1, 0, 5, 5}, {2, 0, 70, 70}, {3, 0, 1, 1}}), dtype,
                what + " prefill");
    // Decode, chunked prefill across the window, a fresh prefill, in one batch.
    ExpectClose(model.Run(*cache, 0, {{1, 5, 1, 1}, {2, 70, 40, 40}, {4, 0, 9, 9}}), dtype,
                what + " mixed");
    // Decode far past the window; attend-only; a rewind.
    ExpectClose(model.Run(*cache, 0, {{2, 110, 1, 1}, {3, 1, 0, 1}, {1, 3, 2, 2}}), dtype,
                what + " decode");
    // Non-causal with a custom scale.
    ExpectClose(model.Run(*cache, 0, {{4, 9, 3, 3}}, /*causal=*/false, 0.3f), dtype,
                what + " non-causal");
    // The plain layer beside it.
    ExpectClose(model.Run(*cache, 1, {{1, 0, 40, 40}}), dtype, what + " plain layer");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, CpuVariantSweep,
    ::testing::Combine(::testing::Values(VariantCase{"window4", 4, 0.f, false},
                                         VariantCase{"window33", 33, 0.f, false},
                                         VariantCase{"softcap", 0, 2.f, false},
                                         VariantCase{"sinks", 0, 0.f, true},
                                         VariantCase{"all", 20, 5.f, true}),
                       ::testing::Values(1, 7, 16, 128), ::testing::Values(1, 4, 5, 8)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_page", std::get<1>(info.param), "_gqa",
                          std::get<2>(info.param));
    });

// The options change the answer (a test that passed with them ignored would prove nothing):
// the same Forward on a plain cache and on a windowed / capped / sunk one differ.
TEST(CpuAttentionTest, EachOptionChangesTheAnswer) {
  auto run = [](const LayerAttention& a) {
    CacheGeometry g = MakeGeometry(1, 4, 2, 64, 16, DType::kFloat32, 64);
    if (!a.plain()) g.layers = {a};
    auto cache = MakeCache(g);
    ForwardModel model(g, DType::kFloat32, 3);
    ForwardModel::Outcome o = model.Run(*cache, 0, {{1, 0, 50, 50}}, true, 1.0f);
    EXPECT_TRUE(o.status.ok());
    EXPECT_LE(o.max_rel_error, 1e-5);
    return o.result.out;
  };
  const std::string plain = run({});
  LayerAttention window, softcap, sinks;
  window.sliding_window = 8;
  softcap.logit_softcap = 1.f;
  sinks.sinks = {3.f, 3.f, 3.f, 3.f};
  EXPECT_NE(run(window), plain);
  EXPECT_NE(run(softcap), plain);
  EXPECT_NE(run(sinks), plain);
}

// ---- FP8 E4M3 caches ----------------------------------------------------------------------

// The conversion over all 256 codes and the edges: every finite code reads back and converts to
// itself, halfway values go to the even code, values past 448 (and infinities) saturate, NaN
// stays NaN, and nothing finite becomes NaN.
TEST(Fp8Test, E4m3RoundsToNearestEvenAndSaturates) {
  for (int code = 0; code < 256; ++code) {
    const float x = E4m3ToFloat(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << code;
      continue;
    }
    EXPECT_EQ(FloatToE4m3(x), code == 0x80 ? 0x80 : code) << code << " " << x;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.f);
  EXPECT_EQ(E4m3ToFloat(0x01), 0.001953125f);           // the smallest subnormal, 2^-9
  EXPECT_EQ(FloatToE4m3(1.0625f), FloatToE4m3(1.f));    // halfway to 1.125: to even (1.0)
  EXPECT_EQ(FloatToE4m3(1.1875f), FloatToE4m3(1.25f));  // halfway 1.125..1.25: to even (1.25)
  EXPECT_EQ(FloatToE4m3(0.0029296875f), 0x02);          // 1.5 subnormal steps: to 2
  for (float big : {449.f, 464.f, 1e6f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToE4m3(big), 0x7e) << big;
    EXPECT_EQ(FloatToE4m3(-big), 0xfe) << big;
  }
  EXPECT_TRUE(std::isnan(E4m3ToFloat(FloatToE4m3(std::numeric_limits<float>::quiet_NaN()))));
}

// A capped layer's scores scale by sm_scale / cap, at most 2^21: a Forward whose sm_scale takes
// it past is refused naming sm_scale and its largest value; at the bound it answers.
TEST(CpuAttentionTest, SmScaleOverASoftcapIsBounded) {
  CacheGeometry g = MakeGeometry(1, 4, 2, 64, 16, DType::kBFloat16, 8);
  LayerAttention capped;
  capped.logit_softcap = 0.5f;
  g.layers = {capped};
  std::unique_ptr<Cache> cache = MakeCache(g);
  ForwardModel m(g, DType::kFloat32, 9);
  ForwardModel::Outcome o = m.Run(*cache, 0, {{1, 0, 8, 8}}, true, 0.5f * kMaxSoftcapScale * 2);
  ASSERT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument) << o.status;
  EXPECT_NE(o.status.message().find("options.sm_scale="), std::string::npos) << o.status;
  EXPECT_NE(o.status.message().find("use an sm_scale of at most 1.04858e+06"), std::string::npos)
      << o.status;
  o = m.Run(*cache, 0, {{1, 0, 8, 8}}, true, 0.5f * kMaxSoftcapScale);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_FALSE(o.any_nan);
}

// A PER_TOKEN row whose largest magnitude is under kFp8MinRowMax is stored as zeros of scale 1:
// its inverse (448 / max) past float's range stored NaN for its zeros (0 * inf). STATIC's
// smallest scale keeps a finite inverse. Through a cache: rows of 1e-40 with every other
// channel exactly zero answer without NaN.
TEST(Fp8Test, RowsTooSmallForAScaleAreStoredAsZeros) {
  for (float max_abs : {1e-40f, 1e-37f, 0x1p-120f}) {
    const Fp8RowScale s = Fp8RowScale::OfMax(max_abs);
    EXPECT_EQ(s.scale, 1.f) << max_abs;
    EXPECT_EQ(FloatToE4m3(0.f * s.inverse), 0) << max_abs;
  }
  const Fp8RowScale smallest = Fp8RowScale::OfMax(kFp8MinRowMax);
  EXPECT_TRUE(std::isfinite(smallest.inverse));
  EXPECT_GE(smallest.scale, std::numeric_limits<float>::min());  // a normal float
  EXPECT_TRUE(std::isfinite(Fp8RowScale::Static(kFp8MinStaticScale).inverse));
  for (KvScaling scaling : {KvScaling::kPerToken, KvScaling::kStatic}) {
    CacheGeometry g = MakeGeometry(1, 4, 1, 64, 16, DType::kFloat8E4M3, 8);
    g.kv_scaling = scaling;
    if (scaling == KvScaling::kStatic) g.kv_scales = {kFp8MinStaticScale, kFp8MinStaticScale};
    std::unique_ptr<Cache> cache = MakeCache(g);
    ForwardModel m(g, DType::kFloat32, 3);
    m.SetKvShape(1e-40f, 2, 0.f);  // even channels exactly zero
    for (const auto& step :
         std::vector<std::vector<testing::SpanCase>>{{{1, 0, 40, 40}}, {{1, 40, 1, 1}}}) {
      const ForwardModel::Outcome o = m.Run(*cache, 0, step);
      ASSERT_TRUE(o.status.ok()) << o.status;
      const int64_t n = static_cast<int64_t>(o.result.out.size() / 4);
      const float* out = reinterpret_cast<const float*>(o.result.out.data());
      EXPECT_TRUE(std::all_of(out, out + n, [](float x) { return std::isfinite(x); }))
          << (scaling == KvScaling::kStatic ? "static" : "per-token");
    }
  }
}

// (scaling, page size, gqa): the FP8 sweep (tests/fp8_sweep.h) on the CPU backend, every
// head_dim it serves in turn.
class Fp8Sweep : public ::testing::TestWithParam<std::tuple<KvScaling, int, int>> {};

TEST_P(Fp8Sweep, MatchesReferenceOnUnquantizedKv) {
  const auto [scaling, page, gqa] = GetParam();
  testing::RunFp8Sweep(MakeCache, scaling, page, gqa, kCpuHeadDims);
}

INSTANTIATE_TEST_SUITE_P(
    ScalingPageGqa, Fp8Sweep,
    ::testing::Combine(::testing::Values(KvScaling::kPerToken, KvScaling::kStatic),
                       ::testing::Values(1, 7, 16, 128), ::testing::Values(1, 4, 5, 8)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param) == KvScaling::kStatic ? "static" : "per_token",
                          "_page", std::get<1>(info.param), "_gqa", std::get<2>(info.param));
    });

}  // namespace
}  // namespace pagedattn
