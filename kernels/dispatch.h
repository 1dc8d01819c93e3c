// The one place where runtime values (cache dtype, wire dtype, head_dim, tile shape) become
// template instantiations. Checks against the capability table (common/capabilities.h), so
// every configuration CreateCache accepts has a kernel; a default case names what is missing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <string>
#include <type_traits>

#include "common/capabilities.h"
#include "kernels/device/fp8.h"
#include "kernels/launch.h"
#include "kernels/launch_status.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

template <typename T>
struct TypeTag {
  using type = T;
};

// Head dims compiled below; must equal the capability table's.
inline constexpr std::array<int, 7> kCompiledHeadDims = {64, 80, 96, 128, 192, 256, 512};
constexpr bool SameHeadDims() {
  if (kCompiledHeadDims.size() != kCudaHeadDims.size()) return false;
  for (size_t i = 0; i < kCompiledHeadDims.size(); ++i) {
    if (kCompiledHeadDims[i] != kCudaHeadDims[i]) return false;
  }
  return true;
}
static_assert(SameHeadDims(),
              "kCudaHeadDims changed: add its instantiation in kernels/dispatch.h and a "
              "kernels/instantiate_hdim<N>_{f16,bf16,fp8}.cu files (no fp8 at 512)");
static_assert(kCudaKvDTypes.size() == 3 && kCudaKvDTypes[0] == DType::kFloat16 &&
                  kCudaKvDTypes[1] == DType::kBFloat16 && kCudaKvDTypes[2] == DType::kFloat8E4M3,
              "kCudaKvDTypes changed: extend DispatchKvDType");

inline std::string DTypeString(DType t) { return std::string(DTypeName(t)); }

// Cache dtype -> element type as stored (f16, bf16, Fp8).
template <typename F>
LaunchStatus DispatchKvDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      return f(TypeTag<__half>{});
    case DType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
    case DType::kFloat8E4M3:
      return f(TypeTag<Fp8>{});
    default:
      return LaunchStatus::Unsupported(
          "kv_dtype " + DTypeString(dtype) +
          " has no CUDA kernel (supported: FLOAT16, BFLOAT16, FLOAT8_E4M3)");
  }
}

// Wire dtype of appended K/V -> element type (f32, f16, bf16).
template <typename F>
LaunchStatus DispatchIoDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(TypeTag<float>{});
    case DType::kFloat16:
      return f(TypeTag<__half>{});
    case DType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
    default:
      return LaunchStatus::Unsupported("tensor dtype " + DTypeString(dtype) +
                                       " is not supported (supported: FLOAT32, FLOAT16, BFLOAT16)");
  }
}

template <typename F>
LaunchStatus DispatchHeadDim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 80:
      return f(std::integral_constant<int, 80>{});
    case 96:
      return f(std::integral_constant<int, 96>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 192:
      return f(std::integral_constant<int, 192>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
    case 512:
      return f(std::integral_constant<int, 512>{});
    default:
      return LaunchStatus::Unsupported(
          "head_dim must be one of 64, 80, 96, 128, 192, 256, 512 (got " +
          std::to_string(head_dim) + ")");
  }
}

// Whether the Hopper prefill kernel has an instantiation at head_dim (WgmmaPrefillWidth).
constexpr bool HasWgmmaPrefill(int head_dim) { return WgmmaPrefillWidth(head_dim) > 0; }

// Page sizes and GQA ratios are runtime values in the kernels (a FastDivmod and a row
// mapping), so every value in the table runs; these checks only reject values outside it.
inline LaunchStatus CheckPageSize(int page_size) {
  if (!IsSupportedPageSize(page_size)) {
    return LaunchStatus::Unsupported("page_size must be one of " + std::to_string(kMinPageSize) +
                                     ".." + std::to_string(kMaxPageSize) + " (got " +
                                     std::to_string(page_size) + ")");
  }
  return LaunchStatus::Ok();
}
inline LaunchStatus CheckGqa(int num_q_heads, int num_kv_heads) {
  if (!IsSupportedGqaRatio(num_q_heads, num_kv_heads)) {
    return LaunchStatus::Unsupported(
        "num_q_heads / num_kv_heads must be a whole ratio of at most " +
        std::to_string(kMaxGqaRatio) + " (got " + std::to_string(num_q_heads) + " / " +
        std::to_string(num_kv_heads) + ")");
  }
  return LaunchStatus::Ok();
}

