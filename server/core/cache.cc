// Cache::Forward: request checks, then reserve (under the sequence-table lock), compute
// (under the layer lock only), then commit or roll back.
#include "server/core/cache.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <new>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/core/error_info.h"

namespace pagedattn {
namespace {
// Positions are bounded so that start + num_new_tokens and page arithmetic never overflow.
constexpr int64_t kMaxPosition = int64_t{1} << 40;
}  // namespace

Cache::Cache(std::string id, std::string name, std::string owner, const CacheGeometry& geometry,
             std::unique_ptr<KvPool> pool, Backend* backend, int64_t created_unix_ms,
             ForwardLimits limits, uint64_t serial)
    : id_(std::move(id)),
      name_(std::move(name)),
      owner_(std::move(owner)),
      geometry_(geometry),
      pool_(std::move(pool)),
      backend_(backend),
      created_unix_ms_(created_unix_ms),
      limits_(limits),
      serial_(serial),
      table_(geometry.num_layers, geometry.page_size, geometry.num_pages) {
  layer_mu_.reserve(static_cast<size_t>(geometry.num_layers));
  for (int32_t i = 0; i < geometry.num_layers; ++i)
    layer_mu_.push_back(std::make_unique<absl::Mutex>());
}

absl::Status Cache::ValidateForward(const ForwardArgs& a) const {
  const CacheGeometry& g = geometry_;
  if (a.layer < 0 || a.layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer must be in 0..", g.num_layers - 1, " (got ", a.layer, ")"));
  }
  if (a.spans.empty()) return absl::InvalidArgumentError("spans must not be empty");
  if (static_cast<int64_t>(a.spans.size()) > limits_.max_spans) {
    return absl::InvalidArgumentError(absl::StrCat("at most ", limits_.max_spans,
                                                   " spans per Forward (got ", a.spans.size(),
                                                   "; the server's --max_forward_spans)"));
  }
  int64_t total_q = 0;
  int64_t total_new = 0;
  absl::flat_hash_set<uint64_t> seen;
  seen.reserve(a.spans.size());
  for (size_t i = 0; i < a.spans.size(); ++i) {
    const SpanRequest& s = a.spans[i];
    // Built on the error paths only: a 64-sequence batch would pay 64 allocations otherwise.
    auto where = [&] { return absl::StrCat("spans[", i, "] (seq_id ", s.seq_id, ")"); };
    if (!seen.insert(s.seq_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": seq_id appears more than once in this Forward"));
    }
    if (s.start < 0 || s.start > kMaxPosition) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": start must be in 0..", kMaxPosition, " (got ", s.start, ")"));
    }
    if (s.num_new_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": num_new_tokens must be >= 0 (got ", s.num_new_tokens, ")"));
    }
    const int64_t kv_len = s.start + s.num_new_tokens;
    if (s.num_queries < 0 || s.num_queries > kv_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": num_queries must be in 0..start+num_new_tokens=", kv_len,
                       " (got ", s.num_queries, ")"));
    }
    total_q += s.num_queries;
    total_new += s.num_new_tokens;
  }
  if (total_q + total_new > limits_.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("at most ", limits_.max_tokens, " queries plus new tokens per Forward (got ",
                     total_q + total_new, "; the server's --max_forward_tokens)"));
  }
  absl::Status s;
  if (total_q == 0 && a.q.empty()) {
    // Append-only: q may be left unset.
  } else if (a.q.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("q is required: the spans' num_queries total ", total_q,
                     " (a span that only appends sets num_queries to 0)"));
  } else if (s = CheckTensor("q", a.q, {total_q, g.num_q_heads, g.head_dim},
                             "total_queries, num_q_heads, head_dim");
             !s.ok()) {
    return s;
  }
  if (total_new == 0 && a.k.empty() && a.v.empty()) {
    // Nothing appended: k and v may be left unset.
  } else {
    const std::vector<int64_t> kv_shape = {total_new, g.num_kv_heads, g.head_dim};
    const char* kv_names = "total_new_tokens, num_kv_heads, head_dim";
    for (const auto& [name, t] : {std::pair{"k", &a.k}, std::pair{"v", &a.v}}) {
      if (t->empty() && total_new > 0) {
        return absl::InvalidArgumentError(absl::StrCat(name, " is required: the spans append ",
                                                       total_new,
                                                       " new tokens (num_new_tokens; a "
                                                       "span that only attends sets it to 0)"));
      }
    }
    if (s = CheckTensor("k", a.k, kv_shape, kv_names); !s.ok()) return s;
    if (s = CheckTensor("v", a.v, kv_shape, kv_names); !s.ok()) return s;
    if (a.k.dtype != a.v.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("k and v must have the same dtype (got ",
                                                     DTypeName(a.k.dtype), " and ",
                                                     DTypeName(a.v.dtype), ")"));
    }
  }
  if (a.sm_scale.has_value() && !(std::isfinite(*a.sm_scale) && *a.sm_scale > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.sm_scale must be positive and finite (got ", *a.sm_scale, ")"));
  }
  // A capped layer's scores scale by sm_scale / cap before their tanh (the GPU's Q tile carries
  // it): at most 2^21, so that they stay finite. The default sm_scale always passes
  // (kMinLogitSoftcap).
  if (const LayerAttention* v = g.attention(a.layer);
      a.sm_scale.has_value() && v != nullptr && v->logit_softcap > 0.f &&
      !(*a.sm_scale / v->logit_softcap <= kMaxSoftcapScale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.sm_scale=", *a.sm_scale, " over layer ", a.layer, "'s logit_softcap=",
        v->logit_softcap, " is ", *a.sm_scale / v->logit_softcap, "; at most ", kMaxSoftcapScale,
        " (2^21): use an sm_scale of at most ", v->logit_softcap * kMaxSoftcapScale));
  }
  if (a.device_tensors) {
    if (!(total_q == 0 && a.q.empty() && a.out.empty())) {
      if (s = CheckTensor("out", a.out, {total_q, g.num_q_heads, g.head_dim},
                          "total_queries, num_q_heads, head_dim");
          !s.ok()) {
        return s;
      }
      if (a.out.dtype != a.q.dtype) {
        return absl::InvalidArgumentError(absl::StrCat("out.dtype must be q's, ",
                                                       DTypeName(a.q.dtype), " (got ",
                                                       DTypeName(a.out.dtype), ")"));
      }
    }
    if (a.return_lse) {
      if (s = CheckTensor("lse", a.lse, {total_q, g.num_q_heads}, "total_queries, num_q_heads");
          !s.ok()) {
        return s;
      }
      if (a.lse.dtype != DType::kFloat32) {
        return absl::InvalidArgumentError(
            absl::StrCat("lse.dtype must be FLOAT32 (got ", DTypeName(a.lse.dtype), ")"));
      }
    } else if (!a.lse.empty()) {
      return absl::InvalidArgumentError("lse is set but options.return_lse is false");
    }
    return absl::OkStatus();  // the answer is written in place: no response size to check
  }
  // The answer must be sendable, or the K/V would be committed for a reply the caller never
  // gets.
  const DType out_dtype = ForwardOutDType(g, a);
  const int64_t response_bytes = ForwardResponseBytes(g, a);
  if (limits_.max_response_bytes > 0 && response_bytes > limits_.max_response_bytes) {
    return WithErrorInfo(
        absl::ResourceExhaustedError(
            absl::StrCat("the response would be ", response_bytes, " bytes (", total_q,
                         " queries x ", g.num_q_heads, " heads x ", g.head_dim, " x ",
                         DTypeName(out_dtype), a.return_lse ? ", plus lse" : "",
                         "), over the server's largest message of ", limits_.max_response_bytes,
                         " bytes (--max_message_mb); send fewer queries per Forward")),
        {"RESPONSE_TOO_LARGE",
         {{"response_bytes", response_bytes}, {"max_message_bytes", limits_.max_response_bytes}}});
  }
  return absl::OkStatus();
}

