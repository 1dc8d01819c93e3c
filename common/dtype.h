// Host-side conversions between float and the storage types (IEEE half, bfloat16, FP8 E4M3),
// and helpers to read/write a raw element buffer of any pagedattn DType as float.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/capabilities.h"

namespace pagedattn {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16: round to nearest even; NaN stays NaN, infinities stay infinite, and a finite value
// that would round past the largest bfloat16 saturates to it (a finite input never becomes
// inf, which would turn attention's sums into NaN).
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  if (abs == 0x7f800000u) return static_cast<uint16_t>(u >> 16);
  u += 0x7fffu + ((u >> 16) & 1u);
  if ((u & 0x7fffffffu) >= 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7f7fu);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) { return BitsFloat(uint32_t{h} << 16); }

// IEEE binary16, round to nearest even, with subnormals, infinities and NaN; a finite value
// beyond the largest half (65504) saturates to it rather than becoming inf.
inline uint16_t FloatToHalf(float f) {
  uint32_t u = FloatBits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // inf
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7bffu);  // saturate: 65504
  if (abs < 0x38800000u) {                                               // subnormal / zero
    // Scale into the subnormal range with a float add that performs the rounding.
    float a = BitsFloat(abs) + 0.5f;  // 0.5 = 2^-1: ulp becomes 2^-24, the half subnormal step
    return static_cast<uint16_t>(sign | (FloatBits(a) - 0x3f000000u));
  }
  uint32_t mant_odd = (abs >> 13) & 1u;
  abs += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (abs >> 13));
}
inline float HalfToFloat(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(FloatBits(f) | sign);
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// OCP FP8 E4M3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, 0x7f NaN):
// round to nearest even, and a value past the largest (448), infinities included, saturates to
// it (NVIDIA's __NV_SATFINITE), so that no finite or infinite input becomes NaN.
inline constexpr float kE4m3Max = 448.f;
inline uint8_t FloatToE4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN
  const float a = BitsFloat(abs);
  if (a >= kE4m3Max) return static_cast<uint8_t>(sign | 0x7e);  // saturate (>= 464 rounds past)
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9, the rounding done by nearbyint
    const int m = static_cast<int>(std::nearbyint(a * 512.f));  // 8: the smallest normal, 0x08
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: keep 3 mantissa bits, rounding to nearest even; a carry moves the exponent up.
  const uint32_t rounded = abs + 0x7ffffu + ((abs >> 20) & 1u);
  const int exp = static_cast<int>(rounded >> 23) - 127 + 7;
  const uint32_t mant = (rounded >> 20) & 7u;
  if (exp > 15 || (exp == 15 && mant == 7)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (exp << 3) | mant);
}
inline float E4m3ToFloat(uint8_t b) {
  const float sign = (b & 0x80) ? -1.f : 1.f;
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  if (exp == 15 && mant == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * static_cast<float>(mant) * 0.001953125f;  // 2^-9
  return sign * std::ldexp(1.f + static_cast<float>(mant) / 8.f, exp - 7);
}

// The smallest largest magnitude a PER_TOKEN row takes a scale from: 2^-116, where the scale
// (max / 448) is still a normal float and its inverse (448 / max) finite. A row below it (zeros
// too) is stored as zeros of scale 1: an inverse past float's range made 0 * inf = NaN.
inline constexpr float kFp8MinRowMax = 0x1p-116f;
// The smallest STATIC scale: float's smallest normal, whose inverse (2^126) is finite.
inline constexpr float kFp8MinStaticScale = 0x1p-126f;

// An FP8 row's scale and its inverse: PER_TOKEN's from the row's largest finite magnitude (under
// kFp8MinRowMax: 1), so that the row's largest value is stored as 448. Stored = E4M3(x *
// inverse), read back as float(stored) * scale; the GPU kernels compute both the same way.
struct Fp8RowScale {
  float scale = 1.f;
  float inverse = 1.f;
  static Fp8RowScale OfMax(float max_abs) {
    if (!(max_abs >= kFp8MinRowMax) || !std::isfinite(max_abs)) return {};
    return {max_abs / kE4m3Max, kE4m3Max / max_abs};
  }
  // scale: at least kFp8MinStaticScale (CacheConfig validation).
  static Fp8RowScale Static(float scale) { return {scale, 1.f / scale}; }
};

// Element i of a raw buffer of dtype t, as float.
inline float LoadAsFloat(DType t, const void* data, int64_t i) {
  switch (t) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(data) + i * 4, 4);
      return f;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(data) + i * 2, 2);
      return HalfToFloat(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(data) + i * 2, 2);
      return Bf16ToFloat(h);
    }
    case DType::kFloat8E4M3:  // the stored value, unscaled
      return E4m3ToFloat(static_cast<const uint8_t*>(data)[i]);
    default:
      return 0.f;
  }
}

// Stores f as element i of a raw buffer of dtype t (rounding to nearest even).
inline void StoreFromFloat(DType t, void* data, int64_t i, float f) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(static_cast<char*>(data) + i * 4, &f, 4);
      break;
    case DType::kFloat16: {
      uint16_t h = FloatToHalf(f);
      std::memcpy(static_cast<char*>(data) + i * 2, &h, 2);
      break;
    }
    case DType::kBFloat16: {
      uint16_t h = FloatToBf16(f);
      std::memcpy(static_cast<char*>(data) + i * 2, &h, 2);
      break;
    }
    case DType::kFloat8E4M3:  // f already scaled
      static_cast<uint8_t*>(data)[i] = FloatToE4m3(f);
      break;
    default:
      break;
  }
}

// The values attention takes from K, V and q: NaN counts as 0 and a magnitude past 2^48
// saturates. Both backends store K and V so and read q so (kernels/device/dtype.cuh has the
// GPU's twin). Bounded so, every score q.k of a head dim up to 512 lies within 2^105: finite
// whatever the inputs, which lets the Hopper prefill tile leave its exponents unclamped
// (kernels/README.md#finite-scores). Real activations are many orders of magnitude smaller.
inline constexpr float kMaxAttentionValue = 281474976710656.f;  // 2^48
inline float AttentionValue(float x) {
  if (std::isnan(x)) return 0.f;
  return std::fmin(std::fmax(x, -kMaxAttentionValue), kMaxAttentionValue);
}

// Stores n elements of src (dtype from) into dst (dtype to), each as AttentionValue gives it:
// how a cache's K and V rows are written.
inline void StoreAttentionValues(DType from, const void* src, DType to, void* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    StoreFromFloat(to, dst, i, AttentionValue(LoadAsFloat(from, src, i)));
  }
}

}  // namespace pagedattn
