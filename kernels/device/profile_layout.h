// The layout of a profile build's phase stamps (kernels/device/profile.cuh), host-safe: the
// kernels write it, pagedattn-bench --profile reads it (kernels/bench/profile_json.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedattn::kernels::profile {

// The buffer: kSlots slots of kEvents 64-bit stamps (nanoseconds; 0: not stamped). A kernel's
// blocks take the slots of their region, block b slot region * kRegionSlots + b; blocks past
// the region's end do not stamp.
inline constexpr int kEvents = 4;
inline constexpr int kRegionSlots = 1 << 15;
enum Region : int {
  kDecodeTiles = 0,      // the 16-row decode tiles (the narrow tile too)
  kDecodeWideTiles = 1,  // the 32-row decode tiles
  kMerge = 2,            // the separate merge (blocks in grid order: task, row, kv head)
  // The Hopper prefill's jobs (an item and a kv head), stamped by thread 0 (its consumer
  // warpgroup 0's view): the persistent kernel's job j at slot j of the schedule, the
  // one-block-a-job kernel's block b at b.
  kPrefillJobs = 3,
  kRegions = 4,
};
inline constexpr int kSlots = kRegions * kRegionSlots;
inline constexpr size_t kBufferBytes = size_t{kSlots} * kEvents * sizeof(uint64_t);

// The events of each region's blocks, in stamp order (the merge stamps no event 2); a prefill
// job's are a tile's: its start, its first K tile landed, its last tile done, its rows written.
enum TileEvent : int { kTileEntry = 0, kFirstTileLanded = 1, kLastTileDone = 2, kTileExit = 3 };
enum MergeEvent : int { kMergeEntry = 0, kMergeWaited = 1, kMergeExit = 3 };

}  // namespace pagedattn::kernels::profile
