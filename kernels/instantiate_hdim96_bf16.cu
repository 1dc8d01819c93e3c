// The attention kernels for head_dim 96 on a bfloat16 cache, q and out in float or bfloat16: decode
// tiles, the split-KV merge, the portable and the Hopper prefill tiles (the Hopper one in head_dim
// 128's layout).
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"
#include "kernels/prefill_wgmma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(__nv_bfloat16, 96)
PAGEDATTN_INSTANTIATE_MERGE(__nv_bfloat16, 96)
PAGEDATTN_INSTANTIATE_PREFILL(__nv_bfloat16, 96)
PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(__nv_bfloat16, 96)

}  // namespace pagedattn::kernels
