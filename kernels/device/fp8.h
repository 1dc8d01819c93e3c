// An FP8 (E4M3) cache's element type as stored, and the type its tiles compute in. Plain C++
// (no device code), so that kernels/dispatch.h can name them in host-only sources too.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace pagedattn::kernels {

// One E4M3 value as stored (its bits; kernels/device/dtype.cuh converts).
struct Fp8 {
  uint8_t bits;
};
template <typename S>
inline constexpr bool kIsFp8 = std::is_same_v<S, Fp8>;

// The element type S's tiles take q and out in and, where an FP8 cache's values are dequantized
// on their way into shared memory (prefill's page copy), compute in: S's own, bfloat16 for an FP8
// cache (x = float(stored) * scale, rounded to bfloat16: a scaled value keeps float's range). The
// FP8 decode tiles, at every head dim, read the stored values straight into float16 fragments
// instead (decode_fp8_math.cuh, DecodeFp8Math).
template <typename S>
using TileType = std::conditional_t<kIsFp8<S>, __nv_bfloat16, S>;

}  // namespace pagedattn::kernels