DType ForwardOutDType(const CacheGeometry& g, const ForwardArgs& a) {
  if (!a.q.empty()) return a.q.dtype;
  return g.kv_dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : g.kv_dtype;
}

ForwardOutputBytes ForwardOutputSizes(const CacheGeometry& g, const ForwardArgs& a) {
  int64_t total_q = 0;
  for (const SpanRequest& s : a.spans) total_q += std::max(0, s.num_queries);
  const int64_t rows = total_q * g.num_q_heads;
  return {.out = rows * g.head_dim * DTypeSize(ForwardOutDType(g, a)),
          .lse = a.return_lse ? rows * static_cast<int64_t>(sizeof(float)) : 0};
}

int64_t ForwardResponseBytes(const CacheGeometry& g, const ForwardArgs& a) {
  const ForwardOutputBytes output = ForwardOutputSizes(g, a);
  return output.out + output.lse + kResponseFramingBytes;
}

ForwardPlan Cache::MakePlan(const ForwardArgs& a, const Reservation& r) const {
  ForwardPlan plan;
  plan.layer = a.layer;
  plan.causal = a.causal.value_or(true);
  plan.sm_scale = a.sm_scale.value_or(geometry_.default_sm_scale());
  plan.return_lse = a.return_lse;
  plan.attention = geometry_.attention(a.layer);
  plan.spans.reserve(a.spans.size());
  size_t pages = 0;
  for (const auto& e : r.entries) pages += static_cast<size_t>(table_.PagesFor(e.kv_len));
  plan.page_table.reserve(pages);
  for (size_t i = 0; i < a.spans.size(); ++i) {
    const SpanRequest& s = a.spans[i];
    SpanPlan sp;
    sp.start = s.start;
    sp.num_new_tokens = s.num_new_tokens;
    sp.num_queries = s.num_queries;
    sp.kv_len = r.entries[i].kv_len;
    sp.q_offset = plan.total_queries;
    sp.kv_offset = plan.total_new_tokens;
    sp.page_table_offset = static_cast<int64_t>(plan.page_table.size());
    sp.num_pages = static_cast<int32_t>(table_.PagesFor(sp.kv_len));
    sp.committed_len = r.entries[i].old_len;
    const Sequence* seq = table_.Find(s.seq_id);
    // A reserved span's sequence exists and covers kv_len (an attend-only span of length 0
    // has no pages to list).
    if (seq != nullptr) {
      plan.page_table.insert(plan.page_table.end(), seq->pages.begin(),
                             seq->pages.begin() + sp.num_pages);
    }
    plan.total_queries += s.num_queries;
    plan.total_new_tokens += s.num_new_tokens;
    plan.max_queries_per_span = std::max(plan.max_queries_per_span, s.num_queries);
    plan.max_kv_len = std::max(plan.max_kv_len, sp.kv_len);
    plan.spans.push_back(sp);
  }
  return plan;
}

