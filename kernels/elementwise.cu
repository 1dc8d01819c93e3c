// The element-wise kernels: K/V rows appended into their pages (converted from the wire dtype to
// the cache's), and dtype conversion between float32, float16 and bfloat16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/device/dtype.cuh"
#include "kernels/dispatch.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {
namespace {

// ---- Append ---------------------------------------------------------------------------------

// One thread moves 8 consecutive elements of one (token, head) row: a 16-byte store.
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
    if constexpr (std::is_same_v<Src, Dst>) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
    } else {
      Dst vals[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) vals[i] = FromFloat<Dst>(ToFloat(s[i]));
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(vals);
    }
  }
}

template <typename Src, typename Dst>
__global__ void __launch_bounds__(256) AppendKvKernel(const __grid_constant__ AppendParams params) {
  AppendBody<Src, Dst>(params);
}

// ---- Conversion ---------------------------------------------------------------------------

template <typename Src, typename Dst>
__global__ void __launch_bounds__(256) ConvertKernel(const Src* src, Dst* dst, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
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
  return DispatchIoDType(params.src_dtype, [&](auto src_tag) {
    using Src = typename decltype(src_tag)::type;
    return DispatchKvDType(params.cache_dtype, [&](auto dst_tag) {
      using Dst = typename decltype(dst_tag)::type;
      constexpr int kThreads = 256;
      const int64_t work = params.num_tokens * params.num_kv_heads * (params.head_dim / 8);
      const dim3 grid(GridFor(work, kThreads), 2);
      return launcher.Launch(AppendKvKernel<Src, Dst>, grid, dim3(kThreads), 0, stream, params,
                             "append K/V");
    });
  });
}

LaunchStatus LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                           cudaStream_t stream) {
  if (n == 0) return LaunchStatus::Ok();
  return DispatchIoDType(src_dtype, [&](auto src_tag) {
    using Src = typename decltype(src_tag)::type;
    return DispatchIoDType(dst_dtype, [&](auto dst_tag) {
      using Dst = typename decltype(dst_tag)::type;
      constexpr int kThreads = 256;
      ConvertKernel<Src, Dst><<<GridFor(n, kThreads), kThreads, 0, stream>>>(
          static_cast<const Src*>(src), static_cast<Dst*>(dst), n);
      return LastLaunchStatus("convert");
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
