// CUDA backend and kernel tests: Forward on the GPU against the float64 reference over page
// sizes, head dims, GQA ratios, dtypes, ragged decode/prefill/chunked batches. Skips without a GPU.
#include "server/core/cuda_backend.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/capabilities.h"
#include "common/dtype.h"
#include "common/reference.h"
#include "kernels/attention_plan.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"
#include "kernels/submission.h"
#include "kernels/tensor_map.h"
#include "kernels/workspace.h"
#include "server/core/backend.h"
#include "server/core/cache.h"
#include "server/core/cpu_backend.h"
#include "tests/fp8_sweep.h"

namespace pagedattn {
namespace {

#define SKIP_WITHOUT_GPU()                                                                    \
  do {                                                                                        \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU visible: kernel tests need one"; \
  } while (0)

// One sequence's part in one Forward.
struct SpanSpec {
  int new_tokens = 0;
  int queries = 0;
};

struct CaseSpec {
  DType cache_dtype = DType::kBFloat16;
  DType q_dtype = DType::kFloat32;
  DType kv_wire_dtype = DType::kFloat32;
  int head_dim = 128;
  int page_size = 16;
  int num_kv_heads = 2;
  int gqa = 4;
  bool causal = true;
  bool return_lse = true;
  // steps[s][i]: sequence i in Forward s. Every Forward's output is checked.
  std::vector<std::vector<SpanSpec>> steps;
  uint32_t seed = 1;
  // K at position p scaled by 1 + k_ramp * p / 1024: scores that grow along the sequence.
  float k_ramp = 0.f;
  // q's values are exact in this dtype too (kUnspecified: only in q_dtype), so that one seed gives
  // the same queries in any q_dtype that holds them.
  DType q_exact_in = DType::kUnspecified;
  // The layer's attention variant (layer 1 runs it; layer 0 of the cache stays plain). sinks:
  // 1 + h / 4 for q head h (large enough that a sink left out moves out and lse past tolerance).
  int32_t window = 0;
  float softcap = 0.f;
  bool sinks = false;
  // K at this position of sequence 0 is sent as NaN, which the cache stores as 0
  // (AttentionValue), and so does the reference.
  int64_t nan_k_at = -1;
};

std::string Describe(const CaseSpec& c) {
  return std::string(DTypeName(c.cache_dtype)) + " q=" + std::string(DTypeName(c.q_dtype)) +
         " kv_wire=" + std::string(DTypeName(c.kv_wire_dtype)) +
         " d=" + std::to_string(c.head_dim) + " page=" + std::to_string(c.page_size) +
         " kv_heads=" + std::to_string(c.num_kv_heads) + " gqa=" + std::to_string(c.gqa) +
         (c.causal ? " causal" : " non-causal") +
         (c.window > 0 ? " window=" + std::to_string(c.window) : "") +
         (c.softcap > 0 ? " softcap=" + std::to_string(c.softcap) : "") + (c.sinks ? " sinks" : "");
}

float RoundTo(DType t, float f) {
  char buf[4];
  StoreFromFloat(t, buf, 0, f);
  return LoadAsFloat(t, buf, 0);
}

struct SeqState {
  std::vector<int32_t> pages;
  int64_t len = 0;
  std::vector<float> k, v;  // [pos][kv_head][head_dim], rounded to the cache dtype
};

// Runs the case through the CUDA backend and returns the worst relative error seen (out), after
// asserting no NaN and a close LSE. outputs (optional): every step's out, appended.
double RunCase(Backend& backend, const CaseSpec& c, std::vector<double>* outputs = nullptr) {
  const int D = c.head_dim, Hkv = c.num_kv_heads, Hq = Hkv * c.gqa, ps = c.page_size;
  const int num_seqs = static_cast<int>(c.steps.front().size());
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);

  // Final lengths -> pages per sequence, handed out in random pool order.
  std::vector<int64_t> final_len(num_seqs, 0);
  for (const auto& step : c.steps) {
    for (int i = 0; i < num_seqs; ++i) final_len[i] += step[i].new_tokens;
  }
  int64_t total_pages = 0;
  for (int64_t len : final_len) total_pages += (len + ps - 1) / ps;
  total_pages += 3;  // pages nobody uses
  std::vector<int32_t> order(total_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);

  CacheGeometry g;
  g.num_layers = 2;
  g.num_q_heads = Hq;
  g.num_kv_heads = Hkv;
  g.head_dim = D;
  g.page_size = ps;
  g.kv_dtype = c.cache_dtype;
  g.device = 0;
  g.num_pages = total_pages;
  LayerAttention variant;
  variant.sliding_window = c.window;
  variant.logit_softcap = c.softcap;
  for (int h = 0; c.sinks && h < Hq; ++h) variant.sinks.push_back(1.f + 0.25f * h);
  if (!variant.plain()) g.layers = {LayerAttention{}, variant};
  testing::ReferenceVariant ref_variant;
  ref_variant.window = c.window;
  ref_variant.softcap = c.softcap;
  ref_variant.sinks.assign(variant.sinks.begin(), variant.sinks.end());
  absl::StatusOr<std::unique_ptr<KvPool>> pool = backend.AllocatePool(g, StopToken());
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return 1.0;

  std::vector<SeqState> seqs(num_seqs);
  size_t next_page = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const int64_t n = (final_len[i] + ps - 1) / ps;
    seqs[i].pages.assign(order.begin() + next_page, order.begin() + next_page + n);
    next_page += n;
  }

  const int q_size = DTypeSize(c.q_dtype), kv_size = DTypeSize(c.kv_wire_dtype);
  double worst = 0;
  for (size_t step_index = 0; step_index < c.steps.size(); ++step_index) {
    const auto& step = c.steps[step_index];
    ForwardPlan plan;
    plan.layer = 1;
    plan.attention = g.attention(1);
    plan.causal = c.causal;
    plan.sm_scale = 1.f / std::sqrt(static_cast<float>(D));
    plan.return_lse = c.return_lse;
    std::vector<char> q_bytes, k_bytes, v_bytes;
    std::vector<float> q_vals;  // rounded q, [row][Hq][D]
    for (int i = 0; i < num_seqs; ++i) {
      SeqState& s = seqs[i];
      SpanPlan sp;
      sp.start = s.len;
      sp.num_new_tokens = step[i].new_tokens;
      sp.kv_len = s.len + step[i].new_tokens;
      sp.num_queries = std::min<int64_t>(step[i].queries, sp.kv_len);
      sp.q_offset = plan.total_queries;
      sp.kv_offset = plan.total_new_tokens;
      sp.page_table_offset = static_cast<int64_t>(plan.page_table.size());
      sp.num_pages = static_cast<int32_t>((sp.kv_len + ps - 1) / ps);
      plan.page_table.insert(plan.page_table.end(), s.pages.begin(),
                             s.pages.begin() + sp.num_pages);
      // New K/V rows: random in the wire dtype; the cache holds them rounded to its dtype.
      for (int64_t e = 0; e < int64_t{sp.num_new_tokens} * Hkv * D; ++e) {
        const float k_scale = 1.f + c.k_ramp * static_cast<float>(s.len + e / (Hkv * D)) / 1024.f;
        const bool nan_row = i == 0 && s.len + e / (Hkv * D) == c.nan_k_at;
        for (int kv = 0; kv < 2; ++kv) {
          float wire = RoundTo(c.kv_wire_dtype, uni(rng) * (kv == 0 ? k_scale : 1.f));
          if (kv == 0 && nan_row) wire = std::numeric_limits<float>::quiet_NaN();
          auto& bytes = kv == 0 ? k_bytes : v_bytes;
          const size_t at = bytes.size();
          bytes.resize(at + kv_size);
          StoreFromFloat(c.kv_wire_dtype, bytes.data() + at, 0, wire);
          (kv == 0 ? s.k : s.v).push_back(RoundTo(c.cache_dtype, AttentionValue(wire)));
        }
      }
      for (int64_t e = 0; e < int64_t{sp.num_queries} * Hq * D; ++e) {
        float qv = 2.f * uni(rng);
        if (c.q_exact_in != DType::kUnspecified) qv = RoundTo(c.q_exact_in, qv);
        qv = RoundTo(c.q_dtype, qv);
        const size_t at = q_bytes.size();
        q_bytes.resize(at + q_size);
        StoreFromFloat(c.q_dtype, q_bytes.data() + at, 0, qv);
        q_vals.push_back(qv);
      }
      s.len = sp.kv_len;
      plan.total_queries += sp.num_queries;
      plan.total_new_tokens += sp.num_new_tokens;
      plan.max_queries_per_span = std::max(plan.max_queries_per_span, sp.num_queries);
      plan.max_kv_len = std::max(plan.max_kv_len, sp.kv_len);
      plan.spans.push_back(sp);
    }

    // Outputs poisoned: every element must be written.
    std::vector<char> out(plan.total_queries * Hq * D * q_size);
    std::vector<float> lse(plan.total_queries * Hq, std::numeric_limits<float>::quiet_NaN());
    for (int64_t e = 0; e < plan.total_queries * Hq * D; ++e) {
      StoreFromFloat(c.q_dtype, out.data(), e, std::numeric_limits<float>::quiet_NaN());
    }
    ForwardIO io;
    io.q_dtype = c.q_dtype;
    io.q = q_bytes.data();
    io.kv_dtype = c.kv_wire_dtype;
    io.k = plan.total_new_tokens ? k_bytes.data() : nullptr;
    io.v = plan.total_new_tokens ? v_bytes.data() : nullptr;
    io.out = out.data();
    io.lse = c.return_lse ? lse.data() : nullptr;
    const absl::Status st = backend.Forward(**pool, g, plan, io);
    EXPECT_TRUE(st.ok()) << st << " [" << Describe(c) << "]";
    if (!st.ok()) return 1.0;
    if (plan.total_queries == 0) continue;

    // The float64 reference, spans in parallel.
    const int64_t n_out = plan.total_queries * Hq * D;
    std::vector<double> ref(n_out), ref_lse(plan.total_queries * Hq);
    std::vector<std::future<void>> jobs;
    for (int i = 0; i < num_seqs; ++i) {
      const SpanPlan& sp = plan.spans[i];
      if (sp.num_queries == 0) continue;
      jobs.push_back(std::async(std::launch::async, [&, i, sp] {
        testing::ReferenceAttention(q_vals.data() + sp.q_offset * Hq * D, seqs[i].k.data(),
                                    seqs[i].v.data(), sp.num_queries, sp.kv_len, Hq, Hkv, D,
                                    c.causal, plan.sm_scale, ref.data() + sp.q_offset * Hq * D,
                                    ref_lse.data() + sp.q_offset * Hq, ref_variant);
      }));
    }
    for (auto& j : jobs) j.get();

    std::vector<double> got(n_out);
    int64_t nans = 0;
    for (int64_t e = 0; e < n_out; ++e) {
      got[e] = LoadAsFloat(c.q_dtype, out.data(), e);
      nans += std::isnan(got[e]) ? 1 : 0;
    }
    EXPECT_EQ(nans, 0) << "unwritten or NaN outputs, step " << step_index << " [" << Describe(c)
                       << "]";
    if (outputs) outputs->insert(outputs->end(), got.begin(), got.end());
    // Per span, so that a short span's error is not hidden by a long one's.
    for (int i = 0; i < num_seqs; ++i) {
      const SpanPlan& sp = plan.spans[i];
      if (sp.num_queries == 0) continue;
      const int64_t off = sp.q_offset * Hq * D, n = int64_t{sp.num_queries} * Hq * D;
      const double err = testing::RelativeError(got.data() + off, ref.data() + off, n);
      worst = std::max(worst, std::isnan(err) ? 1.0 : err);
      // bf16's 8 bits (in the cache, or in q and out) bound the accuracy; f16's 11 otherwise.
      const bool bf16 = c.cache_dtype == DType::kBFloat16 || c.q_dtype == DType::kBFloat16;
      const double tol = bf16 ? 1e-2 : 2e-3;
      EXPECT_LE(err, tol) << "span " << i << " (kv_len " << sp.kv_len << ", queries "
                          << sp.num_queries << "), step " << step_index << " [" << Describe(c)
                          << "]";
    }
    if (c.return_lse) {
      double max_lse_err = 0;
      for (size_t e = 0; e < ref_lse.size(); ++e) {
        const double d = std::isnan(lse[e]) ? 1e9 : std::abs(lse[e] - ref_lse[e]);
        max_lse_err = std::max(max_lse_err, d / std::max(1.0, std::abs(ref_lse[e])));
      }
      EXPECT_LE(max_lse_err, 1e-2) << "lse, step " << step_index << " [" << Describe(c) << "]";
    }
  }
  return worst;
}

class CudaKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    // PAGEDATTN_PREFILL_KERNEL=portable runs every case on the portable prefill kernel (what
    // the server's --prefill_kernel=portable does), so both kernels are tested on a Hopper GPU.
    const char* prefill = std::getenv("PAGEDATTN_PREFILL_KERNEL");
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(
        {.portable_prefill = prefill != nullptr && std::string(prefill) == "portable"});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  std::unique_ptr<Backend> backend_;
};

