// The attention kernels for head_dim 512 on a float16 cache, q and out in float or float16: the
// portable prefill tiles, which run every span at this head_dim (SplitsPrefillTile), and the
// split-KV merge.
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_MERGE(float, 512)
PAGEDATTN_INSTANTIATE_MERGE(__half, 512)
PAGEDATTN_INSTANTIATE_PREFILL(__half, 512)

}  // namespace pagedattn::kernels
