// The table of configurations pagedattn supports: the single source of truth that
// CreateCache validation (server/core) and kernel dispatch (kernels/dispatch.h) both read.
// Plain C++ with no CUDA and no service includes, so every layer can use it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace pagedattn {

// Element types of tensors and caches. Values match pagedattn.v1.DType on the wire. FP8 E4M3 is a
// cache dtype only (its values scaled, KvScaling), never a tensor's.
enum class DType : int32_t {
  kUnspecified = 0,
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kFloat8E4M3 = 4
};

// How an FP8 cache scales K and V (pagedattn.v1.KvScaling): unset for 16/32-bit caches.
enum class KvScaling : int32_t { kUnspecified = 0, kPerToken = 1, kStatic = 2 };

constexpr int DTypeSize(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    default:
      return 0;
  }
}

// A C string, so it formats with any string library (absl::string_view is not std's here).
constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "FLOAT32";
    case DType::kFloat16:
      return "FLOAT16";
    case DType::kBFloat16:
      return "BFLOAT16";
    case DType::kFloat8E4M3:
      return "FLOAT8_E4M3";
    default:
      return "DTYPE_UNSPECIFIED";
  }
}

enum class BackendKind { kCpu, kCuda };

// Head dims per backend, ascending. CUDA: those with compiled kernels (adding one means adding its
// instantiation in kernels/dispatch.h; a static_assert there keeps the two in step); 512 splits
// each tile's O columns over neighbouring blocks, two a decode tile and four a prefill tile
// (kernels/paged_attention.h SplitsColumns), and runs an FP8 cache on prefill tiles alone. CPU:
// the reference runs any.
inline constexpr std::array<int, 7> kCudaHeadDims = {64, 80, 96, 128, 192, 256, 512};
inline constexpr std::array<int, 7> kCpuHeadDims = {64, 80, 96, 128, 192, 256, 512};

// Every page size in [kMinPageSize, kMaxPageSize] runs the same kernels: they gather rows
// through the page table with a multiply-shift division by the page size.
inline constexpr int kMinPageSize = 1;
inline constexpr int kMaxPageSize = 1024;

// num_q_heads / num_kv_heads. The decode kernel keeps one GQA group's queries in a block.
inline constexpr int kMaxGqaRatio = 32;
inline constexpr int kMaxNumLayers = 4096;
inline constexpr int kMaxNumHeads = 1024;
// One layer's K rows (num_pages x num_kv_heads x page_size), which the kernels index (and a
// sequence's positions, which they hold) in 32 bits: a default capacity stops there, a larger
// num_pages is refused.
inline constexpr int64_t kMaxPoolRows = (int64_t{1} << 31) - 1;
// Sinks values of a config, every layer's together (gpt-oss-120b: 36 layers x 64 q heads = 2304).
// A cache's config travels in every CreateCache, GetCache and ListCaches answer: 4096 layers x
// 1024 heads (16 MiB) would not fit the smallest --max_message_mb.
inline constexpr int64_t kMaxSinkValues = 1 << 16;

// Cache dtypes per backend; tensor (q/k/v) dtypes are accepted in any of kIoDTypes and
// converted to the cache dtype.
inline constexpr std::array<DType, 4> kCpuKvDTypes = {DType::kFloat32, DType::kFloat16,
                                                      DType::kBFloat16, DType::kFloat8E4M3};
inline constexpr std::array<DType, 3> kCudaKvDTypes = {DType::kFloat16, DType::kBFloat16,
                                                       DType::kFloat8E4M3};
inline constexpr std::array<DType, 3> kIoDTypes = {DType::kFloat32, DType::kFloat16,
                                                   DType::kBFloat16};

template <typename T, size_t N>
constexpr bool Contains(const std::array<T, N>& table, T value) {
  for (const T& x : table) {
    if (x == value) return true;
  }
  return false;
}

constexpr bool IsSupportedHeadDim(BackendKind backend, int head_dim) {
  return backend == BackendKind::kCuda ? Contains(kCudaHeadDims, head_dim)
                                       : Contains(kCpuHeadDims, head_dim);
}

constexpr bool IsSupportedPageSize(int page_size) {
  return page_size >= kMinPageSize && page_size <= kMaxPageSize;
}

constexpr bool IsSupportedKvDType(BackendKind backend, DType t) {
  return backend == BackendKind::kCuda ? Contains(kCudaKvDTypes, t) : Contains(kCpuKvDTypes, t);
}

constexpr bool IsSupportedIoDType(DType t) { return Contains(kIoDTypes, t); }

// Forward tensors in memory the caller registered (RegisterMemory, CUDA IPC): the kernels read
// and write them in place, so only the CUDA backend has them. Their offsets are multiples of
// kDeviceTensorAlign (the kernels' widest vector access).
constexpr bool SupportsDeviceTensors(BackendKind backend) { return backend == BackendKind::kCuda; }
inline constexpr int64_t kDeviceTensorAlign = 16;

// Per-layer attention variants (CacheConfig.layers: sliding window, logit soft-cap, sinks): both
// backends run them, in decode and prefill tiles alike. (Kept per backend: a backend that lacks
// one refuses the config at CreateCache rather than fail a Forward later.)
constexpr bool SupportsSlidingWindow(BackendKind) { return true; }
constexpr bool SupportsLogitSoftcap(BackendKind) { return true; }
constexpr bool SupportsSinks(BackendKind) { return true; }
inline constexpr int32_t kMaxSlidingWindow = 1 << 24;  // positions
// logit_softcap's range: 2^-20 to 2^64 (its scores in log2 units stay finite). A capped layer's
// scores scale by sm_scale / cap (the GPU's Q tile carries it), at most kMaxSoftcapScale so
// that they stay finite: a Forward's sm_scale is checked against it, and the smallest cap keeps
// the default sm_scale (1 / sqrt(head_dim), at most 1/8) within it.
inline constexpr float kMinLogitSoftcap = 0x1p-20f;
inline constexpr float kMaxLogitSoftcap = 0x1p64f;
inline constexpr float kMaxSoftcapScale = 0x1p21f;
static_assert(0.125f / kMinLogitSoftcap <= kMaxSoftcapScale);
// The largest sink logit magnitude (in log2 units a row's max and sum stay finite).
inline constexpr float kMaxSinkMagnitude = 0x1p64f;

constexpr bool IsSupportedGqaRatio(int num_q_heads, int num_kv_heads) {
  return num_kv_heads > 0 && num_q_heads > 0 && num_q_heads % num_kv_heads == 0 &&
         num_q_heads / num_kv_heads <= kMaxGqaRatio;
}

}  // namespace pagedattn