// The work the backend plans for these spans: its device's limits for this dtype and head_dim.
kernels::AttentionWork PlannedWork(const std::vector<kernels::AttentionSpan>& spans, int q_heads,
                                   int kv_heads, DType kv_dtype, int head_dim) {
  kernels::AttentionPlanLimits limits;
  const kernels::LaunchStatus st =
      kernels::QueryPlanLimits(kv_dtype, head_dim, kernels::PrefillPath::kAuto, &limits);
  EXPECT_TRUE(st.ok()) << st.message();
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), static_cast<int>(spans.size()), q_heads, kv_heads,
                             /*causal=*/true, /*window=*/0, limits, &work);
  return work;
}

// Two spans of decode rows that fill a wide decode tile (32 rows: 32 q heads with one query, 16
// with two) on 1 kv head over a long history, the plan checked to reach the separate merge (on
// prefill tiles where the device has no decode tiles for the head_dim: 512 on an A100).
CaseSpec WideSeparateMergeCase(int gqa, int head_dim) {
  const int queries = kernels::kDecodeWideTileRows / gqa;
  CaseSpec c;
  c.head_dim = head_dim;
  c.num_kv_heads = 1;
  c.gqa = gqa;
  c.page_size = 16;
  c.steps = {{{30000, 0}, {6000, 0}}, {{queries, queries}, {queries, queries}}};
  const kernels::AttentionWork work =
      PlannedWork({{0, 0, queries, 30000 + queries}, {queries, 1876, queries, 6000 + queries}}, gqa,
                  1, c.cache_dtype, head_dim);
  EXPECT_TRUE(work.separate_merge) << "the case no longer reaches the separate merge";
  kernels::AttentionPlanLimits limits;
  EXPECT_TRUE(
      kernels::QueryPlanLimits(c.cache_dtype, head_dim, kernels::PrefillPath::kAuto, &limits).ok());
  EXPECT_EQ(work.prefill_items.empty(), limits.decode_tiles);
  return c;
}

// A mixed batch: long decode, prefill, chunked prefill, short decode, append-only.
std::vector<std::vector<SpanSpec>> MixedSteps(int long_len) {
  return {
      {{long_len, 0}, {0, 0}, {150, 4}, {37, 0}, {20, 0}},
      {{1, 1}, {90, 90}, {70, 70}, {1, 1}, {5, 0}},
  };
}

TEST_F(CudaKernelTest, SweepPageSizeHeadDimGqa) {
  const int page_sizes[] = {1, 3, 8, 16, 32, 128, 1024};
  const int gqas[] = {1, 4, 8};
  const DType wire[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  int index = 0;
  for (int ps : page_sizes) {
    for (int d : kCudaHeadDims) {
      for (int gqa : gqas) {
        CaseSpec c;
        c.cache_dtype = index % 2 ? DType::kFloat16 : DType::kBFloat16;
        c.q_dtype = index % 3 == 0 ? DType::kFloat32 : c.cache_dtype;
        c.kv_wire_dtype = wire[index % 3];
        c.head_dim = d;
        c.page_size = ps;
        c.num_kv_heads = 2;
        c.gqa = gqa;
        c.causal = index % 5 != 4;
        c.return_lse = index % 7 != 6;
        c.steps = MixedSteps(700 + 97 * index);
        c.seed = 1000 + index;
        RunCase(*backend_, c);
        ++index;
      }
    }
  }
}

// Layer attention variants (CacheConfig.layers) against the reference: each option alone and
// all combined, on pages {1, 7, 16, 128} and GQA {1, 4, 5, 8}, every head_dim and both cache
// dtypes in turn, over the mixed batch (split decode, prefill and chunked prefill tiles, short
// decode): windows shorter and longer than a page and than the sequences, caps that bend most
// scores and few, and one past the Hopper prefill tile's fixed softmax base (Softcap::bounded).
struct VariantCase {
  const char* name;
  int32_t window;
  float softcap;
  bool sinks;
};
constexpr VariantCase kVariants[] = {
    {"window4", 4, 0.f, false},     {"window33", 33, 0.f, false},
    {"window300", 300, 0.f, false}, {"softcap2", 0, 2.f, false},
    {"softcap30", 0, 30.f, false},  {"sinks", 0, 0.f, true},
    {"all", 20, 5.f, true},         {"all_wide", 1000, 50.f, true},
    {"softcap100", 0, 100.f, false}};  // past the fixed softmax base (Softcap::bounded)

TEST_F(CudaKernelTest, VariantSweep) {
  int index = 0;
  for (const VariantCase& v : kVariants) {
    for (int ps : {1, 7, 16, 128}) {
      for (int gqa : {1, 4, 5, 8}) {
        CaseSpec c;
        c.window = v.window;
        c.softcap = v.softcap;
        c.sinks = v.sinks;
        c.head_dim = kCudaHeadDims[index / 2 % kCudaHeadDims.size()];
        c.cache_dtype = index % 2 ? DType::kFloat16 : DType::kBFloat16;
        c.q_dtype = index % 3 == 1 ? c.cache_dtype : DType::kFloat32;
        c.kv_wire_dtype = index % 4 == 3 ? DType::kBFloat16 : DType::kFloat32;
        c.page_size = ps;
        c.num_kv_heads = 2;
        c.gqa = gqa;
        c.causal = index % 6 != 5;
        c.steps = MixedSteps(500 + 37 * index);
        c.seed = 5000 + index;
        SCOPED_TRACE(v.name);
        RunCase(*backend_, c);
        ++index;
      }
    }
  }
}

// Head_dim 512 splits O's columns over two blocks: decode tiles of two blocks, prefill tiles of
// four (two row halves too): decode spans, prefills of 129 and 64 queries x 8 (both row halves,
// a second tile; one row half), a long decode split over the separate merge, plain and with
// every variant, float16 q and out too. (An FP8 cache at 512 runs every span on prefill tiles:
// the FP8 sweep below.)
TEST_F(CudaKernelTest, HeadDim512SplitTiles) {
  const kernels::AttentionWork work = PlannedWork({{0, 0, 1, 6001}}, 16, 2, DType::kBFloat16, 512);
  EXPECT_TRUE(work.separate_merge) << "the case no longer splits its long decode";
  const kernels::AttentionWork fp8 = PlannedWork({{0, 0, 1, 6001}}, 16, 2, DType::kFloat8E4M3, 512);
  EXPECT_TRUE(fp8.decode_items.empty() && fp8.decode_wide_items.empty());
  EXPECT_TRUE(fp8.separate_merge);
  int index = 0;
  for (const VariantCase& v : {VariantCase{"plain", 0, 0.f, false}, kVariants[6], kVariants[7]}) {
    CaseSpec c;
    c.head_dim = 512;
    c.gqa = 8;
    c.window = v.window;
    c.softcap = v.softcap;
    c.sinks = v.sinks;
    c.cache_dtype = index == 1 ? DType::kFloat16 : DType::kBFloat16;
    c.q_dtype = index == 1 ? DType::kFloat16 : DType::kFloat32;
    c.steps = {
        {{6000, 0}, {129, 129}, {40, 0}}, {{1, 1}, {64, 64}, {1, 1}}, {{1, 1}, {1, 1}, {8, 8}}};
    c.seed = 5120 + index++;
    SCOPED_TRACE(v.name);
    RunCase(*backend_, c);
  }
}

// Variants on the long paths: a 4096 window over a 20k decode (the planner starts the splits
// at the window) beside a chunked prefill across the window; sinks through the separate merge
// (one kv head, 32 q heads, long history) and through the split prefill tiles' merge (chunked
// prefill over 10k of history).
TEST_F(CudaKernelTest, VariantsOnSplitAndMergePaths) {
  {
    CaseSpec c;
    c.window = 4096;
    c.softcap = 30.f;
    c.num_kv_heads = 8;
    c.steps = {{{20000, 0}, {4000, 0}}, {{1, 1}, {300, 300}}, {{1, 1}, {1, 1}}};
    RunCase(*backend_, c);
  }
  for (int gqa : {32, 16}) {
    CaseSpec c = WideSeparateMergeCase(gqa, 128);
    c.sinks = true;
    RunCase(*backend_, c);
  }
  {
    CaseSpec c;
    c.sinks = true;
    c.window = 5000;
    c.page_size = 32;
    c.steps = {{{10200, 0}}, {{300, 300}}};
    RunCase(*backend_, c);
  }
}

// Scores that grow steeply along the sequence (K scaled up with the position, 1 + p / 4) make
// the decode tile raise its lazy softmax base again and again, by far more than its slack: a
// base left where a split's first tile put it would overflow 2^(s - base) within that split
// (a kernel that never raised it failed here; one with the slack alone passed before the ramp
// was this steep). Head dims below 128 rescale at every step. Split and unsplit decode, q exact in
// the cache dtype so that scores of thousands carry no rounding of q. Then prefill spans (1 + p /
// 16): the Hopper prefill tile weighs a tile against its rows' base as it stands and tests the
// weights' sums (ExpOnBase); these pass the limit, some past float's range, and the warp
// recomputes the tile's scores (RecomputeS) to raise the base.
TEST_F(CudaKernelTest, GrowingScoresRaiseTheSoftmaxBase) {
  for (int d : kCudaHeadDims) {
    for (bool prefill : {false, true}) {
      CaseSpec c;
      c.head_dim = d;
      c.q_dtype = c.cache_dtype;
      c.kv_wire_dtype = DType::kBFloat16;
      c.k_ramp = prefill ? 64.f : 256.f;
      c.steps = prefill ? decltype(c.steps){{{1500, 1500}, {700, 700}}, {{300, 300}, {1, 1}}}
                        : decltype(c.steps){{{6000, 1}, {700, 1}}, {{1, 1}, {1, 1}}};
      c.seed = (prefill ? 91 : 77) + d;
      RunCase(*backend_, c);
    }
  }
}

// A NaN in K is stored as 0 (AttentionValue), so its scores are finite and every row matches the
// reference: the Hopper prefill kernels (no clamp of their exponents), the plain one and the
// soft-capped one with its fixed base, decode tiles and a chunked prefill.
TEST_F(CudaKernelTest, NanKeysAreStoredAsZero) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (float cap : {0.f, 30.f}) {
      CaseSpec c;
      c.cache_dtype = dt;
      c.softcap = cap;
      c.nan_k_at = 150;
      c.steps = {{{300, 300}, {200, 200}}, {{1, 1}, {1, 1}}, {{40, 40}, {0, 0}}};
      RunCase(*backend_, c);
    }
  }
}

