// The attention kernels for head_dim 96 on a float16 cache, q and out in float or float16: decode
// tiles, the split-KV merge, the portable and the Hopper prefill tiles (the Hopper one in head_dim
// 128's layout).
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"
#include "kernels/prefill_wgmma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(__half, 96)
PAGEDATTN_INSTANTIATE_MERGE(float, 96)
PAGEDATTN_INSTANTIATE_MERGE(__half, 96)
PAGEDATTN_INSTANTIATE_PREFILL(__half, 96)
PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(__half, 96)

}  // namespace pagedattn::kernels
