// Entry points of the kernel library: K/V append, the paged attention launch sequence
// (tile kernels through kernels/dispatch.h, then the split-KV merge) and dtype conversion.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/device_once.h"
#include "kernels/dispatch.h"
#include "kernels/graph_launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {
namespace {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

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

LaunchStatus LaunchAppendKv(const AppendParams& params, cudaStream_t stream) {
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
      return LaunchKernelWithParams(AppendKvKernel<Src, Dst>, grid, dim3(kThreads), 0, stream,
                                    params, "append K/V");
    });
  });
}

namespace {

LaunchStatus MultiprocessorCount(int* sms) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("multiprocessor count: ") + cudaGetErrorString(err));
  }
  return LaunchStatus::Ok();
}

}  // namespace

LaunchStatus AttentionTargetBlocks(DType kv_dtype, int head_dim, int* target_blocks,
                                   int* unsplit_blocks) {
  int resident = 0, beside_merge = 0, sms = 0;
  if (LaunchStatus st = DispatchAttentionOccupancy(kv_dtype, head_dim, &resident, &beside_merge);
      !st.ok()) {
    return st;
  }
  if (LaunchStatus st = MultiprocessorCount(&sms); !st.ok()) return st;
  *target_blocks = sms * std::max(beside_merge, 1);
  if (unsplit_blocks != nullptr) *unsplit_blocks = sms * std::max(resident, 1);
  return LaunchStatus::Ok();
}

LaunchStatus PrefillScheduleBlocks(DType kv_dtype, int head_dim, PrefillPath path, int* blocks) {
  *blocks = 0;
  if (!UseHopperPrefill(path)) return LaunchStatus::Ok();
  int blocks_per_sm = 0, sms = 0;
  if (LaunchStatus st = DispatchPrefillWgmmaOccupancy(kv_dtype, head_dim, &blocks_per_sm);
      !st.ok()) {
    return st;
  }
  if (blocks_per_sm == 0) return LaunchStatus::Ok();  // one block per item at this head_dim
  if (LaunchStatus st = MultiprocessorCount(&sms); !st.ok()) return st;
  *blocks = sms * blocks_per_sm;
  return LaunchStatus::Ok();
}

bool HopperPrefillAvailable() {
#ifdef PAGEDATTN_HAVE_SM90A
  static std::atomic<int8_t> cached[kMaxDevices];  // 0 unknown, 1 yes, -1 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && cached[device].load() != 0) return cached[device].load() > 0;
  int major = 0, minor = 0;
  const bool yes =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
      major == 9 && minor == 0;
  if (device < kMaxDevices) cached[device].store(yes ? 1 : -1);
  return yes;
#else
  return false;
#endif
}

LaunchStatus LaunchPagedAttention(const PagedAttentionParams& in, cudaStream_t stream) {
  if (LaunchStatus st = CheckPageSize(in.page_size); !st.ok()) return st;
  if (LaunchStatus st = CheckGqa(in.num_q_heads, in.num_kv_heads); !st.ok()) return st;
  if (in.num_merge_tasks > 0 && in.merge_counters == nullptr && !in.separate_merge) {
    return LaunchStatus::Unsupported("split-KV work needs merge_counters");
  }
  PagedAttentionParams params = in;
  SetDivisors(&params);
  // A separate merge goes with the launch before it when that is a decode tile launch: one
  // launch of both, the merge's blocks scheduled while the tiles run (LaunchKernelPairWithParams).
  const bool separate_merge = params.separate_merge && params.num_merge_tasks > 0;
  KernelLaunch merge;
  if (separate_merge) {
    if (LaunchStatus st = DispatchHeadDim(params.head_dim,
                                          [&](auto d) {
                                            merge = MergeSplitsLaunch<decltype(d)::value>(params);
                                            return LaunchStatus::Ok();
                                          });
        !st.ok()) {
      return st;
    }
  }
  const bool merge_after_decode = separate_merge && params.num_prefill_items == 0;
  if (params.num_decode_items > 0) {
    const bool last = merge_after_decode && params.num_decode_wide_items == 0;
    if (LaunchStatus st =
            DispatchAttentionTiles(params, TileShape::kDecode, stream, last ? &merge : nullptr);
        !st.ok()) {
      return st;
    }
    if (last) return LaunchStatus::Ok();
  }
  if (params.num_decode_wide_items > 0) {
    if (LaunchStatus st = DispatchAttentionTiles(params, TileShape::kDecodeWide, stream,
                                                 merge_after_decode ? &merge : nullptr);
        !st.ok()) {
      return st;
    }
    if (merge_after_decode) return LaunchStatus::Ok();
  }
  if (params.num_prefill_items > 0) {
    if (LaunchStatus st = DispatchAttentionTiles(params, TileShape::kPrefill, stream); !st.ok()) {
      return st;
    }
  }
  if (separate_merge) {  // after prefill tiles: a launch of its own
    return LaunchKernelWithParams(merge.func, merge.grid, merge.block, merge.smem, stream, &params,
                                  sizeof(params), "split-KV merge");
  }
  return LaunchStatus::Ok();
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

}  // namespace pagedattn::kernels