// The same in a batch of more jobs than the Hopper prefill's persistent blocks (16 kv heads: 350
// jobs for 132 blocks); then a chunked prefill over that history, whose long span splits and
// merges. The persistent kernel (head_dim 128, and 96 in 128's layout) and the one-job-a-block
// kernel (64, 256).
TEST_F(CudaKernelTest, NanKeysAmongManyPrefillJobs) {
  for (int d : {64, 96, 128, 256}) {
    CaseSpec c;
    c.head_dim = d;
    c.num_kv_heads = 16;
    c.nan_k_at = 150;
    c.steps = {{{300, 300}, {400, 400}}, {{200, 200}, {3000, 100}}};
    c.seed = 500 + d;
    RunCase(*backend_, c);
  }
}

// Long ragged decode batch (1 .. 10k+ positions): split-KV for the long spans.
TEST_F(CudaKernelTest, RaggedLongDecodeSplit) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    CaseSpec c;
    c.cache_dtype = dt;
    c.q_dtype = dt;
    c.kv_wire_dtype = dt;
    c.page_size = 16;
    c.num_kv_heads = 8;
    c.gqa = 4;
    std::vector<SpanSpec> prior, decode;
    const int lens[] = {10500, 1, 2, 15, 16, 17, 300, 4097, 63, 64, 65, 2047};
    for (int len : lens) {
      prior.push_back({len - 1, 0});
      decode.push_back({1, 1});
    }
    c.steps = {prior, decode};
    RunCase(*backend_, c);
  }
}

// q and out travel in their own dtype. From a Forward with q in the cache's dtype the tiles read q
// and write out as they are; with q in float32 they read and write float; q in the other 16-bit
// type crosses them as a float copy. The same queries (exact in the cache's dtype) sent in
// float32 and in the cache's dtype give outputs that agree bit for bit once the float ones are
// rounded to the cache's dtype: what the two conversion kernels around float tiles gave before q
// and out kept their dtype. Every path against the float64 oracle, outputs poisoned first:
// decode, wide decode, split decode (in-kernel and separate merge), prefill, chunked prefill.
TEST_F(CudaKernelTest, QAndOutInTheirOwnDtypeMatchTheFloatPath) {
  for (DType cache : {DType::kBFloat16, DType::kFloat16}) {
    const DType other = cache == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
    for (int head_dim : kCudaHeadDims) {
      CaseSpec mixed;
      mixed.steps = MixedSteps(2500);
      mixed.steps.push_back({{3, 3}, {2, 2}, {130, 130}, {1, 1}, {0, 2}});
      CaseSpec separate_merge;  // 32 q heads on one kv head: split, merged by its own kernel
      separate_merge.num_kv_heads = 1;
      separate_merge.gqa = 32;
      separate_merge.steps = {{{30000, 0}, {5000, 0}}, {{1, 1}, {1, 1}}};
      for (CaseSpec c : {mixed, separate_merge}) {
        c.cache_dtype = cache;
        c.kv_wire_dtype = cache;
        c.head_dim = head_dim;
        c.q_exact_in = cache;
        c.seed = 300 + head_dim;
        std::vector<double> in_float, in_cache, in_other;
        c.q_dtype = DType::kFloat32;
        RunCase(*backend_, c, &in_float);
        c.q_dtype = cache;
        RunCase(*backend_, c, &in_cache);
        c.q_dtype = other;
        RunCase(*backend_, c, &in_other);
        ASSERT_EQ(in_cache.size(), in_float.size());
        ASSERT_FALSE(in_float.empty());
        int64_t differ = 0;
        for (size_t i = 0; i < in_float.size(); ++i) {
          differ += in_cache[i] != RoundTo(cache, static_cast<float>(in_float[i])) ? 1 : 0;
        }
        EXPECT_EQ(differ, 0) << "of " << in_float.size() << " outputs [" << Describe(c) << "]";
        EXPECT_EQ(in_other.size(), in_float.size());
      }
    }
  }
  const kernels::AttentionWork work =
      PlannedWork({{0, 0, 1, 30001}, {1, 1876, 1, 5001}}, 32, 1, DType::kBFloat16, 128);
  EXPECT_TRUE(work.separate_merge) << "the second case no longer reaches the separate merge";
}

// Many equal decode spans: enough work that the plan does not split.
TEST_F(CudaKernelTest, UnsplitDecodeBatch) {
  std::vector<SpanSpec> prior, decode;
  for (int i = 0; i < 64; ++i) {
    prior.push_back({1999, 0});
    decode.push_back({1, 1});
  }
  CaseSpec c;
  c.num_kv_heads = 8;
  c.gqa = 4;
  c.page_size = 64;
  c.steps = {prior, decode};
  RunCase(*backend_, c);
}

// GQA up to 32 with 1, 2 and 3 queries per span (two decode tiles; prefill tiles).
TEST_F(CudaKernelTest, WideGqaMultiQueryDecode) {
  for (int gqa : {16, 32}) {
    for (int queries : {1, 2, 3}) {
      CaseSpec c;
      c.cache_dtype = DType::kFloat16;
      c.num_kv_heads = 2;
      c.gqa = gqa;
      c.page_size = 8;
      c.head_dim = 64;
      c.steps = {{{3000, 0}, {40, 0}}, {{queries, queries}, {queries, queries}}};
      RunCase(*backend_, c);
    }
  }
}

// One kv head (MQA) and head_dim 256 with the widest group: split decode, several queries,
// prefill tiles at the register limit.
TEST_F(CudaKernelTest, MqaAndWideHeadDim256) {
  CaseSpec c;
  c.head_dim = 256;
  c.num_kv_heads = 1;
  c.gqa = 8;
  c.page_size = 16;
  c.steps = {{{5000, 0}, {64, 0}}, {{1, 1}, {70, 70}}};
  RunCase(*backend_, c);
  c.cache_dtype = DType::kFloat16;
  c.q_dtype = DType::kFloat16;
  c.gqa = 32;
  c.page_size = 128;
  c.causal = false;
  c.steps = {{{3000, 0}, {9, 0}}, {{2, 2}, {3, 3}}};
  RunCase(*backend_, c);
}

// Wide decode tiles (32 rows) on 1 kv head with a long history: the planner cuts each tile in
// many splits and merges them in the separate merge kernel (checked against the planner, with
// the target the backend uses for this dtype and head_dim), every head_dim, LSE returned: 32 q
// heads with one query per span, and 16 with two (32 rows again), each over two decode steps.
// (A span of more rows is a prefill tile, and a split prefill tile keeps the in-kernel merge.)
TEST_F(CudaKernelTest, ManySplitWideTilesSeparateMerge) {
  for (int head_dim : kCudaHeadDims) {
    for (int gqa : {32, 16}) {
      CaseSpec c = WideSeparateMergeCase(gqa, head_dim);
      c.steps.push_back(c.steps.back());  // a second decode step
      RunCase(*backend_, c);
    }
  }
}

// A long decode on one kv head beside a prefill span: the decode tiles' splits go to the
// separate merge, which then runs as a launch of its own after the prefill tiles.
TEST_F(CudaKernelTest, SeparateMergeAfterPrefillTiles) {
  for (int gqa : {16, 32}) {  // decode tiles, wide decode tiles
    CaseSpec c;
    c.num_kv_heads = 1;
    c.gqa = gqa;
    c.steps = {{{30000, 0}, {400, 0}}, {{1, 1}, {64, 64}}};
    const kernels::AttentionWork work =
        PlannedWork({{0, 0, 1, 30001}, {1, 1876, 64, 464}}, gqa, 1, c.cache_dtype, c.head_dim);
    ASSERT_TRUE(work.separate_merge) << "the case no longer reaches the separate merge";
    ASSERT_FALSE(work.prefill_items.empty()) << "the case no longer has prefill tiles";
    RunCase(*backend_, c);
  }
}

// Long chunked prefill against 10k of history: split prefill tiles and their two-pass merge, at
// head dims 80 (merge lanes past the row idle), 128 and 192, and the separate merge at 512; and
// a non-causal prefill.
TEST_F(CudaKernelTest, ChunkedPrefillLongHistory) {
  CaseSpec c;
  c.page_size = 32;
  c.num_kv_heads = 2;
  c.gqa = 4;
  c.steps = {{{10200, 0}}, {{300, 300}}};
  for (int d : {80, 128, 192, 512}) {
    c.head_dim = d;
    const kernels::AttentionWork work = PlannedWork({{0, 0, 300, 10500}}, 8, 2, c.cache_dtype, d);
    EXPECT_TRUE(std::any_of(work.prefill_items.begin(), work.prefill_items.end(),
                            [](const kernels::AttentionWorkItem& w) { return w.partial_row >= 0; }))
        << "head_dim " << d << ": the case no longer splits its prefill tiles";
    RunCase(*backend_, c);
  }
  c.head_dim = 128;
  c.causal = false;
  c.page_size = 3;
  c.steps = {{{500, 500}, {7, 7}}};
  RunCase(*backend_, c);
}

// Prefill tiles (128 rows): spans one short of, exactly, and one past a tile, chunked prefill
// with offsets (queries after earlier positions of the same Forward and of the step before),
// GQA 1/4/8, page sizes 1/3/16/64/256, every head_dim, both cache dtypes, causal and not.
TEST_F(CudaKernelTest, PrefillTileEdges) {
  const int page_sizes[] = {1, 3, 16, 64, 256};
  int index = 0;
  for (int d : kCudaHeadDims) {
    for (int gqa : {1, 4, 8}) {
      CaseSpec c;
      c.head_dim = d;
      c.gqa = gqa;
      c.num_kv_heads = 2;
      c.page_size = page_sizes[index % 5];
      c.cache_dtype = index % 2 ? DType::kFloat16 : DType::kBFloat16;
      c.q_dtype = index % 3 == 1 ? c.cache_dtype : DType::kFloat32;
      c.causal = index % 3 != 2;
      c.return_lse = index % 4 != 3;
      c.steps = {{{127, 127}, {128, 128}, {129, 129}, {40, 33}},
                 {{200, 161}, {64, 64}, {257, 1}, {300, 300}}};
      c.seed = 5000 + index;
      RunCase(*backend_, c);
      ++index;
    }
  }
}

