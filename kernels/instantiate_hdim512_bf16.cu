// The attention kernels for head_dim 512 on a bfloat16 cache (and an FP8 one, whose tiles read a
// bfloat16 copy), q and out in float or bfloat16: the portable prefill tiles, which run every span
// at this head_dim (SplitsPrefillTile), and the split-KV merge.
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_MERGE(__nv_bfloat16, 512)
PAGEDATTN_INSTANTIATE_PREFILL(__nv_bfloat16, 512)

}  // namespace pagedattn::kernels
