// Instantiations of the paged attention tile and prefill kernels for head_dim 64 (f16 and bf16
// caches). One file per head_dim so the heavy instantiations compile in parallel.
#include "kernels/attention_kernel.cuh"
#include "kernels/prefill_kernel.cuh"
#include "kernels/prefill_wgmma.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_ATTENTION(__half, 64)
PAGEDATTN_INSTANTIATE_ATTENTION(__nv_bfloat16, 64)
PAGEDATTN_INSTANTIATE_MERGE(64)
PAGEDATTN_INSTANTIATE_PREFILL(__half, 64)
PAGEDATTN_INSTANTIATE_PREFILL(__nv_bfloat16, 64)
PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(__half, 64)
PAGEDATTN_INSTANTIATE_PREFILL_WGMMA(__nv_bfloat16, 64)

}  // namespace pagedattn::kernels