// GQA ratios that are not powers of two and head counts of real models (28/4, 40/8, 12/4,
// 6/1, 24/2, 20/1): tiles whose rows cross query boundaries at odd places, in decode, wide
// decode, prefill and chunked prefill, with odd page sizes.
TEST_F(CudaKernelTest, OddGqaRatios) {
  struct Shape {
    int kv_heads, gqa, head_dim, page_size;
  };
  const Shape shapes[] = {{4, 7, 128, 16}, {8, 5, 128, 3},  {4, 3, 64, 1},
                          {1, 6, 256, 32}, {2, 12, 128, 7}, {1, 20, 64, 16}};
  int index = 0;
  for (const Shape& sh : shapes) {
    CaseSpec c;
    c.num_kv_heads = sh.kv_heads;
    c.gqa = sh.gqa;
    c.head_dim = sh.head_dim;
    c.page_size = sh.page_size;
    c.cache_dtype = index % 2 ? DType::kFloat16 : DType::kBFloat16;
    c.q_dtype = index % 3 == 0 ? DType::kFloat32 : c.cache_dtype;
    c.causal = index % 4 != 3;
    c.steps = MixedSteps(900 + 31 * index);
    c.steps.push_back({{3, 3}, {2, 2}, {130, 130}, {1, 1}, {0, 2}});  // 2-3 query decode, prefill
    c.seed = 7000 + index;
    RunCase(*backend_, c);
    ++index;
  }
}

// Two threads running Forward on different layers of one pool at once.
TEST_F(CudaKernelTest, ConcurrentForwards) {
  std::vector<std::thread> threads;
  std::vector<double> errs(4, 1.0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      CaseSpec c;
      c.seed = 77 + t;
      c.page_size = 16;
      c.steps = MixedSteps(1500);
      errs[t] = RunCase(*backend_, c);
    });
  }
  for (auto& th : threads) th.join();
  for (double e : errs) EXPECT_LE(e, 1e-2);
}

// A Forward goes to the GPU as two cached graphs (kernels/submission.h), or op by op with its
// kernels through cached one- or two-node graphs (kernels/launch.h): Forward after Forward,
// with grids and parameters that change from one to the next (split decode, prefill, chunked
// prefill, then a decode-only step), both must give exactly what plain launches give (a backend
// made with graph_launch = false). The second case is split decode merged by the separate merge
// kernel, which goes with the tiles as one launch (a programmatic edge in either graph, or two
// plain launches, the merge's with programmatic stream serialization).
TEST_F(CudaKernelTest, GraphAndPlainLaunchesAgree) {
  absl::StatusOr<std::unique_ptr<Backend>> plain_backend =
      CreateCudaBackend({.graph_launch = false});
  ASSERT_TRUE(plain_backend.ok()) << plain_backend.status();
  absl::StatusOr<std::unique_ptr<Backend>> kernel_graphs =
      CreateCudaBackend({.forward_graph = false});
  ASSERT_TRUE(kernel_graphs.ok()) << kernel_graphs.status();
  CaseSpec mixed;
  mixed.seed = 91;
  mixed.steps = MixedSteps(3000);
  mixed.steps.push_back({{1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}});
  mixed.steps.push_back({{1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}});
  CaseSpec separate_merge;
  separate_merge.seed = 92;
  separate_merge.num_kv_heads = 1;
  separate_merge.gqa = 32;
  separate_merge.steps = {{{30000, 0}, {5000, 0}}, {{1, 1}, {1, 1}}, {{1, 1}, {1, 1}}};
  for (const CaseSpec& c : {mixed, separate_merge}) {
    std::vector<double> plain, per_kernel, forward;
    RunCase(**plain_backend, c, &plain);
    EXPECT_LE(RunCase(**kernel_graphs, c, &per_kernel), 1e-2);
    EXPECT_LE(RunCase(*backend_, c, &forward), 1e-2);
    ASSERT_FALSE(plain.empty());
    EXPECT_TRUE(plain == per_kernel) << "kernel graphs changed the outputs, seed " << c.seed;
    EXPECT_TRUE(plain == forward) << "Forward graphs changed the outputs, seed " << c.seed;
  }
  const kernels::AttentionWork work =
      PlannedWork({{0, 0, 1, 30001}, {1, 1876, 1, 5001}}, 32, 1, separate_merge.cache_dtype, 128);
  EXPECT_TRUE(work.separate_merge) << "the second case no longer reaches the separate merge";
}

