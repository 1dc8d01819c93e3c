// The decode tiles for head_dim 64 on an FP8 (E4M3) cache, q and out in float or bfloat16 (the
// tiles' type). Its prefill tiles are the bfloat16 cache's, on a dequantized copy of the pages
// (LaunchPagedAttention); its merge is the bfloat16 cache's.
#include "kernels/decode_kernel.cuh"

namespace pagedattn::kernels {

PAGEDATTN_INSTANTIATE_DECODE(Fp8, 64)
PAGEDATTN_INSTANTIATE_DECODE_NARROW(Fp8, 64)

}  // namespace pagedattn::kernels
