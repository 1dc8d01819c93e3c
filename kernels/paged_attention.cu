// The paged attention launch sequence (decode tiles, prefill tiles, the split-KV merge, through
// kernels/dispatch.h) and the per-device facts its plan needs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/dispatch.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {
namespace {

LaunchStatus MultiprocessorCount(int* sms) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("multiprocessor count: ") + cudaGetErrorString(err));
  }
  return LaunchStatus::Ok();
}

LaunchStatus L2CacheBytes(int64_t* bytes) {
  int device = 0, l2 = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("L2 cache size: ") + cudaGetErrorString(err));
  }
  *bytes = l2;
  return LaunchStatus::Ok();
}

// Tile blocks that run at once on the current device with room left on each SM for one
// separate-merge block (the target_blocks a split plan's waves count), and all that run at once
// (unsplit_blocks), counted in tiles (a split head_dim's tile takes DecodeTileBlocks); whether
// the plan has decode tiles, whether its tiles take several blocks (wide_head), and the L2's
// bytes (PrefillHeadGroup's budget). Without
// decode tiles every span runs on prefill tiles, counted in units of two blocks: those with rows
// of a tile of up to 64 rows, a decode span's (PrefillTileBlocks).
LaunchStatus TileBlockLimits(DType kv_dtype, int head_dim, AttentionPlanLimits* limits) {
  int resident = 0, beside_merge = 0, sms = 0;
  if (LaunchStatus st = DispatchAttentionOccupancy(kv_dtype, head_dim, &resident, &beside_merge);
      !st.ok()) {
    return st;
  }
  int prefill_per_sm = 0;  // the portable prefill tile's (QueryPlanLimits: the Hopper kernel's)
  if (LaunchStatus st = DispatchPrefillTileOccupancy(kv_dtype, head_dim, &prefill_per_sm);
      !st.ok()) {
    return st;
  }
  limits->wide_head = SplitsColumns(head_dim);
  limits->decode_tiles = resident > 0;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return LaunchStatus::CudaError("compute capability: " +
                                   std::string(cudaGetErrorString(cudaGetLastError())));
  }
  limits->cluster_launch = major >= 9;
  int unit = DecodeTileBlocks(head_dim);
  if (!limits->decode_tiles) {
    resident = beside_merge = prefill_per_sm;
    unit = 2;
  }
  if (LaunchStatus st = MultiprocessorCount(&sms); !st.ok()) return st;
  if (LaunchStatus st = L2CacheBytes(&limits->l2_bytes); !st.ok()) return st;
  limits->target_blocks = std::max(sms * std::max(beside_merge, 1) / unit, 1);
  limits->unsplit_blocks = std::max(sms * std::max(resident, 1) / unit, 1);
  limits->decode_blocks_per_sm = limits->decode_tiles ? resident : 0;
  // The FP8 decode tiles are bound by their dependent chains, not by DRAM: at head_dim 128, two
  // blocks an SM (three stages) ran the 64 x 4096 batch's two waves in 0.83-0.90x the time of
  // three an SM's 1.29 waves, and 256 x 2048's 7.76 waves in 1.04x the time of 5.17: an SM's
  // rate with two blocks about 0.85 of three's (docs/PERFORMANCE.md#design-decisions).
  limits->fewer_blocks_rate = kv_dtype == DType::kFloat8E4M3 ? 0.85 : 0;
  limits->prefill_tile_blocks = sms * prefill_per_sm;
  return LaunchStatus::Ok();
}

// The Hopper prefill kernel's blocks resident on the current device (SMs * blocks per SM):
// tile_blocks where it runs at this head_dim, persistent_blocks where it runs persistent (every
// head_dim but 64), 0 otherwise (one block per item, or the portable kernel).
LaunchStatus HopperPrefillBlocks(DType kv_dtype, int head_dim, int* persistent_blocks,
                                 int* tile_blocks) {
  *persistent_blocks = *tile_blocks = 0;
  int blocks_per_sm = 0, sms = 0;
  bool persistent = false;
  if (LaunchStatus st =
          DispatchPrefillWgmmaOccupancy(kv_dtype, head_dim, &blocks_per_sm, &persistent);
      !st.ok()) {
    return st;
  }
  if (blocks_per_sm == 0) return LaunchStatus::Ok();
  if (LaunchStatus st = MultiprocessorCount(&sms); !st.ok()) return st;
  *tile_blocks = sms * blocks_per_sm;
  *persistent_blocks = persistent ? *tile_blocks : 0;
  return LaunchStatus::Ok();
}

// QueryPlanLimits' answers, per (device, cache dtype, head_dim), for the kAuto prefill path, and
// the portable prefill kernel's prefill_tile_blocks.
struct DeviceLimits {
  AttentionPlanLimits limits;
  int portable_tile_blocks = 0;
};
struct CachedLimits {
  std::mutex mu;
  std::map<std::tuple<int, DType, int>, DeviceLimits> limits;
};

}  // namespace

