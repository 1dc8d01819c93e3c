// The oracle for attention: float64 over one sequence's contiguous K/V. Used by the CLI's
// smoke check and by the CPU, kernel and end-to-end tests. Inputs are floats already rounded.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pagedattn::testing {

// A layer's attention variant (pagedattn.v1.LayerAttention); zero / empty: none.
struct ReferenceVariant {
  int64_t window = 0;         // a query at p sees p - window + 1 .. p
  double softcap = 0;         // scores become softcap * tanh(score / softcap)
  std::vector<double> sinks;  // one logit per q head in the denominator
};

// q: [num_queries][num_q_heads][head_dim]; k, v: [kv_len][num_kv_heads][head_dim].
// Query i sits at position kv_len - num_queries + i; causal means it sees positions <= its own.
// out: [num_queries][num_q_heads][head_dim]; lse (natural log): [num_queries][num_q_heads].
inline void ReferenceAttention(const float* q, const float* k, const float* v, int num_queries,
                               int64_t kv_len, int num_q_heads, int num_kv_heads, int head_dim,
                               bool causal, double sm_scale, double* out, double* lse,
                               const ReferenceVariant& variant = {}) {
  const int group = num_q_heads / num_kv_heads;
  std::vector<double> scores(static_cast<size_t>(kv_len));
  for (int i = 0; i < num_queries; ++i) {
    const int64_t pos = kv_len - num_queries + i;
    const int64_t first = variant.window > 0 ? std::max<int64_t>(0, pos - variant.window + 1) : 0;
    const int64_t visible = causal ? pos + 1 : kv_len;
    for (int h = 0; h < num_q_heads; ++h) {
      const int kvh = h / group;
      const float* qi = q + (int64_t{i} * num_q_heads + h) * head_dim;
      const bool sink = !variant.sinks.empty();
      double m = sink ? variant.sinks[h] : -std::numeric_limits<double>::infinity();
      for (int64_t j = first; j < visible; ++j) {
        const float* kj = k + (j * num_kv_heads + kvh) * head_dim;
        double s = 0;
        for (int d = 0; d < head_dim; ++d) s += double{qi[d]} * double{kj[d]};
        scores[j] = s * sm_scale;
        if (variant.softcap > 0)
          scores[j] = variant.softcap * std::tanh(scores[j] / variant.softcap);
        m = std::max(m, scores[j]);
      }
      double denom = sink ? std::exp(variant.sinks[h] - m) : 0;
      for (int64_t j = first; j < visible; ++j) denom += std::exp(scores[j] - m);
      double* o = out + (int64_t{i} * num_q_heads + h) * head_dim;
      std::fill(o, o + head_dim, 0.0);
      for (int64_t j = first; j < visible; ++j) {
        const double p = std::exp(scores[j] - m) / denom;
        const float* vj = v + (j * num_kv_heads + kvh) * head_dim;
        for (int d = 0; d < head_dim; ++d) o[d] += p * double{vj[d]};
      }
      if (lse) lse[int64_t{i} * num_q_heads + h] = m + std::log(denom);
    }
  }
}

// ||a - b|| / ||b|| over n elements (b the reference).
inline double RelativeError(const double* a, const double* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace pagedattn::testing
