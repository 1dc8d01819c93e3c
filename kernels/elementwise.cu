// The element-wise kernels: K/V rows appended into their pages (converted from the wire dtype to
// the cache's, or quantized into an FP8 cache), an FP8 cache's pages dequantized for the prefill
// tiles, and dtype conversion between float32, float16 and bfloat16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/device/dtype.cuh"
#include "kernels/dispatch.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {
namespace {

// ---- Append ---------------------------------------------------------------------------------

// The widest row the append kernels take: the capability table's widest head_dim.
inline constexpr int kMaxAppendHeadDim = kCudaHeadDims.back();

// One thread moves 8 consecutive elements of one (token, head) row: a 16-byte store, each value
// as AttentionValue gives it (NaN as 0, past 2^48 saturated).
template <typename Src, typename Dst>
__device__ __forceinline__ void AppendBody(const AppendParams& p) {
  const int chunks = p.head_dim / 8;
  const int64_t per_token = int64_t{p.num_kv_heads} * chunks;
  const int64_t total = p.num_tokens * per_token;
  const bool is_v = blockIdx.y == 1;
  const Src* src = static_cast<const Src*>(is_v ? p.v : p.k);
  Dst* dst = static_cast<Dst*>(is_v ? p.v_cache : p.k_cache);
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t token = e / per_token;
    const int rem = static_cast<int>(e - token * per_token);
    const int head = rem / chunks, chunk = rem % chunks;
    const int64_t slot = p.slots[token];
    const int64_t page = slot / p.page_size, row = slot % p.page_size;
    const Src* s = src + (token * p.num_kv_heads + head) * p.head_dim + chunk * 8;
    Dst* d = dst + ((page * p.num_kv_heads + head) * p.page_size + row) * p.head_dim + chunk * 8;
    Dst vals[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) vals[i] = FromFloat<Dst>(AttentionValue(ToFloat(s[i])));
    *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(vals);
  }
}

template <typename Src, typename Dst>
__global__ void __launch_bounds__(256) AppendKvKernel(const __grid_constant__ AppendParams params) {
  AppendBody<Src, Dst>(params);
}

// Into an FP8 cache: one warp per (token, head) row, K rows then V rows (blockIdx.y). PER_TOKEN:
// the row's scale is its largest magnitude / 448 (1 under kFp8MinRowMax: zeros), found across the
// warp and written beside the row; STATIC: the layer's. Values are stored as E4M3(x * (1 /
// scale)), the host's StoreFp8Row to the bit (common/dtype.h Fp8RowScale).
template <typename Src>
__global__ void __launch_bounds__(256)
    AppendKvFp8Kernel(const __grid_constant__ AppendParams params) {
  const AppendParams& p = params;
  constexpr int kWarps = 256 / 32;
  const int lane = threadIdx.x & 31;
  const bool is_v = blockIdx.y == 1;
  const Src* src = static_cast<const Src*>(is_v ? p.v : p.k);
  uint8_t* dst = static_cast<uint8_t*>(is_v ? p.v_cache : p.k_cache);
  float* row_scales = is_v ? p.scales.v_rows : p.scales.k_rows;
  const float static_scale = is_v ? p.scales.v : p.scales.k;
  const int64_t rows = p.num_tokens * p.num_kv_heads;
  constexpr int kPerLane = kMaxAppendHeadDim / 32;
  const int per_lane = (p.head_dim + 31) / 32;  // up to kPerLane
  for (int64_t r = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5); r < rows;
       r += int64_t{gridDim.x} * kWarps) {
    const int64_t token = r / p.num_kv_heads;
    const int head = static_cast<int>(r - token * p.num_kv_heads);
    const Src* s = src + r * p.head_dim;
    float x[kPerLane];
    float max_abs = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      x[j] = j < per_lane && e < p.head_dim ? AttentionValue(ToFloat(s[e])) : 0.f;
      max_abs = fmaxf(max_abs, fabsf(x[j]));
    }
    float scale = static_scale, inverse = 1.f / static_scale;
    if (row_scales != nullptr) {
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) {
        max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, m));
      }
      const bool usable = max_abs >= kFp8MinRowMax;  // else zeros of scale 1 (common/dtype.h)
      scale = usable ? max_abs / 448.f : 1.f;
      inverse = usable ? 448.f / max_abs : 1.f;
    }
    const int64_t slot = p.slots[token];
    const int64_t page = slot / p.page_size, in_page = slot % p.page_size;
    const int64_t pool_row = (page * p.num_kv_heads + head) * p.page_size + in_page;
    uint8_t* d = dst + pool_row * p.head_dim;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (j < per_lane && e < p.head_dim) d[e] = QuantizeE4m3(x[j] * inverse);
    }
    if (row_scales != nullptr && lane == 0) row_scales[pool_row] = scale;
  }
}

// ---- FP8 pages -> bfloat16 ------------------------------------------------------------------

