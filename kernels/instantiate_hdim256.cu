// The attention kernels for head_dim 256 (f16 and bf16 caches): decode tiles, the split-KV merge,
// the portable and the Hopper prefill tiles. One file per head_dim so they compile in parallel.
#include "kernels/decode_kernel.cuh"
#include "kernels/device/split_merge.cuh"
#include "kernels/prefill_mma_kernel.cuh"
#include "kernels/prefill_wgmma_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(__half, 256)
PAGEDATTN_INSTANTIATE_DECODE(__nv_bfloat16, 256)
PAGEDATTN_INSTANTIATE_MERGE(256)
PAGEDATTN_INSTANTIATE_PREFILL(__half, 256)
PAGEDATTN_INSTANTIATE_PREFILL(__nv_bfloat16, 256)
PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(__half, 256)
PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(__nv_bfloat16, 256)

}  // namespace pagedattn::kernels
