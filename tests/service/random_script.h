// Random cache configs and random scripts of Forwards on them, for the tests that hold the
// promise that a config CreateCache accepts never fails a Forward (config_fuzz_test, ipc_test):
// the generators, and a script's Forward as a ForwardCall and its answer's bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/capabilities.h"
#include "common/dtype.h"

namespace pagedattn::random_script {

inline int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// How large a script may grow: the CPU backend computes every answer, so its cost is bounded by
// the queries a Forward holds and the positions they see.
struct ScriptLimits {
  int max_len = 1200;          // positions a sequence may reach in a layer
  int max_new = 400;           // new tokens a span appends
  int max_step_queries = 160;  // queries a Forward holds
  int max_heads_x_dim = 4096;  // num_q_heads * head_dim
  int steps = 5;               // Forwards a config runs
};

template <typename T>
T Choose(std::mt19937& rng, std::initializer_list<T> xs) {
  return *(xs.begin() + rng() % xs.size());
}

inline bool Percent(std::mt19937& rng, int p) { return static_cast<int>(rng() % 100) < p; }

// A config mostly inside the capability table; about a fifth of them carry some field past it.
inline v1::CacheConfig RandomConfig(std::mt19937& rng, const ScriptLimits& limits) {
  v1::CacheConfig c;
  c.set_num_layers(1 + static_cast<int>(rng() % 3));
  int kv_heads = Choose(rng, {1, 2, 3, 4, 8});
  int gqa = Choose(rng, {1, 2, 3, 4, 5, 7, 8});
  int head_dim = Percent(rng, 92) ? kCudaHeadDims[rng() % kCudaHeadDims.size()]
                                  : Choose(rng, {32, 100, 160, 1024});
  while (kv_heads * gqa * head_dim > limits.max_heads_x_dim && kv_heads * gqa > 1) {
    if (gqa > 1) {
      gqa = std::max(1, gqa / 2);
    } else {
      kv_heads = std::max(1, kv_heads / 2);
    }
  }
  c.set_num_kv_heads(kv_heads);
  c.set_num_q_heads(Percent(rng, 4) ? kv_heads * gqa + 1 : kv_heads * gqa);
  c.set_head_dim(head_dim);
  // Pages 1..1024, log-uniform (small and odd ones as often as large ones), a few out of range.
  const int page = static_cast<int>(std::exp2(std::uniform_real_distribution<double>(0, 10)(rng)));
  c.set_page_size(Percent(rng, 4) ? Choose(rng, {0, 1025}) : std::clamp(page, 1, 1024));
  const int dtype_pick = static_cast<int>(rng() % 100);
  c.set_kv_dtype(dtype_pick < 35   ? v1::BFLOAT16
                 : dtype_pick < 60 ? v1::FLOAT16
                 : dtype_pick < 90 ? v1::FLOAT8_E4M3
                                   : v1::FLOAT32);
  if (c.kv_dtype() == v1::FLOAT8_E4M3) {
    const int scaling = static_cast<int>(rng() % 3);
    if (scaling == 1) c.set_kv_scaling(v1::PER_TOKEN);
    if (scaling == 2) {
      c.set_kv_scaling(v1::STATIC);
      // The data are N(0, 1): 4-5 sigma at most, E4M3's 448 at 1/100 of it.
      const int n = Percent(rng, 50) ? 2 : 2 * c.num_layers();
      for (int i = 0; i < n; ++i) {
        c.add_kv_scales(std::uniform_real_distribution<float>(0.008f, 0.03f)(rng));
      }
      if (Percent(rng, 5)) c.set_kv_scales(0, -1.f);
    }
  }
  const int layer_entries = Choose(rng, {0, 0, 1, c.num_layers()});
  for (int l = 0; l < layer_entries; ++l) {
    v1::LayerAttention* a = c.add_layers();
    if (Percent(rng, 40)) a->set_sliding_window(Percent(rng, 3) ? 0 : 1 + rng() % 1500);
    if (Percent(rng, 30)) {
      a->set_logit_softcap(Percent(rng, 3) ? -1.f
                                           : std::uniform_real_distribution<float>(2, 60)(rng));
    }
    if (Percent(rng, 25)) {
      const int n = Percent(rng, 4) ? c.num_q_heads() + 1 : c.num_q_heads();
      for (int h = 0; h < n; ++h) a->add_sinks(std::normal_distribution<float>(1.f, 1.f)(rng));
    }
  }
  // Room for four sequences of max_len positions (a page holds every layer's rows).
  const int ps = std::max(1, c.page_size());
  c.set_num_pages(4 * ((limits.max_len + ps - 1) / ps + 1) + 2);
  return c;
}

inline std::string Describe(const v1::CacheConfig& c) {
  std::string s =
      absl::StrCat("layers=", c.num_layers(), " q/kv=", c.num_q_heads(), "/", c.num_kv_heads(),
                   " d=", c.head_dim(), " page=", c.page_size(), " ", v1::DType_Name(c.kv_dtype()));
  if (c.kv_dtype() == v1::FLOAT8_E4M3) {
    absl::StrAppend(&s, " ", v1::KvScaling_Name(c.kv_scaling()), "(", c.kv_scales_size(), ")");
  }
  for (int l = 0; l < c.layers_size(); ++l) {
    const v1::LayerAttention& a = c.layers(l);
    absl::StrAppend(&s, " [", l, ":");
    if (a.has_sliding_window()) absl::StrAppend(&s, " w=", a.sliding_window());
    if (a.has_logit_softcap()) absl::StrAppend(&s, " cap=", a.logit_softcap());
    if (a.sinks_size() > 0) absl::StrAppend(&s, " sinks=", a.sinks_size());
    absl::StrAppend(&s, "]");
  }
  return s;
}

// A script's Forward: spans over up to three of four sequences, each an append at the
// sequence's length (prefill, chunked prefill, decode, speculative tokens), a rewind, an
// attend-only span or an append-only one, in one layer, with random tensors and options.
class ScriptWriter {
 public:
  ScriptWriter(const v1::CacheConfig& config, const ScriptLimits& limits, std::mt19937& rng)
      : config_(config),
        limits_(limits),
        rng_(rng),
        len_(5, std::vector<int64_t>(config.num_layers(), 0)) {}