// The dtype the tiles read q and write out in (PagedAttentionParams::q_dtype) -> element type:
// float32, or the tiles' own T (the cache's; bfloat16 for an FP8 cache, TileKvDType). Any other
// (the other 16-bit type) crosses the tiles as a float copy (AttentionPlan converts it), so it
// never reaches here from a plan.
template <typename T, typename F>
LaunchStatus DispatchQDType(DType q_dtype, DType kv_dtype, F&& f) {
  if (q_dtype == DType::kFloat32) return f(TypeTag<float>{});
  if (q_dtype == TileKvDType(kv_dtype)) return f(TypeTag<T>{});
  return LaunchStatus::Unsupported("q dtype " + DTypeString(q_dtype) + " on a " +
                                   DTypeString(kv_dtype) +
                                   " cache: the tiles read FLOAT32 or the cache's dtype");
}

// The decode tile kernels (kernels/decode_kernel.cuh), instantiated in
// kernels/instantiate_hdim*_{f16,bf16,fp8}.cu for T (as stored) in {__half, __nv_bfloat16, Fp8},
// q in TIO in {float, TileType<T>} and the warp layouts of attention_work.h (the narrow tile's
// for FP8 up to head_dim 128 only). then: a kernel launched right after the tiles that may start
// before they end (the separate merge, Launcher::LaunchPair); null for none.
template <typename T, typename TIO, int D, int kRowWarps, int kKvWarps>
LaunchStatus LaunchDecodeTiles(const PagedAttentionParams& params, cudaStream_t stream,
                               const KernelLaunch* then, Launcher& launcher);
template <typename T, int D, int kRowWarps, int kKvWarps>
LaunchStatus DecodeTileOccupancy(int* resident, int* beside_merge);

// The split-KV merge as a kernel of its own (PagedAttentionParams::separate_merge), one block
// per (merge task, row, kv head): its kernel and grid, for LaunchDecodeTiles' `then` (or a
// launch of its own after prefill tiles); instantiated beside the tile kernels for each head_dim
// and out's element type TIO (float, __half, __nv_bfloat16).
template <typename TIO, int D>
KernelLaunch MergeSplitsLaunch(const PagedAttentionParams& params);

// The prefill tile kernels, instantiated beside them: the portable one on mma.sync
// (kernels/prefill_mma_kernel.cuh, sm_80 and later) and the Hopper one on wgmma
// (kernels/prefill_wgmma_kernel.cuh, sm_90a builds on 9.0 devices).
template <typename T, typename TIO, int D>
LaunchStatus LaunchPrefillTiles(const PagedAttentionParams& params, cudaStream_t stream,
                                Launcher& launcher);
template <typename T, typename TIO, int D>
LaunchStatus LaunchPrefillTilesWgmma(const PagedAttentionParams& params, cudaStream_t stream,
                                     Launcher& launcher);
template <typename T, int D>
LaunchStatus PrefillWgmmaOccupancy(int* blocks_per_sm, bool* persistent);
template <typename T, int D>
LaunchStatus PrefillTileOccupancy(int* blocks_per_sm);

// Whether this build carries sm_90a code and the current device is compute capability 9.0
// (kernels/paged_attention.cu; answered once per device). Callers choose against it through
// PagedAttentionParams::prefill_path (the server's --prefill_kernel).
bool HopperPrefillAvailable();
inline bool UseHopperPrefill(PrefillPath path) {
  return path == PrefillPath::kAuto && HopperPrefillAvailable();
}
// The prefill kernel a launch at head_dim runs: the Hopper one where the path and the device
// allow it and the head_dim has one (HasWgmmaPrefill), the portable one otherwise.
inline bool PrefillRunsOnWgmma(PrefillPath path, int head_dim) {
  return HasWgmmaPrefill(head_dim) && UseHopperPrefill(path);
}

enum class TileShape { kDecode, kDecodeWide, kPrefill };

