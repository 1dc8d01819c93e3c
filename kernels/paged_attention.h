// Params structs and entry points of the CUDA kernels: K/V append, paged attention over a
// varlen batch (its work planned in attention_work.h), and dtype conversion.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/capabilities.h"
#include "common/dtype.h"
#include "kernels/attention_work.h"
#include "kernels/launch.h"
#include "kernels/launch_status.h"

namespace pagedattn::kernels {

// x / d and x % d for 0 <= x < 2^31 with a multiply and a shift (d is a runtime page size).
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    shift = 0;
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier =
        static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
#ifdef __CUDACC__
  __device__ __forceinline__ uint32_t Div(uint32_t x) const {
    return (__umulhi(x, multiplier) + x) >> shift;
  }
#endif
};

// Two CUtensorMap's (cuda.h's 128-byte, 64-byte aligned TMA descriptors), opaque here.
struct alignas(64) KvTensorMaps {
  unsigned char k[128];
  unsigned char v[128];
};

// ---- FP8 caches ---------------------------------------------------------------------------

// How one layer of an FP8 (E4M3) cache scales K and V: a stored value reads back as
// float(stored) * scale. PER_TOKEN: one scale per row ([num_pages][num_kv_heads][page_size]
// floats each, written by the append); STATIC: the layer's two scales, k and v.
struct KvScales {
  float* k_rows = nullptr;  // null: STATIC (k, v below)
  float* v_rows = nullptr;
  float k = 1.f;
  float v = 1.f;
};

// The element type an FP8 cache's tiles compute in (bfloat16, kernels/device/dtype.cuh
// TileType); any other cache's own.
constexpr DType TileKvDType(DType kv_dtype) {
  return kv_dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : kv_dtype;
}

// ---- Append ---------------------------------------------------------------------------------

// Writes num_tokens new K and V rows into the pool of one layer. Row i of k/v
// ([num_tokens][num_kv_heads][head_dim] in src_dtype) goes to pool slot slots[i]
// (= page * page_size + row in page), converted to cache_dtype; into an FP8 cache quantized
// (saturating) by the row's own scale (PER_TOKEN: its largest magnitude / 448, written to
// scales' row arrays) or the layer's.
struct AppendParams {
  const void* k = nullptr;
  const void* v = nullptr;
  DType src_dtype = DType::kUnspecified;
  void* k_cache = nullptr;  // [num_pages][num_kv_heads][page_size][head_dim]
  void* v_cache = nullptr;
  DType cache_dtype = DType::kUnspecified;
  const int64_t* slots = nullptr;
  int64_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  KvScales scales = {};  // FP8 caches only
};

LaunchStatus LaunchAppendKv(const AppendParams& params, cudaStream_t stream, Launcher& launcher);

// The GPU code this build carries, space-separated: "sm_80 compute_80 sm_90a compute_90a"
// (machine code, and PTX the driver compiles for newer GPUs).
const char* CompiledArchitectures();
// OK when the device can run this build's kernels; Unsupported naming both otherwise (e.g. an
// sm_90a-only build on an A100).
LaunchStatus CheckDeviceRunsKernels(int device);

// ---- Paged attention ------------------------------------------------------------------------

// Asks the device (the current one) how a plan may spread its work (target_blocks,
// unsplit_blocks, prefill_blocks for `path`), once per (device, cache dtype, head_dim): later
// calls answer from a cache.
LaunchStatus QueryPlanLimits(DType kv_dtype, int head_dim, PrefillPath path,
                             AttentionPlanLimits* limits);

struct PagedAttentionParams {
  DType kv_dtype = DType::kUnspecified;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  FastDivmod page_div;      // SetDivisors (LaunchPagedAttention): page_size,
  FastDivmod kv_heads_div;  // and num_kv_heads.
  bool causal = true;
  float sm_scale = 0.f;
  PrefillPath prefill_path = PrefillPath::kAuto;

  // This layer's K pool: [num_pages][num_kv_heads][page_size][head_dim]. Every row of a page the
  // table names must be finite: the Hopper prefill reads a range's last page whole (TMA boxes),
  // the rows past the range's end weighing zero.
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  const int32_t* page_table = nullptr;

  // [total_queries][num_q_heads][head_dim] in q_dtype (below): read in float or the cache's
  // dtype, out written in the same.
  const void* q = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [total_queries][num_q_heads], natural log; null: not written

