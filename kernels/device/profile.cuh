// Phase stamps for `pagedattn-bench --profile`: thread 0 of a block writes the global timer at
// named points of its kernel. Compiled in only where the build defines PAGEDATTN_PROFILE.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/device/profile_layout.h"
#include "kernels/paged_attention.h"

// Where a block's time goes (the start of its first tile, its loop's end, its exit, a merge's
// wait for the tiles) is what Nsight Compute's kernel averages hide: the tail of a launch is its
// last blocks. Stamping costs a store a block a point, so the stamps exist only in a profile
// build (cmake -DPAGEDATTN_PROFILE=ON), never in one that serves: there PAGEDATTN_STAMP is
// nothing and PagedAttentionParams has no `profile` field. A launch stamps only when its params'
// profile buffer is set (the bench sets it on one launch after timing).
#ifdef PAGEDATTN_PROFILE
#define PAGEDATTN_STAMP(params, slot, event) \
  ::pagedattn::kernels::profile::Stamp((params), (slot), (event))
#else
#define PAGEDATTN_STAMP(params, slot, event) ((void)0)
#endif

namespace pagedattn::kernels::profile {

#ifdef PAGEDATTN_PROFILE
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void Stamp(const PagedAttentionParams& p, int slot, int event) {
  if (p.profile != nullptr && threadIdx.x == 0 && slot < kSlots) {
    p.profile[int64_t{slot} * kEvents + event] = GlobalTimerNs();
  }
}
#endif

// The slot of block b of a region's kernel (kSlots: none).
__device__ __forceinline__ int SlotOf(Region region, int64_t block) {
  return block < kRegionSlots ? region * kRegionSlots + static_cast<int>(block) : kSlots;
}

}  // namespace pagedattn::kernels::profile
