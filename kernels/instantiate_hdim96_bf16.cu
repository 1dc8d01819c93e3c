// The attention kernels for head_dim 96 on a bfloat16 cache, q and out in float or bfloat16: decode
// tiles, the split-KV merge, the portable prefill tiles (no Hopper tile: its layout takes whole
// 64-column slices).
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(__nv_bfloat16, 96)
PAGEDATTN_INSTANTIATE_MERGE(__nv_bfloat16, 96)
PAGEDATTN_INSTANTIATE_PREFILL(__nv_bfloat16, 96)

}  // namespace pagedattn::kernels
