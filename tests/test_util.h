// Test helpers: random inputs rounded to a dtype, a host model of every (layer, sequence)'s
// K/V, and a Forward runner that checks a Cache's answer against the float64 reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/reference.h"
#include "server/core/cache.h"

namespace pagedattn::testing {

inline std::vector<char> Encode(DType t, const std::vector<float>& values) {
  std::vector<char> out(values.size() * DTypeSize(t));
  for (size_t i = 0; i < values.size(); ++i)
    StoreFromFloat(t, out.data(), static_cast<int64_t>(i), values[i]);
  return out;
}

inline std::vector<float> Decode(DType t, const void* data, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = LoadAsFloat(t, data, i);
  return out;
}

inline float RoundTo(DType t, float x) {
  char buf[4];
  StoreFromFloat(t, buf, 0, x);
  return LoadAsFloat(t, buf, 0);
}

// Relative-error tolerance of an output stored in dtype t.
inline double ToleranceFor(DType t) {
  return t == DType::kFloat32 ? 1e-5 : (t == DType::kFloat16 ? 2e-3 : 1e-2);
}

struct SpanCase {
  uint64_t seq_id;
  int64_t start;
  int32_t num_new;
  int32_t num_queries;
};

// Keeps what each (layer, sequence) should hold and drives Forward calls on a Cache.
class ForwardModel {
 public:
  ForwardModel(const CacheGeometry& g, DType io_dtype, uint64_t seed)
      : g_(g), io_dtype_(io_dtype), rng_(seed) {}

  struct Outcome {
    absl::Status status;
    double max_rel_error = 0;  // Worst span.
    double max_lse_error = 0;
    bool any_nan = false;
    ForwardResult result;
  };

  // Runs one Forward with fresh random K/V/Q; on success checks every span.
  Outcome Run(Cache& cache, int layer, const std::vector<SpanCase>& spans, bool causal = true,
              std::optional<float> sm_scale = std::nullopt) {
    const int D = g_.head_dim, Hq = g_.num_q_heads, Hkv = g_.num_kv_heads;
    std::vector<float> q, k, v;
    int64_t total_q = 0, total_new = 0;
    // K/V as the cache will hold them: rounded to the I/O dtype, then to the cache dtype; an
    // FP8 cache's reference keeps them unquantized (its error is what the tests bound).
    auto kv_value = [&](int64_t i) {
      const float x = RoundTo(io_dtype_, dist_(rng_) * kv_scale_ * ChannelGain(i % D));
      return g_.kv_dtype == DType::kFloat8E4M3 ? x : RoundTo(g_.kv_dtype, x);
    };
    for (const SpanCase& s : spans) {
      for (int64_t i = 0; i < int64_t{s.num_new} * Hkv * D; ++i) {
        k.push_back(kv_value(i));
        v.push_back(kv_value(i));
      }
      for (int64_t i = 0; i < int64_t{s.num_queries} * Hq * D; ++i) {
        // q shrinks where K grows (SetKvShape), so that the scores keep their spread.
        q.push_back(RoundTo(io_dtype_, dist_(rng_) / (kv_scale_ * ChannelGain(i % D))));
      }
      total_q += s.num_queries;
      total_new += s.num_new;
    }
    std::vector<char> qb = Encode(io_dtype_, q), kb = Encode(io_dtype_, k),
                      vb = Encode(io_dtype_, v);
    ForwardArgs a;
    a.layer = layer;
    for (const SpanCase& s : spans)
      a.spans.push_back({s.seq_id, s.start, s.num_new, s.num_queries});
    a.q = {io_dtype_, {total_q, Hq, D}, qb.data(), qb.size()};
    if (total_new > 0) {
      a.k = {io_dtype_, {total_new, Hkv, D}, kb.data(), kb.size()};
      a.v = {io_dtype_, {total_new, Hkv, D}, vb.data(), vb.size()};
    }
    a.causal = causal;
    a.sm_scale = sm_scale;
    a.return_lse = true;
    Outcome o;
    absl::StatusOr<ForwardResult> r = cache.Forward(a);
    o.status = r.status();
    if (!r.ok()) return o;
    o.result = *r;
    // Update the model, then check each span.
    int64_t kv_row = 0, q_row = 0;
    const double scale = sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(double(D));
    for (const SpanCase& s : spans) {
      auto& [kh, vh] = kv_[{layer, s.seq_id}];
      if (s.num_new > 0) {
        kh.resize(static_cast<size_t>(s.start) * Hkv * D);
        vh.resize(kh.size());
        kh.insert(kh.end(), k.begin() + kv_row * Hkv * D,
                  k.begin() + (kv_row + s.num_new) * Hkv * D);
        vh.insert(vh.end(), v.begin() + kv_row * Hkv * D,
                  v.begin() + (kv_row + s.num_new) * Hkv * D);
      }
      kv_row += s.num_new;
      if (s.num_queries == 0) continue;
      const int64_t kv_len = s.start + s.num_new;
      std::vector<double> ref(static_cast<size_t>(s.num_queries) * Hq * D),
          ref_lse(static_cast<size_t>(s.num_queries) * Hq);
      ReferenceVariant variant;
      if (const LayerAttention* a = g_.attention(layer); a != nullptr) {
        variant.window = a->sliding_window;
        variant.softcap = a->logit_softcap;
        variant.sinks.assign(a->sinks.begin(), a->sinks.end());
      }
      ReferenceAttention(&q[q_row * Hq * D], kh.data(), vh.data(), s.num_queries, kv_len, Hq, Hkv,
                         D, causal, scale, ref.data(), ref_lse.data(), variant);
      std::vector<float> got =
          Decode(io_dtype_, r->out.data() + q_row * Hq * D * DTypeSize(io_dtype_),
                 int64_t{s.num_queries} * Hq * D);
      std::vector<double> gotd(got.begin(), got.end());
      for (double x : gotd) o.any_nan |= std::isnan(x);
      o.max_rel_error = std::max(o.max_rel_error, RelativeError(gotd.data(), ref.data(),
                                                                static_cast<int64_t>(gotd.size())));
      const float* lse = reinterpret_cast<const float*>(r->lse.data()) + q_row * Hq;
      for (size_t i = 0; i < ref_lse.size(); ++i) {
        o.any_nan |= std::isnan(lse[i]);
        o.max_lse_error = std::max(o.max_lse_error, std::abs(lse[i] - ref_lse[i]));
      }
      q_row += s.num_queries;
    }
    return o;
  }