namespace {
double MicrosSince(absl::Time start) { return absl::ToDoubleMicroseconds(absl::Now() - start); }
}  // namespace

absl::StatusOr<ForwardResult> Cache::Forward(const ForwardArgs& a, const StopToken& stop,
                                             ForwardTimings* timings) {
  const absl::Time start = absl::Now();
  const Call call(this);
  if (absl::Status s = ValidateForward(a); !s.ok()) return s;
  const CacheGeometry& g = geometry_;

  absl::ReaderMutexLock structure(&structure_mu_);
  absl::MutexLock layer_lock(layer_mu_[a.layer].get());
  // Waiting for the layer may have taken the caller's whole deadline.
  if (absl::Status s = stop.Check(); !s.ok()) return s;

  std::vector<SpanWrite> writes;
  writes.reserve(a.spans.size());
  for (const SpanRequest& s : a.spans) writes.push_back({s.seq_id, s.start, s.num_new_tokens});
  Reservation reservation;
  ForwardPlan plan;
  {
    absl::MutexLock meta(&meta_mu_);
    absl::StatusOr<Reservation> r = table_.Reserve(a.layer, writes);
    if (!r.ok()) return r.status();
    reservation = *std::move(r);
    plan = MakePlan(a, reservation);
  }
  plan.stop = stop;

  ForwardResult result;
  // An append-only request may omit q: its (empty) output then takes ForwardOutDType.
  result.out_dtype = ForwardOutDType(g, a);
  result.out_shape = {plan.total_queries, g.num_q_heads, g.head_dim};
  if (a.return_lse) result.lse_shape = {plan.total_queries, g.num_q_heads};
  const size_t out_bytes = static_cast<size_t>(plan.total_queries) * g.num_q_heads * g.head_dim *
                           DTypeSize(result.out_dtype);
  const size_t lse_bytes =
      a.return_lse ? static_cast<size_t>(plan.total_queries) * g.num_q_heads * sizeof(float) : 0;
  if (a.buffers == nullptr && !a.device_tensors) {  // the answer in strings of its own
    result.out.resize(out_bytes);
    result.lse.resize(lse_bytes);
  }
  ForwardIO io;
  io.q_dtype = result.out_dtype;
  io.q = a.q.data;
  io.kv_dtype = a.k.dtype;
  io.k = plan.total_new_tokens > 0 ? a.k.data : nullptr;
  io.v = plan.total_new_tokens > 0 ? a.v.data : nullptr;
  io.out = a.buffers == nullptr ? result.out.data() : nullptr;
  io.lse =
      a.buffers == nullptr && a.return_lse ? reinterpret_cast<float*>(result.lse.data()) : nullptr;
  io.buffers = a.buffers;
  if (a.device_tensors) {  // the caller's device memory, writable (RegisterMemory)
    io.device_tensors = true;
    io.out = const_cast<void*>(a.out.data);
    io.lse = static_cast<float*>(const_cast<void*>(a.lse.data));
    io.wait_event = a.wait_event;
    io.done_event = a.done_event;
  }
  io.timings = timings;
  if (timings != nullptr) timings->validate_us = MicrosSince(start);

  // An exception from the backend (memory it could not have) fails the Forward like any error:
  // the reservation rolled back, not left behind by the unwinding.
  absl::Status s;
  try {
    s = backend_->Forward(*pool_, g, plan, io);
  } catch (const std::bad_alloc&) {
    s = absl::ResourceExhaustedError(
        "the server could not allocate this Forward's working memory: send fewer tokens a "
        "Forward, or leave memory beside the caches' pools");
  } catch (const std::exception& e) {
    s = absl::InternalError(absl::StrCat("the Forward failed: ", e.what()));
  }
  const absl::Time commit_start = absl::Now();
  {
    absl::MutexLock meta(&meta_mu_);
    if (s.ok()) {
      table_.Commit(reservation);
    } else {
      table_.Rollback(reservation);
    }
  }
  if (timings != nullptr) timings->commit_us = MicrosSince(commit_start);
  if (!s.ok()) return s;
  forward_calls_.fetch_add(1, std::memory_order_relaxed);
  return result;
}