// Random K/V rows appended to a small bf16 pool through LaunchAppendKv; Check() compares every
// appended row with the input rounded to bf16.
class AppendCase {
 public:
  static constexpr int kTokens = 5, kHeads = 2, kDim = 64, kPage = 16, kPages = 2;
  explicit AppendCase(uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    for (float& x : k_) x = uni(rng);
    for (float& x : v_) x = uni(rng);
    std::shuffle(slots_.begin(), slots_.end(), rng);
    ok_ = cudaMalloc(&dk_, sizeof(k_)) == cudaSuccess &&
          cudaMalloc(&dv_, sizeof(v_)) == cudaSuccess &&
          cudaMalloc(&kc_, kPoolElems * 2) == cudaSuccess &&
          cudaMalloc(&vc_, kPoolElems * 2) == cudaSuccess &&
          cudaMalloc(&dslots_, kTokens * 8) == cudaSuccess &&
          cudaMemcpy(dk_, k_, sizeof(k_), cudaMemcpyHostToDevice) == cudaSuccess &&
          cudaMemcpy(dv_, v_, sizeof(v_), cudaMemcpyHostToDevice) == cudaSuccess &&
          cudaMemcpy(dslots_, slots_.data(), kTokens * 8, cudaMemcpyHostToDevice) == cudaSuccess &&
          cudaMemset(kc_, 0xFF, kPoolElems * 2) == cudaSuccess &&  // NaN until written
          cudaMemset(vc_, 0xFF, kPoolElems * 2) == cudaSuccess;
    p_.k = dk_;
    p_.v = dv_;
    p_.src_dtype = DType::kFloat32;
    p_.k_cache = kc_;
    p_.v_cache = vc_;
    p_.cache_dtype = DType::kBFloat16;
    p_.slots = dslots_;
    p_.num_tokens = kTokens;
    p_.num_kv_heads = kHeads;
    p_.head_dim = kDim;
    p_.page_size = kPage;
  }
  ~AppendCase() {
    cudaFree(dk_);
    cudaFree(dv_);
    cudaFree(kc_);
    cudaFree(vc_);
    cudaFree(dslots_);
  }
  bool ok() const { return ok_; }
  const kernels::AppendParams& params() const { return p_; }
  bool FirstRowWritten() const {
    uint16_t first = 0;
    cudaMemcpy(&first, kc_, 2, cudaMemcpyDeviceToHost);
    return !std::isnan(LoadAsFloat(DType::kBFloat16, &first, 0));
  }
  // Every appended K and V element equals its input rounded to bf16.
  void Check() const {
    std::vector<uint16_t> kc(kPoolElems), vc(kPoolElems);
    ASSERT_EQ(cudaMemcpy(kc.data(), kc_, kPoolElems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(vc.data(), vc_, kPoolElems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int t = 0; t < kTokens; ++t) {
      const int64_t page = slots_[t] / kPage, in_page = slots_[t] % kPage;
      for (int h = 0; h < kHeads; ++h) {
        for (int d = 0; d < kDim; ++d) {
          const int64_t at = ((page * kHeads + h) * kPage + in_page) * kDim + d;
          const int64_t src = (int64_t{t} * kHeads + h) * kDim + d;
          ASSERT_EQ(LoadAsFloat(DType::kBFloat16, kc.data(), at),
                    RoundTo(DType::kBFloat16, k_[src]))
              << "token " << t << " head " << h << " dim " << d;
          ASSERT_EQ(LoadAsFloat(DType::kBFloat16, vc.data(), at),
                    RoundTo(DType::kBFloat16, v_[src]))
              << "token " << t << " head " << h << " dim " << d;
        }
      }
    }
  }

 private:
  static constexpr size_t kPoolElems = size_t{kPages} * kHeads * kPage * kDim;
  float k_[kTokens * kHeads * kDim];
  float v_[kTokens * kHeads * kDim];
  std::vector<int64_t> slots_ = {17, 3, 30, 0, 16};
  float *dk_ = nullptr, *dv_ = nullptr;
  uint16_t *kc_ = nullptr, *vc_ = nullptr;
  int64_t* dslots_ = nullptr;
  kernels::AppendParams p_;
  bool ok_ = false;
};

// --graph_launch and --forward_graph reach the backend: one made without graph launches submits
// every kernel plainly, one without Forward graphs each kernel through a cached graph, and one
// with both (the default) each Forward as one graph; each has its own launcher.
TEST_F(CudaKernelTest, BackendsLaunchAsTheirOptionsSay) {
  absl::StatusOr<std::unique_ptr<Backend>> plain = CreateCudaBackend({.graph_launch = false});
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::unique_ptr<Backend>> per_kernel = CreateCudaBackend({.forward_graph = false});
  ASSERT_TRUE(per_kernel.ok()) << per_kernel.status();
  const kernels::Launcher* plain_launcher = CudaLauncherOf(**plain);
  const kernels::Launcher* kernel_launcher = CudaLauncherOf(**per_kernel);
  const kernels::Launcher* default_launcher = CudaLauncherOf(*backend_);
  ASSERT_NE(plain_launcher, nullptr);
  ASSERT_NE(kernel_launcher, nullptr);
  ASSERT_NE(default_launcher, nullptr);
  EXPECT_FALSE(plain_launcher->graph_launch());
  EXPECT_TRUE(kernel_launcher->graph_launch());
  CaseSpec c;
  c.steps = MixedSteps(500);
  const int64_t kernel_graphs_before = default_launcher->graph_launches();
  const int64_t forward_graphs_before = CudaForwardGraphsOf(*backend_);
  RunCase(**plain, c);
  EXPECT_GT(plain_launcher->plain_launches(), 0);
  EXPECT_EQ(plain_launcher->graph_launches(), 0);
  EXPECT_EQ(CudaForwardGraphsOf(**plain), 0);
  RunCase(**per_kernel, c);
  EXPECT_GT(kernel_launcher->graph_launches(), 0);
  EXPECT_EQ(kernel_launcher->plain_launches(), 0);
  EXPECT_EQ(CudaForwardGraphsOf(**per_kernel), 0);
  EXPECT_EQ(CudaForwardGraphsOf(*backend_), forward_graphs_before) << "another backend's count";
  RunCase(*backend_, c);
  EXPECT_GE(CudaForwardGraphsOf(*backend_),
            forward_graphs_before + static_cast<int64_t>(c.steps.size()));
  EXPECT_EQ(default_launcher->graph_launches(), kernel_graphs_before)
      << "a Forward graph's kernels are nodes of it, not launches of their own";
}

// A Submission recorded through a launcher over it runs as one graph (SubmissionGraphs): a
// second submission of the same shape (other buffers, other parameters) updates the graph's
// nodes instead of building another, and each does its own work.
TEST_F(CudaKernelTest, SubmissionGraphsUpdateTheirNodes) {
  AppendCase first(7), second(8);
  ASSERT_TRUE(first.ok() && second.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cudaEvent_t done = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  {
    kernels::SubmissionGraphs graphs;  // destroyed before the event its graph records
    for (const AppendCase* c : {&first, &second}) {
      kernels::Submission work;
      kernels::Launcher record(&work);
      ASSERT_TRUE(kernels::LaunchAppendKv(c->params(), stream, record).ok());
      work.Record(done);
      ASSERT_EQ(work.ops().size(), 2u);
      EXPECT_FALSE(c->FirstRowWritten()) << "recording must not launch";
      const kernels::LaunchStatus st = graphs.Launch(work, stream);
      ASSERT_TRUE(st.ok()) << st.message();
      ASSERT_EQ(cudaEventSynchronize(done), cudaSuccess);
      c->Check();
    }
    EXPECT_EQ(graphs.launches(), 2);
    EXPECT_EQ(graphs.builds(), 1) << "the second submission has the first's shape";
  }
  cudaEventDestroy(done);
  cudaStreamDestroy(stream);
}

// A launch into a stream that the caller is capturing is recorded by that capture as a kernel
// node (not launched, not a nested graph), and the captured graph does the launch's work.
TEST_F(CudaKernelTest, LaunchIntoACapturedStreamIsRecorded) {
  AppendCase append(5);
  ASSERT_TRUE(append.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  kernels::Launcher launcher;
  const kernels::LaunchStatus st = kernels::LaunchAppendKv(append.params(), stream, launcher);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.message();
  size_t num_nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &num_nodes), cudaSuccess);
  ASSERT_EQ(num_nodes, 1u);
  cudaGraphNode_t node;
  ASSERT_EQ(cudaGraphGetNodes(graph, &node, &num_nodes), cudaSuccess);
  cudaGraphNodeType type;
  ASSERT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
  EXPECT_EQ(type, cudaGraphNodeTypeKernel);
  EXPECT_FALSE(append.FirstRowWritten()) << "the launch ran during the capture";

  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  append.Check();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// What the launch fixtures below share: a shuffled page table of `pages` pages, bf16 K and V
// pools on the device (uploaded from host rows), and the plan and workspace of one batch.
class PlannedLaunch {
 public:
  PlannedLaunch(const PlannedLaunch&) = delete;
  PlannedLaunch& operator=(const PlannedLaunch&) = delete;
  ~PlannedLaunch() {
    cudaFree(k_pool_);
    cudaFree(v_pool_);
  }
  bool ok() const { return ok_; }
  const kernels::AttentionWork& work() const { return plan_.work(); }

 protected:
  PlannedLaunch() = default;
  // table_: pages 0..pages-1 in an order shuffled by rng.
  void ShuffleTable(int pages, std::mt19937& rng) {
    table_.resize(pages);
    std::iota(table_.begin(), table_.end(), 0);
    std::shuffle(table_.begin(), table_.end(), rng);
  }
  // K's (kv_index 0) or V's pool, a copy of host's bf16 values.
  void UploadPool(int kv_index, const std::vector<uint16_t>& host) {
    void*& pool = kv_index == 0 ? k_pool_ : v_pool_;
    ok_ = ok_ && cudaMalloc(&pool, host.size() * 2) == cudaSuccess &&
          cudaMemcpy(pool, host.data(), host.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  // The plan of batch under limits, and a workspace reserved for it.
  void Plan(const kernels::ForwardBatch& batch, const kernels::AttentionPlanLimits& limits) {
    plan_ = kernels::AttentionPlan::Make(batch, limits);
    ok_ = ok_ && ws_.Reserve(plan_, nullptr).ok() && cudaDeviceSynchronize() == cudaSuccess;
  }
  kernels::PagedAttentionParams Bound() const {
    return ws_.Bind(plan_, k_pool_, v_pool_).attention;
  }

  std::vector<int32_t> table_;
  kernels::ForwardSpan span_;
  kernels::AttentionPlan plan_;
  kernels::ForwardWorkspace ws_;
  bool ok_ = true;

 private:
  void* k_pool_ = nullptr;
  void* v_pool_ = nullptr;
};

// Split decode whose plan merges in the separate kernel, planned and staged through the kernel
// library (AttentionPlan, ForwardWorkspace) and launched straight through LaunchPagedAttention:
// the tiles and the merge go as one launch (kernels/launch.h). Into a captured stream the pair is
// recorded as two kernel nodes in stream order; replaying the captured graph gives exactly what
// the direct launch gave.
class SeparateMergeLaunch : public PlannedLaunch {
 public:
  static constexpr int kQHeads = 32, kDim = 128, kPage = 16, kLen = 20000;
  SeparateMergeLaunch() {
    const int pages = (kLen + kPage - 1) / kPage;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<uint16_t> kv(size_t{pages} * kPage * kDim);
    ShuffleTable(pages, rng);
    for (int kv_index = 0; kv_index < 2; ++kv_index) {
      for (uint16_t& x : kv) StoreFromFloat(DType::kBFloat16, &x, 0, uni(rng));
      UploadPool(kv_index, kv);
    }
    kernels::AttentionPlanLimits limits;
    ok_ =
        ok_ &&
        kernels::QueryPlanLimits(DType::kBFloat16, kDim, kernels::PrefillPath::kAuto, &limits).ok();
    span_ = {.num_queries = 1, .kv_len = kLen};
    const kernels::ForwardBatch batch = {.spans = {&span_, 1},
                                         .page_table = table_,
                                         .total_queries = 1,
                                         .num_q_heads = kQHeads,
                                         .num_kv_heads = 1,
                                         .head_dim = kDim,
                                         .page_size = kPage,
                                         .kv_dtype = DType::kBFloat16,
                                         .q_dtype = DType::kFloat32,
                                         .kv_wire_dtype = DType::kFloat32,
                                         .sm_scale = 1.f / std::sqrt(float{kDim}),
                                         .return_lse = true};
    Plan(batch, limits);
  }

  // New random queries (seed), staged and uploaded; wrong_first: each decode item's carried
  // first page id replaced by its second (that page read twice, the first not at all: a wrong
  // table, for a test's control).
  void Stage(uint32_t seed, cudaStream_t stream, bool wrong_first = false) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<float> q(kQHeads * kDim);
    for (float& x : q) x = uni(rng);
    ws_.StageInputs(plan_, q.data(), nullptr, nullptr);
    if (wrong_first) {
      auto* first = reinterpret_cast<kernels::ItemFirstPages*>(
          static_cast<char*>(ws_.host()) + plan_.staging().decode_wide_first_pages);
      for (size_t i = 0; i < work().decode_wide_first_pages.size(); ++i) {
        first[i].ids[0] = first[i].ids[1];
      }
    }
    ok_ = ok_ && ws_.Upload(plan_, stream).ok() && cudaStreamSynchronize(stream) == cudaSuccess;
  }
  // The attention params bound to the staged image; first_pages false: every page id from the
  // page table.
  kernels::PagedAttentionParams Params(bool first_pages = true) const {
    kernels::PagedAttentionParams p = Bound();
    if (!first_pages) p.decode_wide_first_pages = nullptr;
    return p;
  }
  // out and lse, NaN first so that an unwritten element shows.
  void Poison(cudaStream_t stream) {
    const kernels::ForwardStaging& st = plan_.staging();
    ok_ = ok_ &&
          cudaMemsetAsync(static_cast<char*>(ws_.device()) + st.out, 0xFF, st.results_end - st.out,
                          stream) == cudaSuccess &&
          cudaStreamSynchronize(stream) == cudaSuccess;
  }
  // out, then lse, after the launches on stream.
  std::vector<float> Result(cudaStream_t stream) {
    std::vector<float> r(kQHeads * (kDim + 1));
    ok_ = ok_ && ws_.Download(plan_, stream).ok() && cudaStreamSynchronize(stream) == cudaSuccess;
    ws_.ReadResults(plan_, r.data(), r.data() + kQHeads * kDim);
    return r;
  }
};

TEST_F(CudaKernelTest, SeparateMergeCapturedAsTwoNodes) {
  SeparateMergeLaunch launch;
  ASSERT_TRUE(launch.ok());
  ASSERT_TRUE(launch.work().separate_merge) << "the case no longer plans the separate merge";
  ASSERT_TRUE(launch.work().decode_items.empty() && launch.work().prefill_items.empty());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  kernels::Launcher launcher;
  launch.Stage(100, stream);

  launch.Poison(stream);
  kernels::LaunchStatus st = kernels::LaunchPagedAttention(launch.Params(), stream, launcher);
  ASSERT_TRUE(st.ok()) << st.message();
  const std::vector<float> direct = launch.Result(stream);
  ASSERT_TRUE(launch.ok());
  for (float x : direct) ASSERT_FALSE(std::isnan(x)) << "an output was not written";

  launch.Poison(stream);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  st = kernels::LaunchPagedAttention(launch.Params(), stream, launcher);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.message();
  size_t num_nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &num_nodes), cudaSuccess);
  EXPECT_EQ(num_nodes, 2u) << "the tiles and the merge";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(launch.Result(stream), direct) << "the captured launch differs from the direct one";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// One causal prefill span of kLen queries on 8 kv heads, launched through the kernel library
// with the device's plan limits but for l2_bytes: the blocks run the kv heads in the groups
// PrefillHeadGroup picks from it. Outputs go to out (f32) and lse.
class HeadGroupLaunch : public PlannedLaunch {
 public:
  static constexpr int kQHeads = 32, kKvHeads = 8, kPage = 16, kLen = 1100;
  HeadGroupLaunch(int head_dim, kernels::PrefillPath path, int64_t l2_bytes) : dim_(head_dim) {
    const int pages = (kLen + kPage - 1) / kPage;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    ShuffleTable(pages, rng);
    for (int kv_index = 0; kv_index < 2; ++kv_index) {
      std::vector<uint16_t>& host = kv_index == 0 ? k_ : v_;
      host.resize(size_t{pages} * kKvHeads * kPage * dim_);
      for (uint16_t& x : host) StoreFromFloat(DType::kBFloat16, &x, 0, uni(rng));
      UploadPool(kv_index, host);
    }
    q_.resize(size_t{kLen} * kQHeads * dim_);
    for (float& x : q_) x = uni(rng);
    kernels::AttentionPlanLimits limits;
    ok_ = ok_ && kernels::QueryPlanLimits(DType::kBFloat16, dim_, path, &limits).ok();
    limits.l2_bytes = l2_bytes;
    span_ = {.num_queries = kLen, .kv_len = kLen};
    const kernels::ForwardBatch batch = {.spans = {&span_, 1},
                                         .page_table = table_,
                                         .total_queries = kLen,
                                         .num_q_heads = kQHeads,
                                         .num_kv_heads = kKvHeads,
                                         .head_dim = dim_,
                                         .page_size = kPage,
                                         .kv_dtype = DType::kBFloat16,
                                         .q_dtype = DType::kFloat32,
                                         .kv_wire_dtype = DType::kFloat32,
                                         .causal = true,
                                         .sm_scale = 1.f / std::sqrt(float(dim_)),
                                         .return_lse = true};
    Plan(batch, limits);
  }

  // out then lse of one launch, out and lse poisoned (NaN) before it.
  std::vector<float> Run(cudaStream_t stream, kernels::Launcher& launcher) {
    ws_.StageInputs(plan_, q_.data(), nullptr, nullptr);
    const kernels::ForwardStaging& st = plan_.staging();
    ok_ = ok_ && ws_.Upload(plan_, stream).ok() &&
          cudaMemsetAsync(static_cast<char*>(ws_.device()) + st.out, 0xFF, st.results_end - st.out,
                          stream) == cudaSuccess;
    const kernels::LaunchStatus launched = kernels::LaunchPagedAttention(Bound(), stream, launcher);
    ok_ = ok_ && launched.ok();
    std::vector<float> r(size_t{kLen} * kQHeads * (dim_ + 1));
    ok_ = ok_ && ws_.Download(plan_, stream).ok() && cudaStreamSynchronize(stream) == cudaSuccess;
    ws_.ReadResults(plan_, r.data(), r.data() + size_t{kLen} * kQHeads * dim_);
    return r;
  }
  // Query `query`'s output for q head `head` in float64 from the pools' values.
  std::vector<double> Reference(int query, int head) const {
    const int kv_head = head / (kQHeads / kKvHeads);
    const float* qv = &q_[(static_cast<size_t>(query) * kQHeads + head) * dim_];
    auto row = [&](const std::vector<uint16_t>& pool, int pos) {
      const size_t r =
          (size_t{static_cast<uint32_t>(table_[pos / kPage])} * kKvHeads + kv_head) * kPage +
          pos % kPage;
      return &pool[r * dim_];
    };
    std::vector<double> score(query + 1), out(dim_, 0.0);
    double top = -INFINITY, sum = 0;
    for (int pos = 0; pos <= query; ++pos) {
      double dot = 0;
      for (int i = 0; i < dim_; ++i) dot += double{qv[i]} * Bf16ToFloat(row(k_, pos)[i]);
      score[pos] = dot / std::sqrt(double(dim_));
      top = std::max(top, score[pos]);
    }
    for (int pos = 0; pos <= query; ++pos) {
      const double w = std::exp(score[pos] - top);
      sum += w;
      for (int i = 0; i < dim_; ++i) out[i] += w * Bf16ToFloat(row(v_, pos)[i]);
    }
    for (double& x : out) x /= sum;
    return out;
  }

 private:
  int dim_;
  std::vector<uint16_t> k_, v_;
  std::vector<float> q_;
};

// The prefill kernels run the kv heads in the planner's groups (PrefillHeadGroup) where the
// L2 would not hold a span's K/V for all of them: with an L2 that holds two heads' K/V twice
// over, the one-block-a-job kernels (head_dim 64, the portable kernel) and the persistent one
// (128) give exactly the outputs of every kv head together, and those match float64.
TEST_F(CudaKernelTest, PrefillHeadGroupsGiveTheSameOutputs) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  kernels::Launcher launcher;
  for (const int dim : {64, 128}) {
    for (const kernels::PrefillPath path :
         {kernels::PrefillPath::kAuto, kernels::PrefillPath::kPortable}) {
      SCOPED_TRACE(::testing::Message()
                   << "head_dim " << dim << ", path "
                   << (path == kernels::PrefillPath::kAuto ? "auto" : "portable"));
      const int64_t head_bytes = int64_t{HeadGroupLaunch::kLen} * 2 * dim * 2;
      HeadGroupLaunch all(dim, path, /*l2_bytes=*/int64_t{1} << 40);
      HeadGroupLaunch grouped(dim, path, /*l2_bytes=*/4 * head_bytes);
      ASSERT_TRUE(all.ok() && grouped.ok());
      ASSERT_EQ(all.work().prefill_head_group, HeadGroupLaunch::kKvHeads);
      ASSERT_EQ(grouped.work().prefill_head_group, 2) << "the case no longer groups the heads";
      ASSERT_FALSE(grouped.work().prefill_items.empty());
      const std::vector<float> expected = all.Run(stream, launcher);
      const std::vector<float> got = grouped.Run(stream, launcher);
      ASSERT_TRUE(all.ok() && grouped.ok());
      for (float x : got) ASSERT_FALSE(std::isnan(x)) << "an output was not written";
      ASSERT_EQ(got, expected) << "the heads' order changed an output";
      double worst = 0;
      for (const int query : {0, 127, 128, 700, HeadGroupLaunch::kLen - 1}) {
        for (const int head : {0, 9, 22, 31}) {
          const std::vector<double> ref = grouped.Reference(query, head);
          for (int i = 0; i < dim; ++i) {
            const double x =
                got[(size_t{static_cast<uint32_t>(query)} * HeadGroupLaunch::kQHeads + head) * dim +
                    i];
            worst = std::max(worst, std::abs(x - ref[i]));
          }
        }
      }
      EXPECT_LT(worst, 5e-3) << "against float64";
    }
  }
  cudaStreamDestroy(stream);
}

// Launch after launch of the tiles and the separate merge with other queries each time: every
// result is the one a first launch of those queries gave (nothing of one launch's partials or
// split state leaks into the next).
TEST_F(CudaKernelTest, SeparateMergeLaunchesBackToBack) {
  SeparateMergeLaunch launch;
  ASSERT_TRUE(launch.ok());
  ASSERT_TRUE(launch.work().separate_merge) << "the case no longer plans the separate merge";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  kernels::Launcher launcher;
  std::vector<float> first[2];
  for (int round = 0; round < 6; ++round) {
    for (int which = 0; which < 2; ++which) {
      launch.Stage(100 + which, stream);
      launch.Poison(stream);
      const kernels::LaunchStatus st =
          kernels::LaunchPagedAttention(launch.Params(), stream, launcher);
      ASSERT_TRUE(st.ok()) << st.message();
      std::vector<float> result = launch.Result(stream);
      ASSERT_TRUE(launch.ok());
      if (round == 0) {
        for (float x : result) ASSERT_FALSE(std::isnan(x)) << "an output was not written";
        first[which] = std::move(result);
      } else {
        ASSERT_EQ(result, first[which]) << "round " << round << ", queries " << which;
      }
    }
  }
  EXPECT_NE(first[0], first[1]) << "the two query sets gave one result: the test shows nothing";
  cudaStreamDestroy(stream);
}

// A decode tile's first copies take their page ids from the ids carried beside the work items
// or from the page table: the same pages, so bit for bit the same result. The control: carried
// ids with each item's first id wrong must change the result (else the kernel did not use them,
// and the equality would show nothing).
TEST_F(CudaKernelTest, CarriedFirstPagesGiveTheLoadedPagesResult) {
  SeparateMergeLaunch launch;
  ASSERT_TRUE(launch.ok());
  ASSERT_FALSE(launch.work().decode_wide_items.empty()) << "the case no longer has decode tiles";
  ASSERT_EQ(launch.work().decode_wide_first_pages.size(), launch.work().decode_wide_items.size());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  kernels::Launcher launcher;
  auto run = [&](bool first_pages, bool wrong_first) {
    launch.Stage(100, stream, wrong_first);
    launch.Poison(stream);
    const kernels::LaunchStatus st =
        kernels::LaunchPagedAttention(launch.Params(first_pages), stream, launcher);
    EXPECT_TRUE(st.ok()) << st.message();
    return launch.Result(stream);
  };
  const std::vector<float> loaded = run(/*first_pages=*/false, /*wrong_first=*/false);
  ASSERT_TRUE(launch.ok());
  for (float x : loaded) ASSERT_FALSE(std::isnan(x)) << "an output was not written";
  EXPECT_NE(run(true, /*wrong_first=*/true), loaded)
      << "wrong carried page ids changed nothing: they are not used";
  EXPECT_EQ(run(true, false), loaded) << "carried page ids gave another result";
  ASSERT_TRUE(launch.ok());
  cudaStreamDestroy(stream);
}

TEST_F(CudaKernelTest, PoolLargerThanTheGpuIsResourceExhausted) {
  CacheGeometry g;
  g.num_layers = 64;
  g.num_q_heads = 64;
  g.num_kv_heads = 64;
  g.head_dim = 256;
  g.page_size = 1024;
  g.kv_dtype = DType::kBFloat16;
  g.num_pages = 1 << 16;  // 2^16 * 2 * 64 * 64*1024*256*2 bytes: far beyond any GPU
  absl::StatusOr<std::unique_ptr<KvPool>> pool = backend_->AllocatePool(g, StopToken());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kResourceExhausted) << pool.status();
}

// ---- FP8 caches ------------------------------------------------------------------------------

// A cache on backend (the device 0 for CUDA) with its own pool.
std::unique_ptr<Cache> MakeCacheOn(Backend& backend, CacheGeometry g) {
  g.device = 0;
  absl::StatusOr<std::unique_ptr<KvPool>> pool = backend.AllocatePool(g, StopToken());
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return nullptr;
  return std::make_unique<Cache>("test", "", "", g, *std::move(pool), &backend, 0);
}

// A new pool is zeroed before CreateCache answers: the zeros go out on the default stream, which
// the Forwards' (non-blocking) streams do not wait for, so a first append into a large pool's
// last layer (the memset's last bytes) could be overwritten when the memset got there. The
// workspace is warmed first so that nothing in between allocates. (On an H100 the reads back
// passed also on the build that left the memset unsynchronized, three runs of three; the
// default stream's state right after creation is what tells the two apart.)
TEST_F(CudaKernelTest, NewPoolIsZeroedBeforeItsFirstForward) {
  const CacheGeometry small = testing::MakeGeometry(1, 32, 8, 128, 16, DType::kBFloat16, 64);
  std::unique_ptr<Cache> warm = MakeCacheOn(*backend_, small);
  ASSERT_TRUE(warm);
  testing::ForwardModel warm_model(small, DType::kFloat32, 5u);
  ASSERT_TRUE(warm_model.Run(*warm, 0, {{1, 0, 16, 16}}).status.ok());
  ASSERT_TRUE(warm_model.Run(*warm, 0, {{1, 16, 1, 1}}).status.ok());
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  // A quarter of what is free over 8 layers (some 20 GB on an 80 GB GPU: milliseconds to zero).
  CacheGeometry g = small;
  g.num_layers = 8;
  g.num_pages = static_cast<int64_t>(free_bytes / 4) / g.BytesPerPage();
  ASSERT_GT(g.num_pages, 1000);
  std::unique_ptr<Cache> cache = MakeCacheOn(*backend_, g);
  ASSERT_TRUE(cache);
  // The claim itself: nothing of the zeroing is left on the default stream once the pool is
  // made (unsynchronized, a memset of gigabytes is still running here).
  const cudaError_t pending = cudaStreamQuery(cudaStreamLegacy);
  (void)cudaGetLastError();
  EXPECT_EQ(pending, cudaSuccess) << "the pool's memset was still running";
  testing::ForwardModel model(g, DType::kFloat32, 6u);
  const testing::ForwardModel::Outcome prefill = model.Run(*cache, 7, {{1, 0, 16, 16}});
  ASSERT_TRUE(prefill.status.ok()) << prefill.status;
  EXPECT_LE(prefill.max_rel_error, 2e-2);
  const testing::ForwardModel::Outcome decode = model.Run(*cache, 7, {{1, 16, 1, 1}});
  ASSERT_TRUE(decode.status.ok()) << decode.status;
  EXPECT_LE(decode.max_rel_error, 2e-2) << "the prefill's rows read back as the pool's zeros";
}

// A workspace counts its buffers' reallocations (a cached graph naming one is stale afterwards,
// even where the new buffer lies at the old address), and SubmissionGraphs::Clear makes the next
// launch build its graph anew.
TEST_F(CudaKernelTest, ReallocationsAreCountedAndGraphsCleared) {
  kernels::ForwardWorkspace ws;
  EXPECT_EQ(ws.generation(), 0u);
  ASSERT_TRUE(ws.ReserveInputs(kernels::InputsLayout::Of(4096, 4096)).ok());
  const uint64_t first = ws.generation();
  EXPECT_GE(first, 1u);
  ASSERT_TRUE(ws.ReserveInputs(kernels::InputsLayout::Of(1024, 1024)).ok());
  EXPECT_EQ(ws.generation(), first) << "a smaller layout reallocated";
  ASSERT_TRUE(ws.ReserveInputs(kernels::InputsLayout::Of(1 << 20, 1 << 20)).ok());
  EXPECT_GT(ws.generation(), first);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, 4096), cudaSuccess);
  kernels::Submission s;
  s.Copy(dev, ws.host(), 4096, cudaMemcpyHostToDevice);
  kernels::SubmissionGraphs graphs;
  ASSERT_TRUE(graphs.Launch(s, stream).ok());
  ASSERT_TRUE(graphs.Launch(s, stream).ok());
  EXPECT_EQ(graphs.builds(), 1);
  graphs.Clear();
  ASSERT_TRUE(graphs.Launch(s, stream).ok());
  EXPECT_EQ(graphs.builds(), 2);
  EXPECT_EQ(graphs.launches(), 3);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaFree(dev);
  cudaStreamDestroy(stream);
}