  // A sequence released (ReleaseSequences): every layer's length back to 0.
  void Release(int seq) { std::fill(len_[seq].begin(), len_[seq].end(), 0); }
  int RandomSequence() { return 1 + static_cast<int>(rng_() % 4); }

  // Pages the live sequences hold: a page holds page_size positions of every layer, so a
  // sequence holds its longest layer's.
  int64_t PagesHeld() const {
    int64_t pages = 0;
    for (const std::vector<int64_t>& layers : len_) {
      const int64_t longest = *std::max_element(layers.begin(), layers.end());
      pages += (longest + config_.page_size() - 1) / config_.page_size();
    }
    return pages;
  }

  // One Forward on `layer` (-1: a random one).
  v1::ForwardRequest Next(int layer = -1) {
    v1::ForwardRequest req;
    if (layer < 0) layer = static_cast<int>(rng_() % config_.num_layers());
    req.set_layer(layer);
    std::vector<int> seqs = {1, 2, 3, 4};
    std::shuffle(seqs.begin(), seqs.end(), rng_);
    seqs.resize(1 + rng_() % 3);
    int64_t total_q = 0, total_new = 0;
    for (int seq : seqs) {
      int64_t& len = len_[seq][layer];
      const int64_t q_room = limits_.max_step_queries - total_q;
      if (q_room <= 0) break;
      int64_t start = len, add = 0, queries = 0;
      const int kind = len == 0 ? 0 : static_cast<int>(rng_() % 6);
      switch (kind) {
        case 0:  // prefill or chunked prefill: queries over the new tokens (some, all, none)
          add = 1 + rng_() % limits_.max_new;
          queries = Percent(rng_, 60) ? add : rng_() % (add + 1);
          break;
        case 1:  // decode
          add = queries = 1;
          break;
        case 2:  // speculative tokens
          add = queries = 2 + rng_() % 3;
          break;
        case 3:  // attend-only
          queries = 1 + rng_() % std::min<int64_t>(len, 8);
          break;
        case 4:  // rewind, then append
          start = rng_() % len;
          add = 1 + rng_() % 100;
          queries = 1 + rng_() % add;
          break;
        default:  // append-only
          add = 1 + rng_() % 64;
          break;
      }
      add = std::min<int64_t>(add, limits_.max_len - start);
      if (add <= 0 && kind != 3) continue;
      queries = std::min({queries, start + add, q_room});
      v1::Span* sp = req.add_spans();
      sp->set_seq_id(seq);
      sp->set_start(start);
      sp->set_num_new_tokens(static_cast<int32_t>(add));
      sp->set_num_queries(static_cast<int32_t>(queries));
      len = start + add;
      total_q += queries;
      total_new += add;
    }
    if (req.spans_size() == 0) {  // every sequence full: attend the first one's last position
      v1::Span* sp = req.add_spans();
      sp->set_seq_id(seqs[0]);
      sp->set_start(len_[seqs[0]][layer]);
      sp->set_num_queries(len_[seqs[0]][layer] > 0 ? 1 : 0);
      sp->set_num_new_tokens(len_[seqs[0]][layer] > 0 ? 0 : 1);
      len_[seqs[0]][layer] += sp->num_new_tokens();
      total_q += sp->num_queries();
      total_new += sp->num_new_tokens();
    }
    SetTensors(req, total_q, total_new);
    if (Percent(rng_, 10)) req.mutable_options()->set_causal(false);
    if (Percent(rng_, 15)) {
      req.mutable_options()->set_sm_scale(std::uniform_real_distribution<float>(0.02f, 0.2f)(rng_));
    }
    req.mutable_options()->set_return_lse(Percent(rng_, 70));
    return req;
  }