  const AttentionWorkItem* decode_items = nullptr;
  int32_t num_decode_items = 0;
  const AttentionWorkItem* decode_wide_items = nullptr;
  int32_t num_decode_wide_items = 0;
  // AttentionWork's decode_first_pages / decode_wide_first_pages; null: page ids from page_table.
  const ItemFirstPages* decode_first_pages = nullptr;
  const ItemFirstPages* decode_wide_first_pages = nullptr;
  const AttentionWorkItem* prefill_items = nullptr;
  int32_t num_prefill_items = 0;
  const AttentionMergeTask* merge_tasks = nullptr;
  int32_t num_merge_tasks = 0;
  float* partial_out = nullptr;  // [num_kv_heads][partial_rows][head_dim]
  float* partial_lse = nullptr;  // [num_kv_heads][partial_rows]
  int64_t partial_rows = 0;
  // [num_merge_tasks][num_kv_heads] split counters: zero before a launch, zero again after it
  // (the last split of a tile merges the tile and resets its counter). Unused with
  // separate_merge.
  int32_t* merge_counters = nullptr;
  bool separate_merge = false;  // AttentionWork::separate_merge
  // AttentionWork::decode_blocks_per_sm (host side: the decode launches' shared memory).
  int32_t decode_blocks_per_sm = 0;
  bool narrow_decode = false;  // AttentionWork::narrow_decode
  bool pair_merge = false;     // AttentionWork::pair_merge
  int32_t merge_rows = 0;      // AttentionWork::merge_rows
  // AttentionWork's prefill schedule; the Hopper prefill kernel needs it (one block each of
  // num_prefill_blocks).
  const AttentionPrefillJob* prefill_jobs = nullptr;
  const int32_t* prefill_job_start = nullptr;  // num_prefill_blocks + 1 entries
  int32_t num_prefill_blocks = 0;
  // The kv heads whose prefill jobs run together (PrefillJobOf; 0: every kv head): the
  // one-block-a-job prefill kernels' blocks take their (item, kv head) in that order.
  int32_t prefill_head_group = 0;
  // q's and out's dtype: kFloat32 or kv_dtype (last, so the fields before it keep their offsets).
  DType q_dtype = DType::kFloat32;

  // The layer's attention variant (pagedattn.v1.LayerAttention); zero / null: none.
  // window > 0: a query at position p sees p - window + 1 .. p (the planner starts each tile's
  // range where its first query's window does; the tiles mask the rest).
  int32_t window = 0;
  // softcap > 0: a score s (after sm_scale) becomes softcap * tanh(s / softcap).
  float softcap = 0.f;
  // [num_q_heads] logits (natural log, the units of the scaled scores) that join each row's
  // softmax denominator and carry no value.
  const float* sinks = nullptr;

  // An FP8 cache (kv_dtype kFloat8E4M3): the layer's scales. The decode tiles read the stored
  // bytes into their mma fragments and apply the scales there; the prefill tiles read a bfloat16
  // copy of the pages their spans attend (AttentionPlan: prefill's pages are few and each is
  // read by many query tiles): page dequant_pages[i] of the pool goes to page i of dequant_k /
  // dequant_v (num_dequant_pages of them), and prefill_page_table is page_table with those
  // spans' entries renumbered so.
  KvScales scales = {};
  const int32_t* dequant_pages = nullptr;
  int32_t num_dequant_pages = 0;
  void* dequant_k = nullptr;
  void* dequant_v = nullptr;
  const int32_t* prefill_page_table = nullptr;

  // The Hopper prefill kernel's K and V pools (k_cache, v_cache) as TMA tensor maps of boxes
  // of kv_box_rows rows, which its launcher makes where the pages allow (0: none;
  // kernels/tensor_map.h).
  int32_t kv_box_rows = 0;
  KvTensorMaps kv_maps = {};

#ifdef PAGEDATTN_PROFILE
  // A profile build's phase stamps (kernels/device/profile.cuh): profile::kSlots slots of
  // profile::kEvents nanosecond stamps; null: none written.
  uint64_t* profile = nullptr;
#endif
};

// Sets the params' divisors (page_div, kv_heads_div) from page_size and num_kv_heads, as
// LaunchPagedAttention does before it launches anything.
inline void SetDivisors(PagedAttentionParams* p) {
  p->page_div = FastDivmod(static_cast<uint32_t>(p->page_size));
  p->kv_heads_div = FastDivmod(static_cast<uint32_t>(p->num_kv_heads));
}

// The width (columns in shared memory and in O) the Hopper prefill kernel runs a head_dim in:
// whole 64-column slices as they are, 80 and 96 in head_dim 128's layout and schedule (S on
// D / 16 of its k steps, P.V over all 128 columns); 0 where it has none.
constexpr int WgmmaPrefillWidth(int head_dim) {
  if (head_dim == 80 || head_dim == 96) return 128;
  return head_dim % 64 == 0 && head_dim <= 256 ? head_dim : 0;
}

