// RunSmoke: the client keeps its own copy of every K/V row it sent and recomputes each
// span's attention in float64.
#include "client/smoke.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/reference.h"

namespace pagedattn {
namespace {

struct SpanSpec {
  uint64_t seq_id;
  int64_t start;
  int32_t num_new;
  int32_t num_queries;
};

float RoundTo(v1::DType dtype, float x) {
  char buf[4];
  StoreFromFloat(static_cast<DType>(dtype), buf, 0, x);
  return LoadAsFloat(static_cast<DType>(dtype), buf, 0);
}

}  // namespace

absl::StatusOr<SmokeReport> RunSmoke(Client& client, const SmokeOptions& o) {
  SmokeReport report;
  // An FP8 cache takes K/V as bfloat16 (FP8 is no tensor's dtype) and is checked against the
  // unquantized values, within its documented bound (README, FP8 caches).
  const bool fp8 = o.kv_dtype == v1::FLOAT8_E4M3;
  const v1::DType kv_wire = fp8 ? v1::BFLOAT16 : o.kv_dtype;
  report.tolerance = fp8                         ? 0.15
                     : o.kv_dtype == v1::FLOAT32 ? 1e-5
                     : o.kv_dtype == v1::FLOAT16 ? 2e-3
                                                 : 1e-2;
  v1::CacheConfig config;
  config.set_num_layers(2);
  for (const v1::LayerAttention& l : o.layers) *config.add_layers() = l;
  config.set_num_q_heads(o.num_q_heads);
  config.set_num_kv_heads(o.num_kv_heads);
  config.set_head_dim(o.head_dim);
  config.set_page_size(o.page_size);
  config.set_kv_dtype(o.kv_dtype);
  config.set_kv_scaling(o.kv_scaling);
  config.set_device(o.device);
  const size_t num_scales = o.kv_scales.size() > 4 ? 4 : o.kv_scales.size();  // two layers'
  for (size_t i = 0; i < num_scales; ++i) config.add_kv_scales(o.kv_scales[i]);
  // Room for the steps' three sequences of up to 64 tokens at any page size (page_size 1
  // needs 80 pages; 64 left it out of pages).
  config.set_num_pages(std::max(64, 3 * ((64 + o.page_size - 1) / std::max(o.page_size, 1))));
  absl::StatusOr<v1::CacheInfo> cache = client.CreateCache(config, "pagedattn-cli smoke");
  if (!cache.ok()) return cache.status();
  report.cache_id = cache->cache_id();
  absl::StrAppendFormat(
      &report.summary,
      "  config: head_dim %d, page_size %d, %d q / %d kv heads, kv_dtype %s%s, device %d\n",
      o.head_dim, o.page_size, o.num_q_heads, o.num_kv_heads, v1::DType_Name(o.kv_dtype),
      o.kv_scaling == v1::KV_SCALING_UNSPECIFIED
          ? ""
          : absl::StrCat(" (", v1::KvScaling_Name(o.kv_scaling), ")").c_str(),
      o.device);
  // Mixed batches: prefills, a decode, a chunked prefill, an attend-only span, a rewind.
  const std::vector<std::pair<int, std::vector<SpanSpec>>> steps = {
      {0, {{1, 0, 37, 37}, {2, 0, 19, 19}}},
      {0, {{1, 37, 1, 1}, {2, 19, 13, 13}, {3, 0, 5, 5}}},
      {1, {{1, 0, 38, 38}, {3, 0, 5, 2}}},
      {0, {{1, 30, 3, 3}, {2, 0, 0, 0}, {3, 5, 0, 4}}},
  };
  // The longest sequence the steps make: a window at least this long hides no position.
  int64_t longest = 0;
  for (const auto& [layer, spans] : steps) {
    for (const SpanSpec& s : spans) longest = std::max(longest, s.start + s.num_new);
  }
  // Each layer's variant for the reference, and in the summary.
  testing::ReferenceVariant variants[2];
  // (More entries than layers: CreateCache refused the config above.)
  for (int layer = 0; layer < 2 && !o.layers.empty(); ++layer) {
    const v1::LayerAttention& l = o.layers[o.layers.size() == 1 ? 0 : layer];
    testing::ReferenceVariant& r = variants[layer];
    r.window = l.has_sliding_window() ? l.sliding_window() : 0;
    r.softcap = l.has_logit_softcap() ? l.logit_softcap() : 0;
    r.sinks.assign(l.sinks().begin(), l.sinks().end());
    std::vector<std::string> parts;
    if (r.window > 0) {
      parts.push_back(absl::StrCat("window ", r.window));
      if (r.window >= longest) {
        absl::StrAppend(&parts.back(), " (past the smoke's ", longest,
                        " positions: every one visible)");
      }
    }
    if (r.softcap > 0) parts.push_back(absl::StrCat("soft-cap ", r.softcap));
    if (!r.sinks.empty()) parts.push_back(absl::StrCat(r.sinks.size(), " sinks"));
    absl::StrAppend(&report.summary, "  layer ", layer, ": ",
                    parts.empty() ? "plain" : absl::StrJoin(parts, ", "), "\n");
  }
  // Whatever goes wrong below, the cache goes (best effort: the error that ended the run is
  // the one reported).
  bool deleted_cache = false;
  absl::Cleanup delete_cache = [&] {
    if (!deleted_cache) (void)client.DeleteCache(report.cache_id);
  };

  const int D = o.head_dim, Hq = o.num_q_heads, Hkv = o.num_kv_heads;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  // Host copy of each (layer, sequence)'s K and V rows: [pos][Hkv][D], rounded to kv_dtype.
  std::map<std::pair<int, uint64_t>, std::pair<std::vector<float>, std::vector<float>>> kv;

  for (const auto& [layer, spans] : steps) {
    v1::ForwardRequest req;
    req.set_cache_id(report.cache_id);
    req.set_layer(layer);
    req.mutable_options()->set_return_lse(true);
    std::vector<float> q, k, v;
    int64_t total_q = 0, total_new = 0;
    for (const SpanSpec& s : spans) {
      v1::Span* sp = req.add_spans();
      sp->set_seq_id(s.seq_id);
      sp->set_start(s.start);
      sp->set_num_new_tokens(s.num_new);
      sp->set_num_queries(s.num_queries);
      auto& [kh, vh] = kv[{layer, s.seq_id}];
      if (s.num_new > 0) {
        kh.resize(static_cast<size_t>(s.start) * Hkv * D);  // a rewind drops the tail
        vh.resize(kh.size());
      }
      for (int64_t i = 0; i < int64_t{s.num_new} * Hkv * D; ++i) {
        const float kx = RoundTo(kv_wire, normal(rng)), vx = RoundTo(kv_wire, normal(rng));
        k.push_back(kx);
        v.push_back(vx);
        kh.push_back(kx);
        vh.push_back(vx);
      }
      for (int64_t i = 0; i < int64_t{s.num_queries} * Hq * D; ++i)
        q.push_back(RoundTo(o.q_dtype, normal(rng)));
      total_q += s.num_queries;
      total_new += s.num_new;
    }
    *req.mutable_q() = MakeTensor(o.q_dtype, {total_q, Hq, D}, q);
    if (total_new > 0) {
      *req.mutable_k() = MakeTensor(kv_wire, {total_new, Hkv, D}, k);
      *req.mutable_v() = MakeTensor(kv_wire, {total_new, Hkv, D}, v);
    }
    absl::StatusOr<v1::ForwardResponse> resp = client.Forward(req);
    if (!resp.ok()) return resp.status();
    ++report.forwards;
    absl::StatusOr<std::vector<float>> out = TensorToFloats(resp->out());
    if (!out.ok()) return out.status();
    absl::StatusOr<std::vector<float>> lse = TensorToFloats(resp->lse());
    if (!lse.ok()) return lse.status();
    if (static_cast<int64_t>(out->size()) != total_q * Hq * D ||
        static_cast<int64_t>(lse->size()) != total_q * Hq) {
      return absl::DataLossError("Forward returned tensors of the wrong size");
    }
    int64_t q_row = 0;
    double step_err = 0;
    for (const SpanSpec& s : spans) {
      if (s.num_queries == 0) continue;
      const auto& [kh, vh] = kv[{layer, s.seq_id}];
      const int64_t kv_len = s.start + s.num_new;
      std::vector<double> ref(static_cast<size_t>(s.num_queries) * Hq * D),
          ref_lse(static_cast<size_t>(s.num_queries) * Hq);
      testing::ReferenceAttention(&q[q_row * Hq * D], kh.data(), vh.data(), s.num_queries, kv_len,
                                  Hq, Hkv, D, /*causal=*/true, 1.0 / std::sqrt(double(D)),
                                  ref.data(), ref_lse.data(), variants[layer]);
      std::vector<double> got(out->begin() + q_row * Hq * D,
                              out->begin() + (q_row + s.num_queries) * Hq * D);
      const double err =
          testing::RelativeError(got.data(), ref.data(), static_cast<int64_t>(got.size()));
      for (size_t i = 0; i < ref_lse.size(); ++i) {
        const double e = std::abs((*lse)[q_row * Hq + i] - ref_lse[i]);
        report.max_lse_error = std::max(report.max_lse_error, std::isnan(e) ? INFINITY : e);
      }
      step_err = std::max(step_err, std::isnan(err) ? INFINITY : err);
      ++report.spans_checked;
      q_row += s.num_queries;
    }
    report.max_rel_error = std::max(report.max_rel_error, step_err);
    absl::StrAppendFormat(&report.summary,
                          "  forward layer %d, %d spans, %d queries: rel err %.3g\n", layer,
                          spans.size(), total_q, step_err);
  }
  absl::StatusOr<v1::ReleaseSequencesResponse> rel =
      client.ReleaseSequences(report.cache_id, {1, 2, 3});
  if (!rel.ok()) return rel.status();
  absl::StatusOr<v1::CacheInfo> after = client.GetCache(report.cache_id);
  if (!after.ok()) return after.status();
  const bool released_all =
      after->stats().used_pages() == 0 && after->stats().live_sequences() == 0;
  if (!released_all) absl::StrAppend(&report.summary, "  release left pages in use\n");
  absl::StatusOr<int64_t> deleted = client.DeleteCache(report.cache_id);
  deleted_cache = true;
  if (!deleted.ok()) return deleted.status();
  report.passed = released_all && report.max_rel_error <= report.tolerance &&
                  report.max_lse_error <= 10 * report.tolerance;
  return report;
}

}  // namespace pagedattn