// A Forward whose scratch the GPU cannot hold is RESOURCE_EXHAUSTED, saying how much it needs
// and what is free (not INTERNAL), and leaves the cache as it was; with the memory back, the
// same Forward runs.
TEST_F(CudaKernelTest, ScratchBeyondTheFreeMemoryIsResourceExhausted) {
  const CacheGeometry g = testing::MakeGeometry(1, 32, 8, 128, 16, DType::kBFloat16, 1100);
  std::unique_ptr<Cache> cache = MakeCacheOn(*backend_, g);
  ASSERT_TRUE(cache);
  testing::ForwardModel model(g, DType::kFloat32, 91u);
  ASSERT_TRUE(model.Run(*cache, 0, {{1, 0, 16, 16}}).status.ok());
  const int64_t used = cache->Stats().used_pages;
  // All but 16 MiB of the GPU taken: 8192 new rows of float K and V are 64 MiB of scratch.
  std::vector<void*> hog;
  for (size_t chunk = size_t{1} << 32; chunk >= (size_t{1} << 20);) {
    size_t free_bytes = 0, total = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
    if (free_bytes < (size_t{16} << 20) + chunk) {
      chunk /= 2;
      continue;
    }
    void* p = nullptr;
    if (cudaMalloc(&p, chunk) != cudaSuccess) {
      cudaGetLastError();
      chunk /= 2;
      continue;
    }
    hog.push_back(p);
  }
  const testing::ForwardModel::Outcome refused = model.Run(*cache, 0, {{2, 0, 8192, 1}});
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("bytes of GPU scratch"), std::string::npos)
      << refused.status;
  EXPECT_EQ(cache->Stats().used_pages, used);
  for (void* p : hog) cudaFree(p);
  const testing::ForwardModel::Outcome ran = model.Run(*cache, 0, {{2, 0, 8192, 1}});
  ASSERT_TRUE(ran.status.ok()) << ran.status;
  EXPECT_LE(ran.max_rel_error, 2e-2);
  EXPECT_EQ(cache->Stats().used_pages, used + 8192 / 16);
}

