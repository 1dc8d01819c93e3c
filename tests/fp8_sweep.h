// The FP8 cache sweep every backend passes: FP8 attention against the float64 reference on the
// unquantized K/V, with the bound each answer must keep (tests/core/cpu_backend_test.cc and
// tests/kernels/cuda_backend_test.cc run it on their backend).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace pagedattn::testing {

// What an FP8 cache's answer may differ from the float64 reference on the unquantized K/V: the
// relative error of the output (||out - ref|| / ||ref|| per span) and the LSE's absolute error.
// E4M3 keeps 3 mantissa bits: a value's rounding is up to 1/16 of it (about 3.6% RMS), which a
// span of one or two positions passes on to its output whole; longer spans average it down.
// Measured over the sweep below (each case prints its worst): on the CPU backend's head dims
// output 0.071 at worst, 0.047 the mean of the cases' worst, PER_TOKEN and STATIC alike; on the
// CUDA backend's, which put other head dims on the cases, 0.132 at worst (STATIC scales set by
// the outlier channels, head_dim 192, a short windowed span), the same on both backends. K's
// rounding moves each score by about 3.6% (RMS) of the
// scores' spread, and the LSE with it: 0.157 at worst (mean 0.080) over the sweep's rows, whose
// scores have unit spread (the default sm_scale on unit q and K); 0.37 with a spread of about 5
// (sm_scale 0.3 at head_dim 256), so the bound is for unit spread. The CUDA tiles add little:
// decode reads the stored values exactly (float16) with P rounded to float16 (2^-11 relative),
// or (other head dims, prefill) values times scales rounded to bfloat16 (2^-9).
inline constexpr double kFp8OutTolerance = 0.15;
inline constexpr double kFp8LseTolerance = 0.2;

struct Fp8Worst {
  double out = 0, lse = 0;
};

inline void ExpectFp8Close(const ForwardModel::Outcome& o, const std::string& what,
                           Fp8Worst* worst) {
  ASSERT_TRUE(o.status.ok()) << what << ": " << o.status;
  EXPECT_FALSE(o.any_nan) << what;
  EXPECT_LE(o.max_rel_error, kFp8OutTolerance) << what;
  EXPECT_LE(o.max_lse_error, kFp8LseTolerance) << what;
  worst->out = std::max(worst->out, o.max_rel_error);
  worst->lse = std::max(worst->lse, o.max_lse_error);
}

using CacheMaker = std::function<std::unique_ptr<Cache>(const CacheGeometry&)>;

// One (scaling, page size, gqa) of the sweep: FP8 caches against the float64 reference on
// unquantized K/V, over random K/V, K/V with outlier channels (every 16th channel 30x), and K/V
// 100x larger (which fails if a scale is dropped anywhere); prefill, chunked, mixed, decode, a
// rewind, non-causal, the layer variants (window, soft-cap, sinks on layer 0), the head dims in
// turn.
inline Fp8Worst RunFp8Sweep(const CacheMaker& make_cache, KvScaling scaling, int page, int gqa,
                            std::span<const int> dims) {
  const int hkv = gqa == 5 ? 1 : 2;
  Fp8Worst worst;
  int index = 0;
  for (float data_scale : {1.f, 100.f}) {
    for (bool outliers : {false, true}) {
      const int dim = dims[static_cast<size_t>(page + gqa + index++) % dims.size()];
      CacheGeometry g =
          MakeGeometry(2, hkv * gqa, hkv, dim, page, DType::kFloat8E4M3, 900 / page + 60);
      g.kv_scaling = scaling;
      if (scaling == KvScaling::kStatic) {  // calibrated: the data's range, 4 sigma (x30 outliers)
        const float range = 4.f * data_scale * (outliers ? 30.f : 1.f);
        g.kv_scales = {range / 448.f, range / 448.f, range / 448.f, 1.5f * range / 448.f};
      }
      LayerAttention a;
      a.sliding_window = 33;
      a.logit_softcap = 20.f;
      for (int h = 0; h < g.num_q_heads; ++h) a.sinks.push_back(0.25f * h);
      g.layers = {a, LayerAttention{}};
      std::unique_ptr<Cache> cache = make_cache(g);
      if (cache == nullptr) {
        ADD_FAILURE() << "no cache";
        return worst;
      }
      ForwardModel model(g, DType::kBFloat16, /*seed=*/page * 100 + gqa + index);
      model.SetKvShape(data_scale, outliers ? 16 : 1 << 30, outliers ? 30.f : 1.f);
      const std::string what = absl::StrCat(scaling == KvScaling::kStatic ? "static" : "per-token",
                                            " page ", page, " gqa ", gqa, " d ", dim, " x",
                                            data_scale, outliers ? " outliers" : "");
      for (int layer : {0, 1}) {
        const std::string at = what + (layer == 0 ? " variants" : " plain");
        ExpectFp8Close(model.Run(*cache, layer, {{1, 0, 5, 5}, {2, 0, 70, 70}, {3, 0, 1, 1}}),
                       at + " prefill", &worst);
        ExpectFp8Close(model.Run(*cache, layer, {{1, 5, 1, 1}, {2, 70, 40, 40}, {4, 0, 9, 9}}),
                       at + " mixed", &worst);
        ExpectFp8Close(model.Run(*cache, layer, {{2, 110, 1, 1}, {3, 1, 0, 1}, {1, 3, 2, 2}}),
                       at + " decode", &worst);
        ExpectFp8Close(model.Run(*cache, layer, {{4, 9, 3, 3}}, /*causal=*/false),
                       at + " non-causal", &worst);
      }
    }
  }
  std::printf("%s page %d gqa %d: worst relative error %.4f, lse error %.4f\n",
              scaling == KvScaling::kStatic ? "static" : "per-token", page, gqa, worst.out,
              worst.lse);
  return worst;
}

}  // namespace pagedattn::testing
