// The attention kernels for head_dim 512 on a float16 cache, q and out in float or float16: decode
// tiles and portable prefill tiles, each splitting O's columns over two blocks (SplitsColumns),
// and the split-KV merge.
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(__half, 512)
PAGEDATTN_INSTANTIATE_MERGE(float, 512)
PAGEDATTN_INSTANTIATE_MERGE(__half, 512)
PAGEDATTN_INSTANTIATE_PREFILL(__half, 512)

}  // namespace pagedattn::kernels
