// The attention kernels for head_dim 512 on a bfloat16 cache (and an FP8 one, whose prefill tiles
// read a bfloat16 copy), q and out in float or bfloat16: decode tiles and portable prefill tiles,
// each splitting O's columns over two blocks (SplitsColumns), and the split-KV merge.
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(__nv_bfloat16, 512)
PAGEDATTN_INSTANTIATE_MERGE(__nv_bfloat16, 512)
PAGEDATTN_INSTANTIATE_PREFILL(__nv_bfloat16, 512)

}  // namespace pagedattn::kernels
