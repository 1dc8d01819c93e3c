// The profile build's kernel code (kernels/device/profile.cuh's stamps) compiled in every build
// and never linked, so that it cannot rot unbuilt: one decode tile shape and the separate merge.
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE_NARROW(Fp8, 64)
PAGEDATTN_INSTANTIATE_MERGE(float, 64)

}  // namespace pagedattn::kernels