// The FP8 sweep (tests/fp8_sweep.h) on the CUDA tiles: both scalings, pages {1, 7, 16, 128}, GQA
// {1, 4, 5, 8}, every CUDA head_dim in turn; its prefill and chunked spans run the prefill tiles
// on the pages' bfloat16 copy, its decode spans the FP8 decode tiles.
TEST_F(CudaKernelTest, Fp8SweepMatchesReferenceOnUnquantizedKv) {
  const testing::CacheMaker make = [&](const CacheGeometry& g) {
    return MakeCacheOn(*backend_, g);
  };
  for (KvScaling scaling : {KvScaling::kPerToken, KvScaling::kStatic}) {
    for (int page : {1, 7, 16, 128}) {
      for (int gqa : {1, 4, 5, 8}) testing::RunFp8Sweep(make, scaling, page, gqa, kCudaHeadDims);
    }
  }
}

// The same Forwards on an FP8 cache of each backend: the append stores the same codes and scales
// (the GPU's rounding is the host's to the bit), and the tiles read them in 16 bits (decode as
// float16 fragments, prefill from a bfloat16 copy of the pages), so the two answers agree within
// bfloat16's error, far closer than either is to the unquantized reference.
// Long decode (split, merged), prefill, chunked prefill, every head_dim, both scalings.
TEST_F(CudaKernelTest, Fp8AnswersMatchTheCpuBackend) {
  CpuBackend cpu;
  int index = 0;
  for (KvScaling scaling : {KvScaling::kPerToken, KvScaling::kStatic}) {
    for (int dim : kCudaHeadDims) {
      const int page = index % 2 ? 16 : 7, gqa = index % 3 == 0 ? 8 : 4;
      CacheGeometry g =
          testing::MakeGeometry(1, 2 * gqa, 2, dim, page, DType::kFloat8E4M3, 3000 / page + 50);
      g.kv_scaling = scaling;
      // STATIC: calibrated to the data below (x100, outlier channels x30): 4 sigma of the largest.
      if (scaling == KvScaling::kStatic) g.kv_scales = {12000.f / 448.f, 15000.f / 448.f};
      std::unique_ptr<Cache> caches[2] = {MakeCacheOn(cpu, g), MakeCacheOn(*backend_, g)};
      ASSERT_TRUE(caches[0] && caches[1]);
      testing::ForwardModel models[2] = {{g, DType::kBFloat16, 77u + index},
                                         {g, DType::kBFloat16, 77u + index}};
      const std::vector<std::vector<testing::SpanCase>> steps = {
          {{1, 0, 2000, 1}, {2, 0, 300, 300}, {3, 0, 1, 1}},
          {{1, 2000, 1, 1}, {2, 300, 64, 64}, {3, 1, 1, 1}},
          {{1, 2001, 3, 3}, {2, 364, 1, 1}, {4, 0, 130, 130}},
      };
      for (size_t si = 0; si < steps.size(); ++si) {
        testing::ForwardModel::Outcome o[2];
        for (int b = 0; b < 2; ++b) {
          models[b].SetKvShape(100.f, 16, 30.f);  // large values, outlier channels
          o[b] = models[b].Run(*caches[b], 0, steps[si]);
          ASSERT_TRUE(o[b].status.ok()) << o[b].status;
        }
        const std::string what =
            absl::StrCat(scaling == KvScaling::kStatic ? "static" : "per-token", " d ", dim,
                         " page ", page, " step ", si);
        const int64_t n = static_cast<int64_t>(o[0].result.out.size() / 2);
        std::vector<float> a = testing::Decode(DType::kBFloat16, o[0].result.out.data(), n);
        std::vector<float> b = testing::Decode(DType::kBFloat16, o[1].result.out.data(), n);
        std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end());
        EXPECT_LE(testing::RelativeError(bd.data(), ad.data(), n), 1e-2) << what;
        const float* la = reinterpret_cast<const float*>(o[0].result.lse.data());
        const float* lb = reinterpret_cast<const float*>(o[1].result.lse.data());
        double lse_diff = 0;
        for (size_t i = 0; i < o[0].result.lse.size() / 4; ++i) {
          lse_diff = std::max(lse_diff, double{std::abs(la[i] - lb[i])});
        }
        EXPECT_LE(lse_diff, 1e-2) << what;
        EXPECT_LE(o[1].max_rel_error, testing::kFp8OutTolerance) << what;
      }
      ++index;
    }
  }
}

// The ends of what a config and a Forward may hold answer on the GPU as on the CPU backend,
// with no NaN: caps at the range's ends (with the largest sm_scale over them too, which the
// Q tile carries), sinks of +-2^64, an FP8 cache's rows under kFp8MinRowMax (zeros of scale 1)
// and STATIC's smallest scale; prefill and decode tiles both.
TEST_F(CudaKernelTest, ExtremeAcceptedValuesAnswerAsOnTheCpu) {
  CpuBackend cpu;
  struct Extreme {
    const char* name;
    float softcap;                  // 0: none
    float sink;                     // 0: none
    KvScaling fp8;                  // kUnspecified: a bfloat16 cache
    float kv_scale;                 // K and V drawn at this scale
    std::optional<float> sm_scale;  // unset: the default
    // Whether the backends' answers must agree: not where scores of thousands of units make the
    // softmax a sign test, which the bfloat16 Q tile's rounding decides otherwise for the
    // scores nearest zero (finite on both still).
    bool agree = true;
  };
  constexpr KvScaling kBf16 = KvScaling::kUnspecified;
  const Extreme cases[] = {
      {"smallest cap", kMinLogitSoftcap, 0.f, kBf16, 1.f, std::nullopt, true},
      {"smallest cap, largest sm_scale", kMinLogitSoftcap, 0.f, kBf16, 1.f,
       kMinLogitSoftcap * kMaxSoftcapScale, true},
      {"cap 30, largest sm_scale", 30.f, 0.f, kBf16, 1.f, 30.f * kMaxSoftcapScale, false},
      {"largest cap", kMaxLogitSoftcap, 0.f, kBf16, 1.f, std::nullopt, true},
      {"sinks +2^64", 0.f, kMaxSinkMagnitude, kBf16, 1.f, std::nullopt, true},
      {"sinks -2^64", 0.f, -kMaxSinkMagnitude, kBf16, 1.f, std::nullopt, true},
      {"fp8 rows of 1e-40", 0.f, 0.f, KvScaling::kPerToken, 1e-40f, std::nullopt, true},
      {"fp8 smallest static scale", 0.f, 0.f, KvScaling::kStatic, 1e-36f, std::nullopt, true},
  };
  for (const Extreme& e : cases) {
    SCOPED_TRACE(e.name);
    const bool fp8 = e.fp8 != KvScaling::kUnspecified;
    CacheGeometry g =
        testing::MakeGeometry(1, 8, 2, 128, 16, fp8 ? DType::kFloat8E4M3 : DType::kBFloat16, 64);
    if (e.softcap > 0.f || e.sink != 0.f) {
      LayerAttention a;
      a.logit_softcap = e.softcap;
      if (e.sink != 0.f) a.sinks.assign(8, e.sink);
      g.layers = {a};
    }
    if (fp8) {
      g.kv_scaling = e.fp8;
      if (e.fp8 == KvScaling::kStatic) g.kv_scales = {kFp8MinStaticScale, kFp8MinStaticScale};
    }
    std::unique_ptr<Cache> caches[2] = {MakeCacheOn(cpu, g), MakeCacheOn(*backend_, g)};
    ASSERT_TRUE(caches[0] && caches[1]);
    testing::ForwardModel models[2] = {{g, DType::kFloat32, 11u}, {g, DType::kFloat32, 11u}};
    const std::vector<std::vector<testing::SpanCase>> steps = {{{1, 0, 300, 300}, {2, 0, 40, 40}},
                                                               {{1, 300, 1, 1}, {2, 40, 1, 1}}};
    for (size_t si = 0; si < steps.size(); ++si) {
      testing::ForwardModel::Outcome o[2];
      for (int b = 0; b < 2; ++b) {
        // FP8: every other channel exactly zero (a zero times an overflowed inverse was NaN).
        models[b].SetKvShape(e.kv_scale, fp8 ? 2 : 1 << 30, fp8 ? 0.f : 1.f);
        o[b] = models[b].Run(*caches[b], 0, steps[si], /*causal=*/true, e.sm_scale);
        ASSERT_TRUE(o[b].status.ok()) << o[b].status;
      }
      const int64_t n = static_cast<int64_t>(o[0].result.out.size() / 4);
      ASSERT_EQ(o[1].result.out.size(), o[0].result.out.size());
      const float* a = reinterpret_cast<const float*>(o[0].result.out.data());
      const float* b = reinterpret_cast<const float*>(o[1].result.out.data());
      double largest = 0, diff = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i])) << "step " << si << " at " << i;
        largest = std::max(largest, double{std::abs(a[i])});
        diff = std::max(diff, double{std::abs(a[i] - b[i])});
      }
      if (e.agree) {
        EXPECT_LE(diff, 2e-2 * largest) << "step " << si;
      }
      const float* la = reinterpret_cast<const float*>(o[0].result.lse.data());
      const float* lb = reinterpret_cast<const float*>(o[1].result.lse.data());
      for (size_t i = 0; i < o[0].result.lse.size() / 4; ++i) {
        ASSERT_FALSE(std::isnan(la[i]) || std::isnan(lb[i])) << "step " << si << " lse " << i;
        if (e.agree) {
          EXPECT_LE(std::abs(la[i] - lb[i]), 1e-2 * std::max(1.f, std::abs(la[i])))
              << "step " << si << " lse " << i;
        }
      }
    }
  }
}