// One thread per 16-byte chunk of FP8 values (16 of them) of page dequant_pages[i], K then V
// (blockIdx.y): two 16-byte chunks of bfloat16 at the same place in page i of the copy.
__global__ void __launch_bounds__(256)
    DequantizePagesKernel(const __grid_constant__ PagedAttentionParams params) {
  const PagedAttentionParams& p = params;
  const bool is_v = blockIdx.y == 1;
  const uint8_t* src = static_cast<const uint8_t*>(is_v ? p.v_cache : p.k_cache);
  __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(is_v ? p.dequant_v : p.dequant_k);
  const float* row_scales = is_v ? p.scales.v_rows : p.scales.k_rows;
  const float static_scale = is_v ? p.scales.v : p.scales.k;
  const int row_chunks = p.head_dim / 16;
  const int64_t page_rows = int64_t{p.num_kv_heads} * p.page_size;
  const int64_t page_chunks = page_rows * row_chunks;
  const int64_t total = p.num_dequant_pages * page_chunks;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / page_chunks, within = e - i * page_chunks;
    const int64_t pool_row = p.dequant_pages[i] * page_rows + within / row_chunks;
    const int64_t src_chunk = p.dequant_pages[i] * page_chunks + within;
    const uint4 in = reinterpret_cast<const uint4*>(src)[src_chunk];
    uint4 lo, hi;
    const float scale = row_scales != nullptr ? row_scales[pool_row] : static_scale;
    DequantizeChunk(in, fminf(scale, kMaxTileScale), lo, hi);
    uint4* out = reinterpret_cast<uint4*>(dst) + 2 * e;
    out[0] = lo;
    out[1] = hi;
  }
}

// ---- Conversion ---------------------------------------------------------------------------

struct ConvertParams {
  const void* src;
  void* dst;
  int64_t n;
};

template <typename Src, typename Dst>
__global__ void __launch_bounds__(256) ConvertKernel(const ConvertParams p) {
  const Src* src = static_cast<const Src*>(p.src);
  Dst* dst = static_cast<Dst*>(p.dst);
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < p.n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = FromFloat<Dst>(ToFloat(src[i]));
  }
}

int GridFor(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

LaunchStatus LaunchAppendKv(const AppendParams& params, cudaStream_t stream, Launcher& launcher) {
  if (params.num_tokens == 0) return LaunchStatus::Ok();
  if (LaunchStatus st = CheckPageSize(params.page_size); !st.ok()) return st;
  if (params.head_dim % 8 != 0 || params.head_dim <= 0) {
    return LaunchStatus::Unsupported("head_dim must be a positive multiple of 8 (got " +
                                     std::to_string(params.head_dim) + ")");
  }
  if (params.head_dim > kMaxAppendHeadDim) {
    return LaunchStatus::Unsupported("head_dim must be at most " +
                                     std::to_string(kMaxAppendHeadDim) + " (got " +
                                     std::to_string(params.head_dim) + ")");
  }
  return DispatchIoDType(params.src_dtype, [&](auto src_tag) {
    using Src = typename decltype(src_tag)::type;
    return DispatchKvDType(params.cache_dtype, [&](auto dst_tag) {
      using Dst = typename decltype(dst_tag)::type;
      constexpr int kThreads = 256;
      if constexpr (kIsFp8<Dst>) {
        const int64_t rows = params.num_tokens * params.num_kv_heads;
        const dim3 grid(GridFor(rows * 32, kThreads), 2);
        return launcher.Launch(AppendKvFp8Kernel<Src>, grid, dim3(kThreads), 0, stream, params,
                               "append K/V (FP8)");
      } else {
        const int64_t work = params.num_tokens * params.num_kv_heads * (params.head_dim / 8);
        const dim3 grid(GridFor(work, kThreads), 2);
        return launcher.Launch(AppendKvKernel<Src, Dst>, grid, dim3(kThreads), 0, stream, params,
                               "append K/V");
      }
    });
  });
}

LaunchStatus LaunchDequantizePages(const PagedAttentionParams& params, cudaStream_t stream,
                                   Launcher& launcher) {
  if (params.num_dequant_pages == 0) return LaunchStatus::Ok();
  if (params.kv_dtype != DType::kFloat8E4M3 || params.head_dim % 16 != 0) {
    return LaunchStatus::Unsupported("dequantize pages: an FP8 cache of head_dim a multiple of 16");
  }
  constexpr int kThreads = 256;
  const int64_t work = int64_t{params.num_dequant_pages} * params.num_kv_heads * params.page_size *
                       (params.head_dim / 16);
  return launcher.Launch(DequantizePagesKernel, dim3(GridFor(work, kThreads), 2), dim3(kThreads), 0,
                         stream, params, "dequantize FP8 pages");
}

LaunchStatus LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                           cudaStream_t stream, Launcher& launcher) {
  if (n == 0) return LaunchStatus::Ok();
  return DispatchIoDType(src_dtype, [&](auto src_tag) {
    using Src = typename decltype(src_tag)::type;
    return DispatchIoDType(dst_dtype, [&](auto dst_tag) {
      using Dst = typename decltype(dst_tag)::type;
      constexpr int kThreads = 256;
      return launcher.Launch(ConvertKernel<Src, Dst>, dim3(GridFor(n, kThreads)), dim3(kThreads), 0,
                             stream, ConvertParams{src, dst, n}, "convert");
    });
  });
}

const char* CompiledArchitectures() { return PAGEDATTN_CUDA_ARCH_NAMES; }

LaunchStatus CheckDeviceRunsKernels(int device) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  cudaFuncAttributes attributes = {};
  // Every kernel of the library is built for the same architectures: one that loads on this
  // device says they all do (the Hopper prefill kernel is only used on compute 9.0 devices).
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, AppendKvKernel<float, __half>);
  const cudaError_t restore = cudaSetDevice(previous);
  if (err == cudaSuccess) err = restore;
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return LaunchStatus::Unsupported(std::string("GPU ") + std::to_string(device) +
                                     " cannot run this build's kernels (built as " +
                                     CompiledArchitectures() + "): " + cudaGetErrorString(err));
  }
  return LaunchStatus::Ok();
}

}  // namespace pagedattn::kernels