absl::StatusOr<TruncateResult> Cache::Truncate(
    int32_t layer, absl::Span<const std::pair<uint64_t, int64_t>> lengths) {
  const Call call(this);
  if (layer < 0 || layer >= geometry_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer must be in 0..", geometry_.num_layers - 1, " (got ", layer, ")"));
  }
  absl::flat_hash_set<uint64_t> seen;
  seen.reserve(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    const auto& [seq_id, length] = lengths[i];
    if (length < 0) {
      return absl::InvalidArgumentError(absl::StrCat("lengths[", i, "].length must be >= 0 (got ",
                                                     length, ", for sequence ", seq_id, ")"));
    }
    if (!seen.insert(seq_id).second) {
      return absl::InvalidArgumentError(absl::StrCat("lengths[", i, "].seq_id: sequence ", seq_id,
                                                     " appears more than once in lengths (give "
                                                     "each once)"));
    }
  }
  absl::ReaderMutexLock structure(&structure_mu_);
  absl::MutexLock layer_lock(layer_mu_[layer].get());
  absl::MutexLock meta(&meta_mu_);
  TruncateResult r;
  for (const auto& [seq_id, length] : lengths) {
    const Sequence* seq = table_.Find(seq_id);
    if (seq == nullptr) {
      r.unknown_seq_ids.push_back(seq_id);
      continue;
    }
    if (seq->layer_len[layer] > length) ++r.truncated;
    r.freed_pages += table_.Truncate(layer, seq_id, length);
  }
  return r;
}

ReleaseResult Cache::Release(absl::Span<const uint64_t> seq_ids) {
  const Call call(this);
  absl::MutexLock structure(&structure_mu_);
  absl::MutexLock meta(&meta_mu_);
  ReleaseResult r;
  absl::flat_hash_set<uint64_t> seen;
  seen.reserve(seq_ids.size());
  for (uint64_t id : seq_ids) {
    if (!seen.insert(id).second) continue;  // an id given twice is released (and counted) once
    const int64_t freed = table_.Release(id);
    if (freed < 0) {
      r.unknown_seq_ids.push_back(id);
    } else {
      ++r.released;
      r.freed_pages += freed;
    }
  }
  return r;
}

CacheStats Cache::Stats() const {
  absl::MutexLock meta(&meta_mu_);
  CacheStats s;
  s.free_pages = table_.pool().num_free();
  s.used_pages = table_.pool().num_used();
  s.live_sequences = table_.num_sequences();
  s.forward_calls = forward_calls_.load(std::memory_order_relaxed);
  // A cache with a call on it is not idle, however long ago the call began.
  s.idle_ms = in_use() ? 0
                       : std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  std::chrono::steady_clock::now() - last_used())
                                                  .count());
  return s;
}

}  // namespace pagedattn
