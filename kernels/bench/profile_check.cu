// The profile build's kernel code (kernels/device/profile.cuh's stamps) compiled in every build
// and never linked, so that it cannot rot unbuilt: one decode tile shape, the separate merge and,
// on sm_90a, the Hopper prefill's two bodies (one block a job, and persistent).
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_wgmma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE_NARROW(Fp8, 64)
PAGEDATTN_INSTANTIATE_MERGE(float, 64)
template __global__ void PagedPrefillWgmmaKernel<__nv_bfloat16, __nv_bfloat16, 64, false, false>(
    const __grid_constant__ PagedAttentionParams);
template __global__ void PagedPrefillWgmmaKernel<__nv_bfloat16, __nv_bfloat16, 128, false, true>(
    const __grid_constant__ PagedAttentionParams);

}  // namespace pagedattn::kernels
