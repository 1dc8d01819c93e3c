// Device conversions between float and the 16-bit element types (f16, bf16): single values,
// and a pair packed into the 32-bit register an mma operand or a 4-byte store takes; and the
// FP8 (E4M3) cache's quantization and its dequantization into bfloat16 tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "kernels/device/fp8.h"

namespace pagedattn::kernels {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
// A finite value beyond the 16-bit type's range saturates to its largest value instead of
// becoming inf (which attention's sums would turn into NaN); inf and NaN stay what they are.
// The host's conversions (common/dtype.h) do the same.
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(isfinite(x) ? fminf(fmaxf(x, -65504.f), 65504.f) : x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  constexpr float kMax = 3.38953138925153547590e38f;  // the largest bfloat16
  return __float2bfloat16_rn(isfinite(x) ? fminf(fmaxf(x, -kMax), kMax) : x);
}

// common/dtype.h's AttentionValue: NaN as 0, magnitudes past 2^48 saturated.
__device__ __forceinline__ float AttentionValue(float x) {
  return isnan(x) ? 0.f : fminf(fmaxf(x, -kMaxAttentionValue), kMaxAttentionValue);
}
// The same for a 16-byte chunk of eight T, as FromFloat<T>(AttentionValue(x)) gives them, on
// pairs: min and max with the bounds (a NaN gives way to the other operand), times x == x (0 for
// NaN). Four instructions a pair where the scalar route takes about ten a value; q's tile takes
// it once per item.
template <typename T>
__device__ __forceinline__ uint4 AttentionChunk(uint4 chunk) {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  constexpr float kBound = std::is_same_v<T, __half> ? 65504.f : kMaxAttentionValue;
  const T2 hi = {FromFloat<T>(kBound), FromFloat<T>(kBound)};
  const T2 lo = {FromFloat<T>(-kBound), FromFloat<T>(-kBound)};
  T2* v = reinterpret_cast<T2*>(&chunk);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __hmul2(__hmax2(__hmin2(v[i], hi), lo), __heq2(v[i], v[i]));
  return chunk;
}

// Two values into a 16-bit pair, rounded (mma operands: P, whose values lie in [0, 1]).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two output values into a pair of T, saturating like FromFloat (float: only the low one,
// callers store floats themselves).
template <typename T>
__device__ __forceinline__ uint32_t PackOutputPair(float lo, float hi) {
  const T pair[2] = {FromFloat<T>(lo), FromFloat<T>(hi)};
  return *reinterpret_cast<const uint32_t*>(pair);
}

// A score (already multiplied by the softmax scale) that stays finite whatever q, k and the
// scale are: an overflowing product saturates, and NaN (inf - inf inside a dot product) counts
// as the lowest score. The softmax then never computes inf - inf.
__device__ __forceinline__ float SaturatedScore(float s) {
  return fminf(fmaxf(s, -3.402823466e38f), 3.402823466e38f);
}

// The softmax base of a row whose raw (unscaled) max is mx: mx * scale_log2, saturated, and 0
// for a row that sees nothing yet. 2^(s * scale_log2 - base) is then at most 1 for every score
// of the row, which SoftmaxExponent's clamp to 0 makes exact even when the product overflows.
__device__ __forceinline__ float SoftmaxBase(float mx, float scale_log2) {
  return mx == -INFINITY ? 0.f : SaturatedScore(mx * scale_log2);
}
// A lazy softmax base (the decode and Hopper prefill tiles) trails the row's max by up to this
// much (log2 units), raised only past it: P <= 2^8 before normalization, and most tiles skip
// the rescale of O.
inline constexpr float kRescaleSlack = 8.f;
__device__ __forceinline__ float SoftmaxExponent(float s, float scale_log2, float base) {
  return fminf(fmaf(s, scale_log2, -base), 0.f);  // also maps an inf or NaN score to the max
}

// ---- FP8 (E4M3) caches ----------------------------------------------------------------------

// float -> E4M3: round to nearest even; past 448 (infinities too) saturates; NaN stays NaN. The
// host's FloatToE4m3 (common/dtype.h) rounds the same.
__device__ __forceinline__ uint8_t QuantizeE4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// The largest scale a tile applies: 448 times it is bfloat16's largest value, so that every
// dequantized value stays finite (a row scaled past it reads back saturated, as a bfloat16
// cache's values past bfloat16's range are stored).
inline constexpr float kMaxTileScale = 3.38953138925153547590e38f / 448.f;

// A 16-byte chunk of E4M3 values times scale (at most kMaxTileScale), as the two 16-byte chunks
// of bfloat16 they become. No per-value saturation: |stored| <= 448 bounds the products (the
// per-value clamps cost a third of an FP8 decode tile's time,
// docs/PERFORMANCE.md#design-decisions).
__device__ __forceinline__ void DequantizeChunk(const uint4& in, float scale, uint4& lo,
                                                uint4& hi) {
  const uint32_t w[4] = {in.x, in.y, in.z, in.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint16_t pair = static_cast<uint16_t>(i % 2 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
    out[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace pagedattn::kernels