// A decode batch of FP8 tiles a few blocks past one wave (AttentionWork::decode_blocks_per_sm):
// the plan asks for one block an SM fewer than fit, and the launch (the same kernel, asking for
// more shared memory) still answers within the FP8 bound. A launch whose shared memory the
// kernel's limit did not allow would fail the Forward.
TEST_F(CudaKernelTest, Fp8DecodeOneBlockAnSmFewer) {
  constexpr int kDim = 128, kKvHeads = 8, kPage = 16;
  kernels::AttentionPlanLimits limits;
  ASSERT_TRUE(
      kernels::QueryPlanLimits(DType::kFloat8E4M3, kDim, kernels::PrefillPath::kAuto, &limits)
          .ok());
  ASSERT_GE(limits.decode_blocks_per_sm, 2) << "FP8 decode tiles hold fewer than two blocks";
  const int seqs = (limits.unsplit_blocks + 8 + kKvHeads - 1) / kKvHeads;
  std::vector<kernels::AttentionSpan> spans;
  for (int i = 0; i < seqs; ++i) spans.push_back({i, i, 1, 201});
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), seqs, 4 * kKvHeads, kKvHeads, /*causal=*/true,
                             /*window=*/0, limits, &work);
  ASSERT_TRUE(work.merge_tasks.empty());
  ASSERT_EQ(work.decode_blocks_per_sm, limits.decode_blocks_per_sm - 1);

  CacheGeometry g = testing::MakeGeometry(1, 4 * kKvHeads, kKvHeads, kDim, kPage,
                                          DType::kFloat8E4M3, seqs * (208 / kPage) + 8);
  std::unique_ptr<Cache> cache = MakeCacheOn(*backend_, g);
  ASSERT_TRUE(cache);
  testing::ForwardModel model(g, DType::kBFloat16, 91u);
  std::vector<testing::SpanCase> prefill, decode;
  for (int i = 0; i < seqs; ++i) {
    prefill.push_back({static_cast<uint64_t>(i + 1), 0, 200, 1});
    decode.push_back({static_cast<uint64_t>(i + 1), 200, 1, 1});
  }
  testing::Fp8Worst worst;
  testing::ExpectFp8Close(model.Run(*cache, 0, prefill), "prefill, last query", &worst);
  testing::ExpectFp8Close(model.Run(*cache, 0, decode), "decode, one block an SM fewer", &worst);
}

// FP8 decode whose tiles each split in two (AttentionWork::pair_merge): each tile's two blocks
// run as a cluster and merge through each other's shared memory. As many sequences as take two
// splits a tile on this GPU, 1024 positions each; GQA 4 and 8, PER_TOKEN and STATIC, q and out in
// bfloat16 and in float, in turn; a plain layer and one with sinks (which join the rows where
// the pair finishes them): every answer against the float64 reference.
TEST_F(CudaKernelTest, Fp8TwoSplitTilesMergeByPairs) {
  constexpr int kDim = 128, kKvHeads = 8, kPage = 16, kContext = 1024;
  kernels::AttentionPlanLimits limits;
  ASSERT_TRUE(
      kernels::QueryPlanLimits(DType::kFloat8E4M3, kDim, kernels::PrefillPath::kAuto, &limits)
          .ok());
  const int seqs = std::max(1, limits.target_blocks / (2 * kKvHeads));
  struct Variant {
    int gqa;
    KvScaling scaling;
    DType io;
  };
  const Variant variants[] = {{4, KvScaling::kPerToken, DType::kBFloat16},
                              {8, KvScaling::kStatic, DType::kFloat32},
                              {4, KvScaling::kStatic, DType::kFloat32},
                              {8, KvScaling::kPerToken, DType::kBFloat16}};
  int index = 0;
  for (const Variant& v : variants) {
    std::vector<kernels::AttentionSpan> spans;
    for (int i = 0; i < seqs; ++i) spans.push_back({i, i, 1, kContext + 1});
    kernels::AttentionWork work;
    kernels::PlanAttentionWork(spans.data(), seqs, v.gqa * kKvHeads, kKvHeads, /*causal=*/true,
                               /*window=*/0, limits, &work);
    ASSERT_FALSE(work.merge_tasks.empty()) << "the case no longer splits its tiles";
    EXPECT_EQ(work.pair_merge, limits.cluster_launch)
        << "the case no longer pairs: " << work.decode_items.size() << " items of " << seqs
        << " tiles, chunk " << work.kv_chunk;
    CacheGeometry g = testing::MakeGeometry(2, v.gqa * kKvHeads, kKvHeads, kDim, kPage,
                                            DType::kFloat8E4M3,
                                            seqs * ((kContext + 1) / kPage + 1) + 8);
    g.kv_scaling = v.scaling;
    // A geometry holds each layer's K and V scales (CacheConfig's two for all, expanded).
    if (v.scaling == KvScaling::kStatic) g.kv_scales.assign(2 * g.num_layers, 4.f / 448.f);
    LayerAttention with_sinks;
    for (int h = 0; h < v.gqa * kKvHeads; ++h) with_sinks.sinks.push_back(0.5f + 0.25f * h);
    g.layers = {LayerAttention{}, with_sinks};
    std::unique_ptr<Cache> cache = MakeCacheOn(*backend_, g);
    ASSERT_TRUE(cache);
    testing::ForwardModel model(g, v.io, 300u + index++);
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<testing::SpanCase> prefill, decode;
      for (int i = 0; i < seqs; ++i) {
        prefill.push_back({static_cast<uint64_t>(i + 1), 0, kContext, 1});
        decode.push_back({static_cast<uint64_t>(i + 1), kContext, 1, 1});
      }
      const std::string what =
          absl::StrCat("gqa ", v.gqa, v.scaling == KvScaling::kStatic ? " static" : " per-token",
                       " q ", DTypeName(v.io), " layer ", layer);
      testing::Fp8Worst worst;
      testing::ExpectFp8Close(model.Run(*cache, layer, prefill), what + ", prefill", &worst);
      testing::ExpectFp8Close(model.Run(*cache, layer, decode), what + ", decode by pairs",
                              &worst);
    }
  }
}

// Which launches the unclamped Hopper prefill kernels may take (host-side: no GPU needed): the
// scale in log2 units up to 2^21, an FP8 STATIC K scale up to 2^48 / 448; PER_TOKEN always.
TEST(ExponentsStayFiniteTest, BoundsTheScaleAndAStaticKScale) {
  kernels::PagedAttentionParams p;
  p.sm_scale = 0.0884f;  // 1 / sqrt(128)
  EXPECT_TRUE(kernels::ExponentsStayFinite(p));
  p.sm_scale = 1.45e6f;
  EXPECT_TRUE(kernels::ExponentsStayFinite(p));
  p.sm_scale = 1.46e6f;
  EXPECT_FALSE(kernels::ExponentsStayFinite(p));
  p.sm_scale = 3.4e38f;
  EXPECT_FALSE(kernels::ExponentsStayFinite(p));
  p.sm_scale = 1.f;
  p.scales.k = kMaxAttentionValue / 448.f;
  EXPECT_TRUE(kernels::ExponentsStayFinite(p));
  p.scales.k = 2.f * kMaxAttentionValue / 448.f;
  EXPECT_FALSE(kernels::ExponentsStayFinite(p));
  float row_scales = 1.f;
  p.scales.k_rows = &row_scales;  // PER_TOKEN: each row within its own largest value
  EXPECT_TRUE(kernels::ExponentsStayFinite(p));
}

// The Hopper prefill's K/V tensor maps: made for every head dim and box the launcher asks for
// (else its producer falls back to copying rows, silently slower); refused for a pool that is not
// 16-byte aligned or a box that is no power of two from 8 to 256 rows.
TEST_F(CudaKernelTest, PoolTensorMapsEncode) {
  void* pool = nullptr;
  ASSERT_EQ(cudaMalloc(&pool, 1 << 20), cudaSuccess);
  alignas(64) unsigned char map[128];
  for (int d : kCudaHeadDims) {
    for (int rows : {8, 16, 32, 64, 128, 256}) {
      EXPECT_TRUE(kernels::EncodePoolTensorMap(pool, d, rows, map)) << d << " " << rows;
    }
  }
  EXPECT_FALSE(kernels::EncodePoolTensorMap(static_cast<char*>(pool) + 8, 128, 16, map));
  for (int rows : {0, 4, 12, 512}) EXPECT_FALSE(kernels::EncodePoolTensorMap(pool, 128, rows, map));
  cudaFree(pool);
}

TEST_F(CudaKernelTest, ReportsDevice) {
  EXPECT_GT(backend_->device_count(), 0);
  EXPECT_FALSE(backend_->device_name().empty());
  absl::StatusOr<MemoryInfo> mem = backend_->memory(0);
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_GT(mem->total_bytes, 0);
  EXPECT_GT(mem->free_bytes, 0);
}

}  // namespace
}  // namespace pagedattn