// Head dims whose tiles would hold more of O than a thread's registers (512: 256 accumulators a
// thread in a 16-row warp slice): their tiles split O's (and V's) columns in halves over two
// neighbouring blocks, each computing the scores over the whole head_dim. A decode tile runs as
// DecodeTileBlocks blocks, a prefill tile as PrefillTileBlocks (its rows in halves too); their
// splits merge in the separate merge kernel (AttentionPlanLimits::wide_head).
constexpr bool SplitsColumns(int head_dim) { return head_dim > 256; }
constexpr int DecodeTileBlocks(int head_dim) { return SplitsColumns(head_dim) ? 2 : 1; }
constexpr int PrefillTileBlocks(int head_dim) { return SplitsColumns(head_dim) ? 4 : 1; }
// Whether decode tiles are compiled for a cache dtype (fp8: FP8's) and head_dim: all but FP8 at
// 512, whose spans run on prefill tiles (on the pages' bfloat16 copy) like every span of a device
// whose shared memory cannot hold a 512 decode tile (AttentionPlanLimits::decode_tiles).
constexpr bool HasDecodeTiles(bool fp8, int head_dim) { return !(fp8 && SplitsColumns(head_dim)); }
// Whether a cache dtype and head_dim have the narrow decode tile (eight warps on at most 8 rows,
// the transposed step alone): FP8 up to head_dim 128.
constexpr bool HasNarrowDecodeTiles(bool fp8, int head_dim) { return fp8 && head_dim <= 128; }
// Whether a launch's 16-row decode tiles run the narrow tile (HasNarrowDecodeTiles): wherever
// every one of them holds at most 8 rows (AttentionWork::narrow_decode), split plans and both
// scalings too. Twice the warps on each KV tile run four of the five default shapes in
// 0.84-0.95x the time at 64-96 (256 x 2048 1.02x); at 128, once its in-kernel merge stopped
// spilling (DecodeMergeBatch), 0.95-1.00x on every default shape, PER_TOKEN and STATIC
// (docs/PERFORMANCE.md#design-decisions).
inline bool RunsNarrowDecode(const PagedAttentionParams& p) {
  return p.narrow_decode && HasNarrowDecodeTiles(p.kv_dtype == DType::kFloat8E4M3, p.head_dim);
}

// Whether every score's softmax exponent stays finite without a clamp. q and K hold values of at
// most 2^48 (AttentionValue, common/dtype.h), so a score lies within 2^105 (head dims up to
// 512), and times the scale in log2 units within 2^126 when that scale is at most 2^21
// (sm_scale up to 1.45e6). An FP8 cache's K is its stored values (at most 448) times their
// scales: a PER_TOKEN scale keeps each row within its own largest value, a STATIC one must be at
// most 2^48 / 448. The Hopper prefill kernels count on it (kernels/README.md#finite-scores).
inline bool ExponentsStayFinite(const PagedAttentionParams& p) {
  constexpr float kLog2e = 1.4426950408889634f;
  const bool scale_ok = p.sm_scale * kLog2e <= 2097152.f;  // 2^21
  const bool k_ok = p.scales.k_rows != nullptr || p.scales.k * 448.f <= kMaxAttentionValue;
  return scale_ok && k_ok;
}

// Runs the decode-shape tiles, then the prefill-shape tiles; split tiles merge themselves, or
// (separate_merge) a merge kernel runs after them.
LaunchStatus LaunchPagedAttention(const PagedAttentionParams& params, cudaStream_t stream,
                                  Launcher& launcher);

// ---- Conversion ---------------------------------------------------------------------------

// dst[i] = src[i] converted between any two of float32 / float16 / bfloat16.
LaunchStatus LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                           cudaStream_t stream, Launcher& launcher);

// An FP8 cache's pages params.dequant_pages -> params.dequant_k / dequant_v as bfloat16, each
// value times its scale (the prefill tiles' copy, PagedAttentionParams).
LaunchStatus LaunchDequantizePages(const PagedAttentionParams& params, cudaStream_t stream,
                                   Launcher& launcher);

// ---- One Forward --------------------------------------------------------------------------

// The kernels of one Forward, bound to its staged image on the device (AttentionPlan::Bind).
struct ForwardLaunch {
  AppendParams append;             // num_tokens 0: nothing to append
  PagedAttentionParams attention;  // no work items: nothing to attend
  // q's wire dtype when the tiles cannot read it (they read float and the cache's dtype, so only
  // the other 16-bit type): wire_q (wire_elems of it) is converted into attention.q, a float
  // copy, before the tiles, and their float attention.out back into wire_out after them.
  // kUnspecified: no conversion.
  DType wire_dtype = DType::kUnspecified;
  const void* wire_q = nullptr;
  void* wire_out = nullptr;
  int64_t wire_elems = 0;
};

// The attention of a bound Forward: q's conversion where there is one, the tiles and the merge,
// out's conversion back. (The append is LaunchAppendKv(launch.append, ...).)
LaunchStatus LaunchForwardAttention(const ForwardLaunch& launch, cudaStream_t stream,
                                    Launcher& launcher);

}  // namespace pagedattn::kernels