  // A step of a model: layer 0's Forward, then every other layer's over the same spans and
  // options, each with tensors of its own (a Step stream's messages, in order). Every layer's
  // lengths then follow layer 0's.
  std::vector<v1::ForwardRequest> NextStep() {
    std::vector<v1::ForwardRequest> step = {Next(0)};
    for (std::vector<int64_t>& layers : len_) std::fill(layers.begin(), layers.end(), layers[0]);
    int64_t total_q = 0, total_new = 0;
    for (const v1::Span& sp : step[0].spans()) {
      total_q += sp.num_queries();
      total_new += sp.num_new_tokens();
    }
    for (int layer = 1; layer < config_.num_layers(); ++layer) {
      v1::ForwardRequest req;
      req.set_layer(layer);
      *req.mutable_spans() = step[0].spans();
      *req.mutable_options() = step[0].options();
      SetTensors(req, total_q, total_new);
      step.push_back(std::move(req));
    }
    return step;
  }

 private:
  // q for total_q queries, k and v for total_new tokens, each in a random wire dtype.
  void SetTensors(v1::ForwardRequest& req, int64_t total_q, int64_t total_new) {
    const v1::DType q_dtype = Choose(rng_, {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16});
    const v1::DType kv_dtype = Choose(rng_, {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16});
    const int64_t d = config_.head_dim();
    // q's values exact in bfloat16 (and so in float16): the tiles compute S in the cache's
    // 16-bit type, so a float32 q rounds there, which the CPU backend does not do; that rounding
    // is cuda_backend_test's QAndOutInTheirOwnDtypeMatchTheFloatPath. Here it would only widen
    // the tolerance (0.01-0.05 of an LSE at sm_scale 0.2, head_dim 512).
    std::vector<float> q = Values(total_q * config_.num_q_heads() * d);
    for (float& x : q) x = ExactInBf16(x);
    *req.mutable_q() = MakeTensor(q_dtype, {total_q, config_.num_q_heads(), d}, q);
    if (total_new > 0) {
      const std::vector<int64_t> shape = {total_new, config_.num_kv_heads(), d};
      *req.mutable_k() =
          MakeTensor(kv_dtype, shape, Values(total_new * config_.num_kv_heads() * d));
      *req.mutable_v() =
          MakeTensor(kv_dtype, shape, Values(total_new * config_.num_kv_heads() * d));
    }
  }

  static float ExactInBf16(float x) {
    char buf[2];
    StoreFromFloat(DType::kBFloat16, buf, 0, x);
    return LoadAsFloat(DType::kBFloat16, buf, 0);
  }

  std::vector<float> Values(int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    std::normal_distribution<float> dist;
    for (float& x : v) x = dist(rng_);
    return v;
  }

  const v1::CacheConfig& config_;
  const ScriptLimits& limits_;
  std::mt19937& rng_;
  std::vector<std::vector<int64_t>> len_;  // [seq][layer]
};

inline std::string SpansOf(const v1::ForwardRequest& r) {
  std::string s = absl::StrCat(
      "layer ", r.layer(), r.options().has_causal() ? " non-causal" : "",
      r.options().has_sm_scale() ? absl::StrCat(" sm_scale=", r.options().sm_scale()) : "", ":");
  for (const v1::Span& sp : r.spans()) {
    absl::StrAppend(&s, " {", sp.seq_id(), ",", sp.start(), ",", sp.num_new_tokens(), ",",
                    sp.num_queries(), "}");
  }
  return s;
}

// One of the script's Forwards as a ForwardCall (its tensors the request's bytes). A Step
// stream's first message of a step opens it: the cache, spans and options; the others carry only
// a layer and its tensors (the server runs them with the open step's).
inline ForwardCall CallOf(const v1::ForwardRequest& r, const std::string& cache,
                          bool opens = true) {
  ForwardCall call;
  call.layer = r.layer();
  if (opens) {
    call.cache_id = cache;
    for (const v1::Span& sp : r.spans()) {
      call.spans.push_back({sp.seq_id(), sp.start(), sp.num_new_tokens(), sp.num_queries()});
    }
    if (r.options().has_causal()) call.options.causal = r.options().causal();
    if (r.options().has_sm_scale()) call.options.sm_scale = r.options().sm_scale();
    call.options.return_lse = r.options().return_lse();
  }
  auto arg = [](const v1::Tensor& t) {
    return TensorArg::Host(t.dtype(), {t.shape().begin(), t.shape().end()}, t.data().data(),
                           t.data().size());
  };
  call.q = arg(r.q());
  if (r.has_k()) {
    call.k = arg(r.k());
    call.v = arg(r.v());
  }
  return call;
}

// A Forward's answer as bytes: out's (in q's dtype and shape) and lse's.
struct AnswerBytes {
  std::string out, lse;
  // Room for the answer to `r`.
  static AnswerBytes For(const v1::ForwardRequest& r) {
    const size_t lse_floats = r.options().return_lse() ? r.q().shape(0) * r.q().shape(1) : 0;
    return {std::string(r.q().data().size(), '\0'), std::string(lse_floats * sizeof(float), '\0')};
  }
  // Where a client writes the answer: no lse buffer where none was asked for.
  ForwardOutput Output() {
    return {out.data(), out.size(), lse.empty() ? nullptr : reinterpret_cast<float*>(lse.data()),
            lse.size()};
  }
};

}  // namespace pagedattn::random_script