  // K and V drawn as N(0, scale^2), with channels d % outlier_every == 0 gain times larger (the
  // few large-magnitude channels of real models' K and V); q's channels drawn as many times
  // smaller, so that the scores (and the softmax's conditioning) stay as without them.
  void SetKvShape(float scale, int outlier_every, float outlier_gain) {
    kv_scale_ = scale;
    outlier_every_ = outlier_every;
    outlier_gain_ = outlier_gain;
  }

  float ChannelGain(int64_t d) const { return d % outlier_every_ == 0 ? outlier_gain_ : 1.f; }

  int64_t Length(int layer, uint64_t seq) const {
    auto it = kv_.find({layer, seq});
    return it == kv_.end()
               ? 0
               : static_cast<int64_t>(it->second.first.size()) / (g_.num_kv_heads * g_.head_dim);
  }

 private:
  CacheGeometry g_;
  DType io_dtype_;
  std::mt19937_64 rng_;
  std::normal_distribution<float> dist_{0.f, 1.f};
  float kv_scale_ = 1.f;
  int outlier_every_ = 1 << 30;
  float outlier_gain_ = 1.f;
  std::map<std::pair<int, uint64_t>, std::pair<std::vector<float>, std::vector<float>>> kv_;
};

inline CacheGeometry MakeGeometry(int layers, int hq, int hkv, int d, int page, DType dtype,
                                  int64_t pages) {
  CacheGeometry g;
  g.num_layers = layers;
  g.num_q_heads = hq;
  g.num_kv_heads = hkv;
  g.head_dim = d;
  g.page_size = page;
  g.kv_dtype = dtype;
  g.num_pages = pages;
  return g;
}

}  // namespace pagedattn::testing