// then (decode shapes only): see LaunchDecodeTiles.
inline LaunchStatus DispatchAttentionTiles(const PagedAttentionParams& params, TileShape shape,
                                           cudaStream_t stream, Launcher& launcher,
                                           const KernelLaunch* then = nullptr) {
  return DispatchKvDType(params.kv_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return DispatchQDType<TileType<T>>(params.q_dtype, params.kv_dtype, [&](auto q_tag) {
      using TIO = typename decltype(q_tag)::type;
      return DispatchHeadDim(params.head_dim, [&](auto d) -> LaunchStatus {
        constexpr int D = decltype(d)::value;
        if constexpr (!HasDecodeTiles(kIsFp8<T>, D)) {
          if (shape != TileShape::kPrefill) {
            return LaunchStatus::Unsupported("head_dim " + std::to_string(D) + " on a " +
                                             DTypeString(params.kv_dtype) +
                                             " cache has no decode tiles (its plans take none)");
          }
        } else {
          if (shape == TileShape::kDecode) {
            if constexpr (HasNarrowDecodeTiles(kIsFp8<T>, D)) {
              if (RunsNarrowDecode(params)) {
                return LaunchDecodeTiles<T, TIO, D, kDecodeRowWarps, kDecodeNarrowKvWarps>(
                    params, stream, then, launcher);
              }
            }
            return LaunchDecodeTiles<T, TIO, D, kDecodeRowWarps, kDecodeKvWarps>(params, stream,
                                                                                 then, launcher);
          }
          if (shape == TileShape::kDecodeWide) {
            return LaunchDecodeTiles<T, TIO, D, kDecodeWideRowWarps, kDecodeWideKvWarps>(
                params, stream, then, launcher);
          }
        }
        if constexpr (kIsFp8<T>) {
          return LaunchStatus::Unsupported(
              "an FP8 cache's prefill tiles read its pages' bfloat16 copy (LaunchPagedAttention)");
        } else {
          if constexpr (HasWgmmaPrefill(D)) {
            // Past ExponentsStayFinite the portable kernel, whose exponents are clamped.
            if (PrefillRunsOnWgmma(params.prefill_path, D) && ExponentsStayFinite(params)) {
              return LaunchPrefillTilesWgmma<T, TIO, D>(params, stream, launcher);
            }
          }
          return LaunchPrefillTiles<T, TIO, D>(params, stream, launcher);
        }
      });
    });
  });
}

// The decode tile's occupancy (DecodeTileOccupancy): 0 resident where this cache dtype and
// head_dim have none (HasDecodeTiles) or the device's shared memory cannot hold them.
inline LaunchStatus DispatchAttentionOccupancy(DType kv_dtype, int head_dim, int* resident,
                                               int* beside_merge) {
  return DispatchKvDType(kv_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return DispatchHeadDim(head_dim, [&](auto d) {
      constexpr int D = decltype(d)::value;
      if constexpr (HasDecodeTiles(kIsFp8<T>, D)) {
        return DecodeTileOccupancy<T, D, kDecodeRowWarps, kDecodeKvWarps>(resident, beside_merge);
      } else {
        *resident = *beside_merge = 0;
        return LaunchStatus::Ok();
      }
    });
  });
}

// The portable prefill tile's blocks an SM holds (an FP8 cache's: the bfloat16 tile's).
inline LaunchStatus DispatchPrefillTileOccupancy(DType kv_dtype, int head_dim, int* blocks_per_sm) {
  return DispatchKvDType(TileKvDType(kv_dtype), [&](auto tag) {
    using T = typename decltype(tag)::type;
    return DispatchHeadDim(head_dim, [&](auto d) {
      if constexpr (kIsFp8<T>) {  // (never: TileKvDType)
        return LaunchStatus::Unsupported("an FP8 cache's prefill tiles are bfloat16");
      } else {
        return PrefillTileOccupancy<T, decltype(d)::value>(blocks_per_sm);
      }
    });
  });
}

// An FP8 cache's prefill runs the bfloat16 tiles (on its pages' copy): their occupancy, and
// whether the kernel runs persistent at this head_dim.
inline LaunchStatus DispatchPrefillWgmmaOccupancy(DType kv_dtype, int head_dim, int* blocks_per_sm,
                                                  bool* persistent) {
  return DispatchKvDType(TileKvDType(kv_dtype), [&](auto tag) {
    using T = typename decltype(tag)::type;
    return DispatchHeadDim(head_dim, [&](auto d) {
      constexpr int D = decltype(d)::value;
      if constexpr (HasWgmmaPrefill(D) && !kIsFp8<T>) {  // (never FP8 here: TileKvDType)
        return PrefillWgmmaOccupancy<T, D>(blocks_per_sm, persistent);
      }
      *blocks_per_sm = 0;  // the portable kernel
      *persistent = false;
      return LaunchStatus::Ok();
    });
  });
}

}  // namespace pagedattn::kernels
