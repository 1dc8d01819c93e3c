// EncodePoolTensorMap through the driver's cuTensorMapEncodeTiled, found at run time (the
// runtime's entry-point query), so that the build links no libcuda.
#include "kernels/tensor_map.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedattn::kernels {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled EncodeTiledOnce() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return EncodeTiled{nullptr};
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

}  // namespace

bool EncodePoolTensorMap(const void* pool, int head_dim, int box_rows,
                         unsigned char (&map)[128]) {
  static_assert(sizeof(CUtensorMap) == sizeof(map), "a CUtensorMap's bytes");
  const EncodeTiled encode = EncodeTiledOnce();
  if (encode == nullptr || pool == nullptr || reinterpret_cast<uintptr_t>(pool) % 16 != 0 ||
      head_dim <= 0 || head_dim * 2 % 16 != 0 || box_rows < kTmaMinBoxRows || box_rows > 256 ||
      (box_rows & (box_rows - 1)) != 0) {
    return false;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(head_dim), cuuint64_t{INT32_MAX}};
  const cuuint64_t row_bytes[1] = {static_cast<cuuint64_t>(head_dim) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(map), CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
                const_cast<void*>(pool), dims, row_bytes, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace pagedattn::kernels