LaunchStatus QueryPlanLimits(DType kv_dtype, int head_dim, PrefillPath path,
                             AttentionPlanLimits* limits) {
  static CachedLimits* cache = new CachedLimits();  // never freed: used until the process ends
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("cudaGetDevice: ") + cudaGetErrorString(err));
  }
  const auto key = std::make_tuple(device, kv_dtype, head_dim);
  DeviceLimits found;
  bool hit = false;
  {
    std::lock_guard<std::mutex> lock(cache->mu);
    if (auto it = cache->limits.find(key); it != cache->limits.end()) {
      found = it->second;
      hit = true;
    }
  }
  if (!hit) {
    if (LaunchStatus st = TileBlockLimits(kv_dtype, head_dim, &found.limits); !st.ok()) return st;
    found.portable_tile_blocks = found.limits.prefill_tile_blocks;
    if (UseHopperPrefill(PrefillPath::kAuto)) {
      int hopper_tile_blocks = 0;
      if (LaunchStatus st = HopperPrefillBlocks(kv_dtype, head_dim, &found.limits.prefill_blocks,
                                                &hopper_tile_blocks);
          !st.ok()) {
        return st;
      }
      if (hopper_tile_blocks > 0) found.limits.prefill_tile_blocks = hopper_tile_blocks;
    }
    std::lock_guard<std::mutex> lock(cache->mu);
    cache->limits[key] = found;
  }
  *limits = found.limits;
  limits->prefill_path = path;
  if (!UseHopperPrefill(path)) {  // the portable kernel: no schedule, its own blocks
    limits->prefill_blocks = 0;
    limits->prefill_tile_blocks = found.portable_tile_blocks;
  }
  return LaunchStatus::Ok();
}

bool HopperPrefillAvailable() {
#ifdef PAGEDATTN_HAVE_SM90A
  static std::atomic<int8_t> cached[kMaxDevices];  // 0 unknown, 1 yes, -1 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && cached[device].load() != 0) return cached[device].load() > 0;
  int major = 0, minor = 0;
  const bool yes =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
      major == 9 && minor == 0;
  if (device < kMaxDevices) cached[device].store(yes ? 1 : -1);
  return yes;
#else
  return false;
#endif
}

LaunchStatus LaunchPagedAttention(const PagedAttentionParams& in, cudaStream_t stream,
                                  Launcher& launcher) {
  if (LaunchStatus st = CheckPageSize(in.page_size); !st.ok()) return st;
  if (LaunchStatus st = CheckGqa(in.num_q_heads, in.num_kv_heads); !st.ok()) return st;
  if (in.num_merge_tasks > 0 && in.merge_counters == nullptr && !in.separate_merge) {
    return LaunchStatus::Unsupported("split-KV work needs merge_counters");
  }
  PagedAttentionParams params = in;
  SetDivisors(&params);
  // A separate merge goes with the launch before it when that is a decode tile launch: one
  // launch of both, the merge's blocks scheduled while the tiles run (Launcher::LaunchPair).
  const bool separate_merge = params.separate_merge && params.num_merge_tasks > 0;
  KernelLaunch merge;
  if (separate_merge) {
    // out's element type: float, or the tiles' (DispatchQDType's rule).
    LaunchStatus st = DispatchKvDType(params.kv_dtype, [&](auto tag) {
      using T = TileType<typename decltype(tag)::type>;
      return DispatchQDType<T>(params.q_dtype, params.kv_dtype, [&](auto q_tag) {
        using TIO = typename decltype(q_tag)::type;
        return DispatchHeadDim(params.head_dim, [&](auto d) {
          merge = MergeSplitsLaunch<TIO, decltype(d)::value>(params);
          return LaunchStatus::Ok();
        });
      });
    });
    if (!st.ok()) return st;
  }
  const bool merge_after_decode = separate_merge && params.num_prefill_items == 0;
  if (params.num_decode_items > 0) {
    const bool last = merge_after_decode && params.num_decode_wide_items == 0;
    if (LaunchStatus st = DispatchAttentionTiles(params, TileShape::kDecode, stream, launcher,
                                                 last ? &merge : nullptr);
        !st.ok()) {
      return st;
    }
    if (last) return LaunchStatus::Ok();
  }
  if (params.num_decode_wide_items > 0) {
    if (LaunchStatus st = DispatchAttentionTiles(params, TileShape::kDecodeWide, stream, launcher,
                                                 merge_after_decode ? &merge : nullptr);
        !st.ok()) {
      return st;
    }
    if (merge_after_decode) return LaunchStatus::Ok();
  }
  if (params.num_prefill_items > 0) {
    PagedAttentionParams prefill = params;
    if (params.kv_dtype == DType::kFloat8E4M3) {  // the bfloat16 tiles on the pages' copy
      if (LaunchStatus st = LaunchDequantizePages(params, stream, launcher); !st.ok()) return st;
      prefill.kv_dtype = DType::kBFloat16;
      prefill.k_cache = params.dequant_k;
      prefill.v_cache = params.dequant_v;
      prefill.page_table = params.prefill_page_table;
    }
    if (LaunchStatus st = DispatchAttentionTiles(prefill, TileShape::kPrefill, stream, launcher);
        !st.ok()) {
      return st;
    }
  }
  if (separate_merge) {  // after prefill tiles: a launch of its own
    return launcher.Launch(merge, stream, &params, sizeof(params), "split-KV merge");
  }
  return LaunchStatus::Ok();
}

LaunchStatus LaunchForwardAttention(const ForwardLaunch& launch, cudaStream_t stream,
                                    Launcher& launcher) {
  const PagedAttentionParams& p = launch.attention;
  if (p.num_decode_items + p.num_decode_wide_items + p.num_prefill_items == 0) {
    return LaunchStatus::Ok();
  }
  const bool convert = launch.wire_dtype != DType::kUnspecified;
  if (convert) {
    if (LaunchStatus st = LaunchConvert(launch.wire_q, launch.wire_dtype, const_cast<void*>(p.q),
                                        DType::kFloat32, launch.wire_elems, stream, launcher);
        !st.ok()) {
      return st;
    }
  }
  if (LaunchStatus st = LaunchPagedAttention(p, stream, launcher); !st.ok()) return st;
  if (convert) {
    return LaunchConvert(p.out, DType::kFloat32, launch.wire_out, launch.wire_dtype,
                         launch.wire_elems, stream, launcher);
  }
  return LaunchStatus::Ok();
}

}  // namespace pagedattn::kernels
