// A layer's attention variant in the tiles (PagedAttentionParams::window, softcap, sinks): the
// first position a row sees, the soft-cap of the scores, and a sink folded into a finished row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/device/ptx.cuh"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// The first position a query at position pos sees: pos - window + 1 under a sliding window,
// INT32_MIN (everything) without one.
__device__ __forceinline__ int WindowFirst(const PagedAttentionParams& p, int pos) {
  return p.window > 0 ? pos - p.window + 1 : INT32_MIN;
}

// The soft-cap. The tiles keep scores unscaled until their exponentials, which take them to log2
// units with one multiply (scale_log2, folded into an FMA). Capped, a score s becomes
// tanh(s * sm_scale / cap) and its unit cap * log2(e): cap * tanh(s * sm_scale / cap) in log2
// units, for a multiply and a tanh.approx more per score (a logit error of at most
// |logit| * 5e-4, the size of P's rounding to 16 bits). The Hopper prefill tile, where the fixed
// base below serves, puts sm_scale / cap into Q (q_scaled) and pays the tanh alone: 0.94-0.96x
// the time of a multiply and a tanh. That instruction a score, on the softmax's path between the
// matrix products, is the cap's cost there (docs/PERFORMANCE.md#known-gaps).
//
// Capped scores are bounded, which lets a tile skip the online softmax's running max: in log2
// units they lie in [-c, c], c = cap * log2(e), so one fixed base b = max(c - 40, 0) keeps every
// weight 2^(s - b) within [2^(-2c + 40), 2^40] when c <= 82 (cap <= 56.8, Gemma 2's 50 too): no
// weight flushes to zero and no row ever needs a rescale (`bounded`). The price is headroom: a
// row of 2^24 positions sums to at most 2^64, so O overflows only where |V| passes 2^64 (2^104
// with weights of at most 1).
// The Hopper prefill tile takes it where P is bfloat16 (f32's exponent range): 1.12-1.14x plain
// prefill's time at cap 30 against 1.17-1.19x with the running max
// (docs/PERFORMANCE.md#design-decisions).
struct Softcap {
  float scale_log2 = 0.f;  // what takes a score as the tiles hold it to log2 units
  float in = 0.f;          // sm_scale / cap
  bool on = false;
  bool bounded = false;    // capped, and the fixed base below serves every row (FixedBase)
  float fixed_max = 0.f;   // the score (as the tiles hold it) whose SoftmaxBase is the fixed base
  // Q's tile carries `in` (LoadQTile's scale), so a score as the tiles hold it is already
  // s * sm_scale / cap and takes the tanh alone: the Hopper prefill tile's, where the fixed base
  // serves (ScaleQ).
  bool q_scaled = false;

  __device__ __forceinline__ static Softcap Of(const PagedAttentionParams& p) {
    Softcap c;
    c.on = p.softcap > 0.f;
    c.in = c.on ? p.sm_scale / p.softcap : 0.f;
    c.scale_log2 = (c.on ? p.softcap : p.sm_scale) * 1.4426950408889634f;
    c.bounded = c.on && c.scale_log2 <= 82.f;
    const float base = fmaxf(c.scale_log2 - 40.f, 0.f);
    c.fixed_max = c.bounded ? base / c.scale_log2 : 0.f;
    return c;
  }
  // No soft-cap, known at compile time where the caller's kernel is the plain layer's.
  __device__ __forceinline__ static Softcap None(const PagedAttentionParams& p) {
    Softcap c;
    c.scale_log2 = p.sm_scale * 1.4426950408889634f;
    return c;
  }
  // Whether a tile whose P is of type TP takes the fixed base: bfloat16 P only (f32's exponent
  // range); float16 P cannot hold weights up to 2^40.
  template <typename TP>
  __device__ __forceinline__ bool FixedBase() const {
    return std::is_same_v<TP, __nv_bfloat16> && bounded;
  }
  // Q's scale for a tile whose P is of type TP: `in` where the fixed base serves (its scores
  // then need no multiply before the tanh: q_scaled), 1 otherwise. Sets q_scaled.
  template <typename TP>
  __device__ __forceinline__ float ScaleQ() {
    q_scaled = FixedBase<TP>();
    return q_scaled ? in : 1.f;
  }
  // Every score of an accumulator fragment, when on (block-uniform branches).
  template <int kN>
  __device__ __forceinline__ void Apply(float (&s)[kN][4]) const {
    if (!on) return;
    if (q_scaled) {
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = FastTanh(s[n][e]);
      return;
    }
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = FastTanh(s[n][e] * in);
  }
};

// The sink logit of span row span_row of kv head kv_head (its q head's), in log2 units;
// -INFINITY when the layer has none.
__device__ __forceinline__ float SinkLog2(const PagedAttentionParams& p, int kv_head, int group,
                                          int span_row) {
  if (p.sinks == nullptr) return -INFINITY;
  return p.sinks[kv_head * group + span_row % group] * 1.4426950408889634f;
}

// A finished row whose O sum and weight sum are relative to 2^base (log2 units; base 0 for a row
// that saw nothing): the factor that normalizes O, and the row's log-sum-exp (natural log). A
// sink joins the max and the denominator: it takes probability mass and adds no value.
struct RowNorm {
  float inv;
  float lse;
};
__device__ __forceinline__ RowNorm NormalizeRow(float sum, float base, float sink_log2) {
  if (sink_log2 == -INFINITY) {
    return {sum > 0.f ? 1.f / sum : 0.f,
            sum > 0.f ? (base + __log2f(sum)) * 0.6931471805599453f : -INFINITY};
  }
  const float top = fmaxf(base, sink_log2);
  const float f = exp2f(base - top);
  const float total = sum * f + exp2f(sink_log2 - top);
  return {f / total, (top + __log2f(total)) * 0.6931471805599453f};
}

// The same for the merges, whose bases are natural-log (an LSE; -INFINITY for a row that saw
// nothing) and whose sink is p.sinks' own.
__device__ __forceinline__ RowNorm NormalizeMergedRow(const PagedAttentionParams& p, float sum,
                                                      float base, int kv_head, int group,
                                                      int span_row) {
  if (p.sinks == nullptr) {
    return {sum > 0.f ? 1.f / sum : 0.f, sum > 0.f ? base + __logf(sum) : -INFINITY};
  }
  const float sink = p.sinks[kv_head * group + span_row % group];
  const float b = sum > 0.f ? base : sink;
  const float top = fmaxf(b, sink);
  const float f = sum > 0.f ? expf(b - top) : 0.f;
  const float total = sum * f + expf(sink - top);
  return {f / total, top + __logf(total)};
}

}  // namespace pagedattn::kernels
