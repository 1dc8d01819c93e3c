// The host side of one Forward on the GPU: its attention work, its append slots, and the layout
// of everything the device reads, staged as one image. No CUDA calls, no absl.
//
// A caller plans (AttentionPlan::Make), writes the image into pinned memory (WriteStaging), copies
// it to the device in one copy, launches the kernels with the params bound to the device's copy
// (Bind: append, then attention), and copies the results back in one copy: ForwardWorkspace
// (kernels/workspace.h) does the copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/capabilities.h"
#include "kernels/attention_work.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// One sequence's part in a Forward: the K/V rows it appends, then the queries it attends with.
struct ForwardSpan {
  int64_t q_offset = 0;            // Row of the span's first query in q / out / lse.
  int64_t kv_offset = 0;           // Row of the span's first new token in k / v.
  int64_t page_table_offset = 0;   // Index into the page table of the span's first page.
  int64_t first_new_position = 0;  // Position of the span's first new token.
  int32_t num_new_tokens = 0;      // Rows appended at first_new_position...
  int32_t num_queries = 0;         // Queries at positions kv_len-num_queries..kv_len-1.
  int32_t kv_len = 0;              // Positions attended (after the append): 0..kv_len-1.
};

// What one Forward asks of the kernels. The spans and the page table are the caller's and must
// outlive the plan's WriteStaging.
struct ForwardBatch {
  std::span<const ForwardSpan> spans;
  std::span<const int32_t> page_table;  // Every span's pages, concatenated (pool page ids).
  int64_t total_queries = 0;
  int64_t total_new_tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  DType kv_dtype = DType::kUnspecified;       // The cache's.
  DType q_dtype = DType::kUnspecified;        // q's on the wire, and out's.
  DType kv_wire_dtype = DType::kUnspecified;  // k's and v's on the wire.
  bool causal = true;
  float sm_scale = 0.f;
  bool return_lse = false;
  // q, k, v, out and lse lie in device memory of their own (ExternalTensors, given to Bind):
  // the image holds only the metadata, and nothing is copied back.
  bool external_tensors = false;
  // The layer's attention variant (PagedAttentionParams::window, softcap, sinks; sinks in
  // device memory).
  int32_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;
  // An FP8 cache's scales for this layer (PER_TOKEN's row arrays in device memory, or STATIC's).
  KvScales kv_scales = {};
};

// Device addresses of a Forward's tensors outside the image (ForwardBatch::external_tensors):
// the kernels read q, k and v there and write out (q's dtype and shape) and lse in place.
struct ExternalTensors {
  const void* q = nullptr;
  const void* k = nullptr;  // null when nothing is appended
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // null unless return_lse
};

// Byte offsets of one Forward's sections (each 256-byte aligned). The inputs (q, k, v, then the
// metadata) lie alike in the pinned image and on the device and move in one copy,
// [0, upload_bytes); q, k and v come first, where InputsLayout puts them.
// The results (out, then lse) lie alike after them on both sides and move back in one copy,
// [out, results_end). The rest is the device's scratch.
struct ForwardStaging {
  size_t page_table = 0;
  size_t slots = 0;
  size_t decode_items = 0;
  size_t decode_wide_items = 0;
  size_t decode_first_pages = 0;
  size_t decode_wide_first_pages = 0;
  size_t prefill_items = 0;
  size_t prefill_jobs = 0;
  size_t prefill_job_start = 0;
  size_t merge_tasks = 0;
  size_t prefill_page_table = 0;  // an FP8 cache's prefill: the page table for its pages' copy
  size_t dequant_pages = 0;       // and the pool pages copied
  size_t q = 0;
  size_t k = 0;
  size_t v = 0;
  size_t upload_bytes = 0;
  size_t out = 0;  // in q's dtype
  size_t lse = 0;
  size_t results_end = 0;  // the pinned image's size
  size_t q_f32 = 0;        // q and out as the tiles read and write them, when converted
  size_t out_f32 = 0;
  size_t partial_out = 0;
  size_t partial_lse = 0;
  size_t dequant_k = 0;  // an FP8 cache's prefill: its pages' bfloat16 copy
  size_t dequant_v = 0;
  size_t device_bytes = 0;
  size_t out_bytes = 0;       // out's bytes at `out`
  size_t lse_bytes = 0;       // lse's bytes at `lse` (0 unless asked for)
  size_t merge_counters = 0;  // split counters the launch needs (ForwardWorkspace keeps them)
};

inline constexpr size_t kStagingAlign = 256;

// Where a Forward's q, k and v lie at the start of its staging image: known from their sizes
// alone, before the Forward is planned (ForwardStaging's q, k, v are the same).
struct InputsLayout {
  size_t q = 0, k = 0, v = 0, end = 0;
  static InputsLayout Of(size_t q_bytes, size_t kv_bytes);
};

class AttentionPlan {
 public:
  // Plans a Forward with the device's limits (QueryPlanLimits): the tiles and split-KV chunks
  // (PlanAttentionWork), the Hopper prefill schedule (limits.prefill_blocks), each decode item's
  // first pages, the append slots, and the staging layout.
  static AttentionPlan Make(const ForwardBatch& batch, const AttentionPlanLimits& limits);

  const ForwardStaging& staging() const { return staging_; }
  const AttentionWork& work() const { return work_; }
  // Pool slot (page * page_size + row in page) of each new K/V row.
  const std::vector<int64_t>& slots() const { return slots_; }
  // Whether q crosses the tiles as a float copy (q's wire dtype is not one they read).
  bool converts_q() const { return converts_q_; }
  // An FP8 cache's prefill: the pool pages its tiles read, copied as bfloat16 (in this order),
  // and the page table that points its spans' entries at the copies (others unchanged).
  const std::vector<int32_t>& dequant_pages() const { return dequant_pages_; }
  const std::vector<int32_t>& prefill_page_table() const { return prefill_page_table_; }

  // Writes the inputs into image[0, staging().upload_bytes): the metadata, then q, k and v from
  // the caller's host buffers (k and v may be null when nothing is appended).
  void WriteStaging(void* image, const void* q, const void* k, const void* v) const;

  // The kernels' params bound to the image's copy at device_base (staging().device_bytes),
  // the split counters (staging().merge_counters of them, zero) and the layer's K/V pools; the
  // tensors are the image's, or `external`'s when the batch says external_tensors.
  ForwardLaunch Bind(void* device_base, int32_t* merge_counters, void* k_cache, void* v_cache,
                     const ExternalTensors& external = {}) const;

 private:
  ForwardBatch batch_;  // scalars, and the caller's page table for WriteStaging
  AttentionPlanLimits limits_;
  AttentionWork work_;
  std::vector<int64_t> slots_;
  std::vector<int32_t> dequant_pages_;
  std::vector<int32_t> prefill_page_table_;
  ForwardStaging staging_;
  bool converts_q_ = false;
};

}  // namespace pagedattn::kernels
