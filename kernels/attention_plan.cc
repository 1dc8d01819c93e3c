// AttentionPlan: one Forward's work, append slots and staging layout, computed on the host, and
// its params bound to the staged image's device copy.
#include "kernels/attention_plan.h"

#include <algorithm>
#include <climits>
#include <cstring>

namespace pagedattn::kernels {
namespace {

size_t AlignUp(size_t n) { return (n + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// Hands out aligned sections one after another.
class Sections {
 public:
  size_t Take(size_t bytes) {
    const size_t at = end_;
    end_ += AlignUp(bytes);
    return at;
  }
  size_t end() const { return end_; }

 private:
  size_t end_ = 0;
};

template <typename T>
size_t BytesOf(const std::vector<T>& v) {
  return v.size() * sizeof(T);
}

// The tiles read q and write out in float or in their own dtype (the cache's; bfloat16 for an
// FP8 cache); the other 16-bit type is converted through float.
bool TilesRead(DType q_dtype, DType kv_dtype) {
  return q_dtype == DType::kFloat32 || q_dtype == TileKvDType(kv_dtype);
}

// An FP8 cache's prefill tiles read a bfloat16 copy of the pages they attend: for each span with
// prefill items, the pages from its items' first position to their last, renumbered 0, 1, ... in
// a copy of the page table (the decode tiles keep reading the pool). Dequantizing once per
// Forward rather than in the tiles: each page is read by every query tile of its span, so the
// copy costs a small part of the tiles' work (docs/PERFORMANCE.md#design-decisions).
void PlanDequantizedPages(const ForwardBatch& batch, const AttentionWork& work,
                          std::vector<int32_t>* pages, std::vector<int32_t>* table) {
  if (batch.kv_dtype != DType::kFloat8E4M3 || work.prefill_items.empty()) return;
  struct Range {
    int64_t offset = -1;
    int32_t first = INT32_MAX, end = 0;  // page indices within the span
  };
  std::vector<Range> ranges(batch.spans.size());
  for (const AttentionWorkItem& item : work.prefill_items) {
    Range& r = ranges[static_cast<size_t>(item.span)];
    r.offset = item.span_info.page_table_offset;
    r.first = std::min(r.first, item.kv_start / batch.page_size);
    r.end = std::max(r.end, (item.kv_end + batch.page_size - 1) / batch.page_size);
  }
  table->assign(batch.page_table.begin(), batch.page_table.end());
  for (const Range& r : ranges) {
    for (int32_t i = r.first; r.offset >= 0 && i < r.end; ++i) {
      const size_t entry = static_cast<size_t>(r.offset + i);
      (*table)[entry] = static_cast<int32_t>(pages->size());
      pages->push_back(batch.page_table[entry]);
    }
  }
}

}  // namespace

AttentionPlan AttentionPlan::Make(const ForwardBatch& batch, const AttentionPlanLimits& limits) {
  AttentionPlan plan;
  plan.batch_ = batch;
  plan.limits_ = limits;
  const int64_t page_size = batch.page_size;

  // Each new row's pool slot: its page (through the span's page table) and row in the page.
  plan.slots_.resize(static_cast<size_t>(batch.total_new_tokens));
  std::vector<AttentionSpan> spans(batch.spans.size());
  for (size_t i = 0; i < batch.spans.size(); ++i) {
    const ForwardSpan& sp = batch.spans[i];
    spans[i] = {sp.q_offset, sp.page_table_offset, sp.num_queries, sp.kv_len};
    for (int32_t t = 0; t < sp.num_new_tokens; ++t) {
      const int64_t pos = sp.first_new_position + t;
      const int64_t page = batch.page_table[sp.page_table_offset + pos / page_size];
      plan.slots_[sp.kv_offset + t] = page * page_size + pos % page_size;
    }
  }
  if (batch.total_queries > 0) {
    PlanAttentionWork(spans.data(), static_cast<int>(spans.size()), batch.num_q_heads,
                      batch.num_kv_heads, batch.causal, batch.window, limits, &plan.work_);
    // An FP8 cache's prefill tiles read a bfloat16 copy of its pages.
    const int64_t position_bytes =
        2 * int64_t{batch.head_dim} * std::max<int64_t>(DTypeSize(batch.kv_dtype), 2);
    plan.work_.prefill_head_group = PrefillHeadGroup(spans.data(), static_cast<int>(spans.size()),
                                                     batch.num_kv_heads, position_bytes, limits);
    SchedulePrefillJobs(batch.num_kv_heads, limits.prefill_blocks, &plan.work_);
    AttachFirstPages(batch.page_table.data(), batch.page_size, &plan.work_);
  }
  plan.converts_q_ = !TilesRead(batch.q_dtype, batch.kv_dtype);
  PlanDequantizedPages(batch, plan.work_, &plan.dequant_pages_, &plan.prefill_page_table_);

  const AttentionWork& w = plan.work_;
  const size_t q_elems =
      static_cast<size_t>(batch.total_queries) * batch.num_q_heads * batch.head_dim;
  const size_t kv_elems =
      static_cast<size_t>(batch.total_new_tokens) * batch.num_kv_heads * batch.head_dim;
  // External tensors take no room in the image and are not copied either way.
  const size_t staged = batch.external_tensors ? 0 : 1;
  const size_t q_bytes = staged * q_elems * DTypeSize(batch.q_dtype);
  const size_t kv_bytes = staged * kv_elems * DTypeSize(batch.kv_wire_dtype);
  ForwardStaging& st = plan.staging_;
  Sections s;
  // The tensors first: their place depends on their sizes alone (InputsLayout), so a caller may
  // write them into the image before the Forward is planned.
  st.q = s.Take(q_bytes);
  st.k = s.Take(kv_bytes);
  st.v = s.Take(kv_bytes);
  st.page_table = s.Take(batch.page_table.size() * sizeof(int32_t));
  st.slots = s.Take(BytesOf(plan.slots_));
  st.decode_items = s.Take(BytesOf(w.decode_items));
  st.decode_wide_items = s.Take(BytesOf(w.decode_wide_items));
  st.decode_first_pages = s.Take(BytesOf(w.decode_first_pages));
  st.decode_wide_first_pages = s.Take(BytesOf(w.decode_wide_first_pages));
  st.prefill_items = s.Take(BytesOf(w.prefill_items));
  st.prefill_jobs = s.Take(BytesOf(w.prefill_jobs));
  st.prefill_job_start = s.Take(BytesOf(w.prefill_job_start));
  st.merge_tasks = s.Take(BytesOf(w.merge_tasks));
  st.prefill_page_table = s.Take(BytesOf(plan.prefill_page_table_));
  st.dequant_pages = s.Take(BytesOf(plan.dequant_pages_));
  st.upload_bytes = s.end();
  st.out_bytes = q_bytes;
  st.lse_bytes = batch.return_lse ? staged * static_cast<size_t>(batch.total_queries) *
                                        batch.num_q_heads * sizeof(float)
                                  : 0;
  st.out = s.Take(st.out_bytes);
  st.lse = s.Take(st.lse_bytes);
  st.results_end = s.end();
  st.q_f32 = s.Take(plan.converts_q_ ? q_elems * sizeof(float) : 0);
  st.out_f32 = s.Take(plan.converts_q_ ? q_elems * sizeof(float) : 0);
  st.partial_out = s.Take(static_cast<size_t>(w.partial_rows) * batch.num_kv_heads *
                          batch.head_dim * sizeof(float));
  st.partial_lse = s.Take(static_cast<size_t>(w.partial_rows) * batch.num_kv_heads * sizeof(float));
  const size_t copy_bytes = plan.dequant_pages_.size() * static_cast<size_t>(batch.num_kv_heads) *
                            batch.page_size * batch.head_dim * DTypeSize(DType::kBFloat16);
  st.dequant_k = s.Take(copy_bytes);
  st.dequant_v = s.Take(copy_bytes);
  st.device_bytes = s.end();
  st.merge_counters = w.merge_tasks.size() * static_cast<size_t>(batch.num_kv_heads);
  return plan;
}

void AttentionPlan::WriteStaging(void* image, const void* q, const void* k, const void* v) const {
  char* h = static_cast<char*>(image);
  // A tensor already in its place (the caller wrote it into the image) is not copied.
  auto put = [h](size_t offset, const void* src, size_t bytes) {
    if (bytes > 0 && h + offset != src) std::memcpy(h + offset, src, bytes);
  };
  const AttentionWork& w = work_;
  const ForwardStaging& st = staging_;
  put(st.page_table, batch_.page_table.data(), batch_.page_table.size() * sizeof(int32_t));
  put(st.slots, slots_.data(), BytesOf(slots_));
  put(st.decode_items, w.decode_items.data(), BytesOf(w.decode_items));
  put(st.decode_wide_items, w.decode_wide_items.data(), BytesOf(w.decode_wide_items));
  put(st.decode_first_pages, w.decode_first_pages.data(), BytesOf(w.decode_first_pages));
  put(st.decode_wide_first_pages, w.decode_wide_first_pages.data(),
      BytesOf(w.decode_wide_first_pages));
  put(st.prefill_items, w.prefill_items.data(), BytesOf(w.prefill_items));
  put(st.prefill_jobs, w.prefill_jobs.data(), BytesOf(w.prefill_jobs));
  put(st.prefill_job_start, w.prefill_job_start.data(), BytesOf(w.prefill_job_start));
  put(st.merge_tasks, w.merge_tasks.data(), BytesOf(w.merge_tasks));
  put(st.prefill_page_table, prefill_page_table_.data(), BytesOf(prefill_page_table_));
  put(st.dequant_pages, dequant_pages_.data(), BytesOf(dequant_pages_));
  if (batch_.external_tensors) return;  // the kernels read them where the caller keeps them
  put(st.q, q, st.out_bytes);           // q has out's dtype and shape
  const size_t kv_bytes = static_cast<size_t>(batch_.total_new_tokens) * batch_.num_kv_heads *
                          batch_.head_dim * DTypeSize(batch_.kv_wire_dtype);
  put(st.k, k, kv_bytes);
  put(st.v, v, kv_bytes);
}

ForwardLaunch AttentionPlan::Bind(void* device_base, int32_t* merge_counters, void* k_cache,
                                  void* v_cache, const ExternalTensors& external) const {
  char* d = static_cast<char*>(device_base);
  // Where q, k, v, out and lse lie: in the image, or where the caller keeps them.
  const bool ext = batch_.external_tensors;
  const void* q = ext ? external.q : d + staging_.q;
  void* out = ext ? external.out : d + staging_.out;
  const AttentionWork& w = work_;
  const ForwardStaging& st = staging_;
  ForwardLaunch launch;

  AppendParams& ap = launch.append;
  ap.k = ext ? external.k : d + st.k;
  ap.v = ext ? external.v : d + st.v;
  ap.src_dtype = batch_.kv_wire_dtype;
  ap.k_cache = k_cache;
  ap.v_cache = v_cache;
  ap.cache_dtype = batch_.kv_dtype;
  ap.slots = reinterpret_cast<const int64_t*>(d + st.slots);
  ap.num_tokens = batch_.total_new_tokens;
  ap.num_kv_heads = batch_.num_kv_heads;
  ap.head_dim = batch_.head_dim;
  ap.page_size = batch_.page_size;
  ap.scales = batch_.kv_scales;

  PagedAttentionParams& p = launch.attention;
  p.kv_dtype = batch_.kv_dtype;
  p.num_q_heads = batch_.num_q_heads;
  p.num_kv_heads = batch_.num_kv_heads;
  p.head_dim = batch_.head_dim;
  p.page_size = batch_.page_size;
  p.causal = batch_.causal;
  p.sm_scale = batch_.sm_scale;
  p.window = batch_.window;
  p.softcap = batch_.softcap;
  p.sinks = batch_.sinks;
  p.prefill_path = limits_.prefill_path;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.page_table = reinterpret_cast<const int32_t*>(d + st.page_table);
  p.q = converts_q_ ? d + st.q_f32 : q;
  p.out = converts_q_ ? d + st.out_f32 : out;
  p.q_dtype = converts_q_ ? DType::kFloat32 : batch_.q_dtype;
  p.lse = !batch_.return_lse ? nullptr : ext ? external.lse : reinterpret_cast<float*>(d + st.lse);
  p.decode_items = reinterpret_cast<const AttentionWorkItem*>(d + st.decode_items);
  p.num_decode_items = static_cast<int32_t>(w.decode_items.size());
  p.decode_wide_items = reinterpret_cast<const AttentionWorkItem*>(d + st.decode_wide_items);
  p.num_decode_wide_items = static_cast<int32_t>(w.decode_wide_items.size());
  if (!w.decode_first_pages.empty()) {
    p.decode_first_pages = reinterpret_cast<const ItemFirstPages*>(d + st.decode_first_pages);
  }
  if (!w.decode_wide_first_pages.empty()) {
    p.decode_wide_first_pages =
        reinterpret_cast<const ItemFirstPages*>(d + st.decode_wide_first_pages);
  }
  p.prefill_items = reinterpret_cast<const AttentionWorkItem*>(d + st.prefill_items);
  p.num_prefill_items = static_cast<int32_t>(w.prefill_items.size());
  p.prefill_jobs = reinterpret_cast<const AttentionPrefillJob*>(d + st.prefill_jobs);
  p.prefill_job_start = reinterpret_cast<const int32_t*>(d + st.prefill_job_start);
  p.num_prefill_blocks = w.num_prefill_blocks();
  p.prefill_head_group = w.prefill_head_group;
  p.merge_tasks = reinterpret_cast<const AttentionMergeTask*>(d + st.merge_tasks);
  p.num_merge_tasks = static_cast<int32_t>(w.merge_tasks.size());
  p.separate_merge = w.separate_merge;
  p.decode_blocks_per_sm = w.decode_blocks_per_sm;
  p.narrow_decode = w.narrow_decode;
  p.pair_merge = w.pair_merge;
  p.merge_rows = w.merge_rows;
  p.partial_out = reinterpret_cast<float*>(d + st.partial_out);
  p.partial_lse = reinterpret_cast<float*>(d + st.partial_lse);
  p.partial_rows = w.partial_rows;
  p.merge_counters = merge_counters;
  p.scales = batch_.kv_scales;
  if (!dequant_pages_.empty()) {
    p.dequant_pages = reinterpret_cast<const int32_t*>(d + st.dequant_pages);
    p.num_dequant_pages = static_cast<int32_t>(dequant_pages_.size());
    p.dequant_k = d + st.dequant_k;
    p.dequant_v = d + st.dequant_v;
    p.prefill_page_table = reinterpret_cast<const int32_t*>(d + st.prefill_page_table);
  }

  if (converts_q_) {
    launch.wire_dtype = batch_.q_dtype;
    launch.wire_q = q;
    launch.wire_out = out;
    launch.wire_elems = batch_.total_queries * int64_t{batch_.num_q_heads} * batch_.head_dim;
  }
  return launch;
}

InputsLayout InputsLayout::Of(size_t q_bytes, size_t kv_bytes) {
  Sections s;
  InputsLayout l;
  l.q = s.Take(q_bytes);
  l.k = s.Take(kv_bytes);
  l.v = s.Take(kv_bytes);
  l.end = s.end();
  return l;
}

}  // namespace pagedattn::kernels
