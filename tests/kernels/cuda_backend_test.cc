// CUDA backend and kernel tests: Forward on the GPU against the float64 reference over page
// sizes, head dims, GQA ratios, dtypes, ragged decode/prefill/chunked batches. Skips without a GPU.
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
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/launch.h"
#include "kernels/paged_attention.h"
#include "server/core/backend.h"
#include "server/core/cuda_backend.h"
#include "common/dtype.h"
#include "common/reference.h"

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
};

std::string Describe(const CaseSpec& c) {
  return std::string(DTypeName(c.cache_dtype)) + " q=" + std::string(DTypeName(c.q_dtype)) +
         " kv_wire=" + std::string(DTypeName(c.kv_wire_dtype)) +
         " d=" + std::to_string(c.head_dim) + " page=" + std::to_string(c.page_size) +
         " kv_heads=" + std::to_string(c.num_kv_heads) + " gqa=" + std::to_string(c.gqa) +
         (c.causal ? " causal" : " non-causal");
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
  absl::StatusOr<std::unique_ptr<KvPool>> pool = backend.AllocatePool(g);
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
        for (int kv = 0; kv < 2; ++kv) {
          const float wire = RoundTo(c.kv_wire_dtype, uni(rng) * (kv == 0 ? k_scale : 1.f));
          auto& bytes = kv == 0 ? k_bytes : v_bytes;
          const size_t at = bytes.size();
          bytes.resize(at + kv_size);
          StoreFromFloat(c.kv_wire_dtype, bytes.data() + at, 0, wire);
          (kv == 0 ? s.k : s.v).push_back(RoundTo(c.cache_dtype, wire));
        }
      }
      for (int64_t e = 0; e < int64_t{sp.num_queries} * Hq * D; ++e) {
        const float qv = RoundTo(c.q_dtype, 2.f * uni(rng));
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
                                    ref_lse.data() + sp.q_offset * Hq);
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
      const double tol = c.cache_dtype == DType::kFloat16 ? 2e-3 : 1e-2;
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

// A mixed batch: long decode, prefill, chunked prefill, short decode, append-only.
std::vector<std::vector<SpanSpec>> MixedSteps(int long_len) {
  return {
      {{long_len, 0}, {0, 0}, {150, 4}, {37, 0}, {20, 0}},
      {{1, 1}, {90, 90}, {70, 70}, {1, 1}, {5, 0}},
  };
}

TEST_F(CudaKernelTest, SweepPageSizeHeadDimGqa) {
  const int page_sizes[] = {1, 3, 8, 16, 32, 128, 1024};
  const int head_dims[] = {64, 128, 256};
  const int gqas[] = {1, 4, 8};
  const DType wire[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  int index = 0;
  for (int ps : page_sizes) {
    for (int d : head_dims) {
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

// Scores that grow steeply along the sequence (K scaled up with the position, 1 + p / 4) make
// the decode tile raise its lazy softmax base again and again, by far more than its slack: a
// base left where a split's first tile put it would overflow 2^(s - base) within that split
// (a kernel that never raised it failed here; one with the slack alone passed before the ramp
// was this steep). head_dim 64 rescales at every step. Split and unsplit decode, q exact in
// the cache dtype so that scores of thousands carry no rounding of q.
TEST_F(CudaKernelTest, GrowingScoresRaiseTheSoftmaxBase) {
  for (int d : {64, 128, 256}) {
    CaseSpec c;
    c.head_dim = d;
    c.q_dtype = c.cache_dtype;
    c.kv_wire_dtype = DType::kBFloat16;
    c.k_ramp = 256.f;
    c.steps = {{{6000, 1}, {700, 1}}, {{1, 1}, {1, 1}}};
    c.seed = 77 + d;
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
  for (int head_dim : {64, 128, 256}) {
    for (int gqa : {32, 16}) {
      const int queries = kernels::kDecodeWideTileRows / gqa;
      CaseSpec c;
      c.head_dim = head_dim;
      c.num_kv_heads = 1;
      c.gqa = gqa;
      c.page_size = 16;
      c.steps = {{{30000, 0}, {6000, 0}},
                 {{queries, queries}, {queries, queries}},
                 {{queries, queries}, {queries, queries}}};
      int target = 0;
      ASSERT_TRUE(kernels::AttentionTargetBlocks(c.cache_dtype, head_dim, &target).ok());
      std::vector<kernels::AttentionSpan> spans = {{0, 0, queries, 30000 + queries},
                                                   {queries, 1876, queries, 6000 + queries}};
      kernels::AttentionWork work;
      kernels::PlanAttentionWork(spans.data(), 2, gqa, 1, /*causal=*/true,
                                 {.target_blocks = target}, &work);
      ASSERT_TRUE(work.separate_merge) << "the case no longer reaches the separate merge";
      ASSERT_TRUE(work.prefill_items.empty());
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
    int target = 0;
    ASSERT_TRUE(kernels::AttentionTargetBlocks(c.cache_dtype, c.head_dim, &target).ok());
    std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 30001}, {1, 1876, 64, 464}};
    kernels::AttentionWork work;
    kernels::PlanAttentionWork(spans.data(), 2, gqa, 1, /*causal=*/true, {.target_blocks = target},
                               &work);
    ASSERT_TRUE(work.separate_merge) << "the case no longer reaches the separate merge";
    ASSERT_FALSE(work.prefill_items.empty()) << "the case no longer has prefill tiles";
    RunCase(*backend_, c);
  }
}

// Long chunked prefill against 10k of history, and a non-causal prefill.
TEST_F(CudaKernelTest, ChunkedPrefillLongHistory) {
  CaseSpec c;
  c.page_size = 32;
  c.num_kv_heads = 2;
  c.gqa = 4;
  c.steps = {{{10200, 0}}, {{300, 300}}};
  RunCase(*backend_, c);
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
  for (int d : {64, 128, 256}) {
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

// Kernels go through cached graphs (kernels/launch.h): Forward after Forward,
// with grids and parameters that change from one to the next (split decode, prefill, chunked
// prefill, then a decode-only step), they must give exactly what plain launches give.
// The second case is split decode merged by the separate merge kernel, which goes with the
// tiles as one launch (a two-node graph with a programmatic edge, or two plain launches, the
// merge's with programmatic stream serialization).
TEST_F(CudaKernelTest, GraphAndPlainLaunchesAgree) {
  struct Restore {
    ~Restore() { kernels::SetGraphLaunch(true); }
  } restore;
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
    std::vector<double> plain, graph;
    kernels::SetGraphLaunch(false);
    RunCase(*backend_, c, &plain);
    kernels::SetGraphLaunch(true);
    EXPECT_LE(RunCase(*backend_, c, &graph), 1e-2);
    ASSERT_FALSE(plain.empty());
    EXPECT_TRUE(plain == graph) << "graph launches changed the outputs, seed " << c.seed;
  }
  int target = 0;
  ASSERT_TRUE(kernels::AttentionTargetBlocks(separate_merge.cache_dtype, 128, &target).ok());
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 30001}, {1, 1876, 1, 5001}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 2, 32, 1, /*causal=*/true, {.target_blocks = target},
                             &work);
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

// --graph_launch=false reaches the kernels: a backend created without graph launches turns them
// off for the process.
TEST_F(CudaKernelTest, BackendWithoutGraphLaunchTurnsThemOff) {
  struct Restore {
    ~Restore() { kernels::SetGraphLaunch(true); }
  } restore;
  kernels::SetGraphLaunch(true);
  ASSERT_TRUE(kernels::GraphLaunchEnabled());
  absl::StatusOr<std::unique_ptr<Backend>> plain = CreateCudaBackend({.graph_launch = false});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(kernels::GraphLaunchEnabled());
}

// A launch into a stream that the caller is capturing is recorded by that capture as a kernel
// node (not launched, not a nested graph), and the captured graph does the launch's work.
TEST_F(CudaKernelTest, LaunchIntoACapturedStreamIsRecorded) {
  AppendCase append(5);
  ASSERT_TRUE(append.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const kernels::LaunchStatus st = kernels::LaunchAppendKv(append.params(), stream);
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

// Split decode whose plan merges in the separate kernel, launched straight through
// LaunchPagedAttention: the tiles and the merge go as one launch (kernels/launch.h).
// Into a captured stream the pair is recorded as two kernel nodes in stream order; replaying the
// captured graph gives exactly what the direct launch gave.
class SeparateMergeLaunch {
 public:
  static constexpr int kQHeads = 32, kDim = 128, kPage = 16, kLen = 20000;
  SeparateMergeLaunch() {
    const int pages = (kLen + kPage - 1) / kPage;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<uint16_t> kv(size_t{pages} * kPage * kDim);
    std::vector<int32_t> table(pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    std::vector<float> q(kQHeads * kDim);
    for (float& x : q) x = uni(rng);
    kernels::AttentionSpan span{0, 0, 1, kLen};
    int target = 0;
    ok_ = kernels::AttentionTargetBlocks(DType::kBFloat16, kDim, &target).ok();
    kernels::PlanAttentionWork(&span, 1, kQHeads, 1, /*causal=*/true, {.target_blocks = target},
                               &work_);
    p_.kv_dtype = DType::kBFloat16;
    p_.num_q_heads = kQHeads;
    p_.num_kv_heads = 1;
    p_.head_dim = kDim;
    p_.page_size = kPage;
    p_.sm_scale = 1.f / std::sqrt(float{kDim});
    for (int kv_index = 0; kv_index < 2; ++kv_index) {
      for (uint16_t& x : kv) StoreFromFloat(DType::kBFloat16, &x, 0, uni(rng));
      (kv_index == 0 ? p_.k_cache : p_.v_cache) = Upload(kv.data(), kv.size() * 2);
    }
    p_.page_table = static_cast<const int32_t*>(Upload(table.data(), table.size() * 4));
    table_ = std::move(table);
    p_.q = static_cast<const float*>(Upload(q.data(), q.size() * 4));
    p_.out = static_cast<float*>(Upload(nullptr, q.size() * 4));
    p_.lse = static_cast<float*>(Upload(nullptr, kQHeads * 4));
    p_.decode_wide_items = static_cast<const kernels::AttentionWorkItem*>(
        Upload(work_.decode_wide_items.data(),
               work_.decode_wide_items.size() * sizeof(kernels::AttentionWorkItem)));
    p_.num_decode_wide_items = static_cast<int32_t>(work_.decode_wide_items.size());
    p_.merge_tasks = static_cast<const kernels::AttentionMergeTask*>(Upload(
        work_.merge_tasks.data(), work_.merge_tasks.size() * sizeof(kernels::AttentionMergeTask)));
    p_.num_merge_tasks = static_cast<int32_t>(work_.merge_tasks.size());
    p_.separate_merge = work_.separate_merge;
    p_.merge_rows = work_.merge_rows;
    p_.partial_out = static_cast<float*>(Upload(nullptr, work_.partial_rows * kDim * 4));
    p_.partial_lse = static_cast<float*>(Upload(nullptr, work_.partial_rows * 4));
    p_.partial_rows = work_.partial_rows;
  }
  ~SeparateMergeLaunch() {
    for (void* b : buffers_) cudaFree(b);
  }
  bool ok() const { return ok_; }
  const kernels::AttentionWork& work() const { return work_; }
  const kernels::PagedAttentionParams& params() const { return p_; }
  // The work items' first page ids (AttachFirstPages), uploaded beside them, as the server does;
  // wrong_first: each item's first id replaced by its second (that page read twice, the first
  // not at all: a wrong table, for a test's control).
  void AttachFirstPages(bool wrong_first = false) {
    kernels::AttachFirstPages(table_.data(), kPage, &work_);
    if (wrong_first) {
      for (kernels::ItemFirstPages& f : work_.decode_wide_first_pages) f.ids[0] = f.ids[1];
    }
    p_.decode_wide_first_pages = static_cast<const kernels::ItemFirstPages*>(
        Upload(work_.decode_wide_first_pages.data(),
               work_.decode_wide_first_pages.size() * sizeof(kernels::ItemFirstPages)));
  }
  // New random queries (seed) into the q buffer, in stream order.
  void SetQ(uint32_t seed, cudaStream_t stream) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    host_q_.resize(kQHeads * kDim);
    for (float& x : host_q_) x = uni(rng);
    ok_ = ok_ &&
          cudaMemcpyAsync(const_cast<float*>(p_.q), host_q_.data(), host_q_.size() * 4,
                          cudaMemcpyHostToDevice, stream) == cudaSuccess &&
          cudaStreamSynchronize(stream) == cudaSuccess;
  }
  // out and lse, NaN first so that an unwritten element shows.
  void Poison() {
    ok_ = ok_ && cudaMemset(p_.out, 0xFF, kQHeads * kDim * 4) == cudaSuccess &&
          cudaMemset(p_.lse, 0xFF, kQHeads * 4) == cudaSuccess;
  }
  std::vector<float> Result() {
    std::vector<float> r(kQHeads * (kDim + 1));
    ok_ = ok_ &&
          cudaMemcpy(r.data(), p_.out, kQHeads * kDim * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
          cudaMemcpy(r.data() + kQHeads * kDim, p_.lse, kQHeads * 4, cudaMemcpyDeviceToHost) ==
              cudaSuccess;
    return r;
  }

 private:
  void* Upload(const void* src, size_t bytes) {
    void* d = nullptr;
    ok_ = ok_ && cudaMalloc(&d, std::max<size_t>(bytes, 4)) == cudaSuccess;
    if (ok_) buffers_.push_back(d);
    if (ok_ && src) ok_ = cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
    return d;
  }
  kernels::AttentionWork work_;
  kernels::PagedAttentionParams p_;
  std::vector<int32_t> table_;
  std::vector<float> host_q_;
  std::vector<void*> buffers_;
  bool ok_ = true;
};

TEST_F(CudaKernelTest, SeparateMergeCapturedAsTwoNodes) {
  SeparateMergeLaunch launch;
  ASSERT_TRUE(launch.ok());
  ASSERT_TRUE(launch.work().separate_merge) << "the case no longer plans the separate merge";
  ASSERT_TRUE(launch.work().decode_items.empty() && launch.work().prefill_items.empty());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  launch.Poison();
  kernels::LaunchStatus st = kernels::LaunchPagedAttention(launch.params(), stream);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<float> direct = launch.Result();
  ASSERT_TRUE(launch.ok());
  for (float x : direct) ASSERT_FALSE(std::isnan(x)) << "an output was not written";

  launch.Poison();
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  st = kernels::LaunchPagedAttention(launch.params(), stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.message();
  size_t num_nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &num_nodes), cudaSuccess);
  EXPECT_EQ(num_nodes, 2u) << "the tiles and the merge";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(launch.Result(), direct) << "the captured launch differs from the direct one";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
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
  std::vector<float> first[2];
  for (int round = 0; round < 6; ++round) {
    for (int which = 0; which < 2; ++which) {
      launch.SetQ(100 + which, stream);
      launch.Poison();
      const kernels::LaunchStatus st = kernels::LaunchPagedAttention(launch.params(), stream);
      ASSERT_TRUE(st.ok()) << st.message();
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::vector<float> result = launch.Result();
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
  auto run = [&] {
    launch.Poison();
    const kernels::LaunchStatus st = kernels::LaunchPagedAttention(launch.params(), nullptr);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return launch.Result();
  };
  const std::vector<float> loaded = run();
  ASSERT_TRUE(launch.ok());
  for (float x : loaded) ASSERT_FALSE(std::isnan(x)) << "an output was not written";

  launch.AttachFirstPages(/*wrong_first=*/true);
  ASSERT_EQ(launch.work().decode_wide_first_pages.size(), launch.work().decode_wide_items.size());
  EXPECT_NE(run(), loaded) << "wrong carried page ids changed nothing: they are not used";
  launch.AttachFirstPages();
  EXPECT_EQ(run(), loaded) << "carried page ids gave another result";
  ASSERT_TRUE(launch.ok());
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
  absl::StatusOr<std::unique_ptr<KvPool>> pool = backend_->AllocatePool(g);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kResourceExhausted) << pool.status();
}

TEST_F(CudaKernelTest, ReportsDevice) {
  EXPECT_GT(backend_->device_count(), 0);
  EXPECT_FALSE(backend_->device_name().empty());
  absl::StatusOr<MemoryInfo> mem = backend_->memory(0);
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_GT(mem->total_bytes, 0);
  EXPECT_GT(mem->free_bytes, 0);
}

// The split-KV planner needs no GPU: every (tile, position) is covered exactly once.
TEST(AttentionPlan, CoversEveryPositionOnce) {
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 1, 10000}, {1, 700, 3, 5}, {4, 701, 200, 900}, {204, 800, 0, 50}};
  for (bool causal : {true, false}) {
    for (int target : {1, 132, 264, 5000}) {
      kernels::AttentionWork work;
      kernels::PlanAttentionWork(spans.data(), 4, 32, 8, causal,
                                 {.target_blocks = target, .min_chunk = 64}, &work);
      // coverage[span][row_start] -> positions covered
      std::map<std::pair<int, int>, int64_t> covered;
      for (const auto* list : {&work.decode_items, &work.decode_wide_items, &work.prefill_items}) {
        for (const auto& it : *list) {
          EXPECT_LT(it.kv_start, it.kv_end);
          covered[{it.span, it.row_start}] += it.kv_end - it.kv_start;
        }
      }
      for (const auto& [key, n] : covered) {
        const auto& sp = spans[key.first];
        const int group = 4;
        const int rows = sp.num_queries * group;
        const int tile = rows <= kernels::kDecodeTileRows       ? kernels::kDecodeTileRows
                         : rows <= kernels::kDecodeWideTileRows ? kernels::kDecodeWideTileRows
                                                                : kernels::kPrefillTileRows;
        const int last_row = std::min(key.second + tile, rows) - 1;
        const int64_t want = causal ? sp.kv_len - sp.num_queries + last_row / group + 1 : sp.kv_len;
        EXPECT_EQ(n, want) << "span " << key.first << " row " << key.second;
      }
      EXPECT_EQ(covered.count({3, 0}), 0u);  // no queries, no work
    }
  }
}

// One long decode on 8 kv heads fills the 264 block slots with equal splits cut at any position
// (not only at 64-position tiles), each position in exactly one split, the splits contiguous.
TEST(AttentionPlan, OneWaveOfEqualUnalignedSplits) {
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 32768}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 1, 32, 8, /*causal=*/true, {.target_blocks = 264},
                             &work);
  ASSERT_EQ(work.decode_items.size(), 33u) << "kv_chunk " << work.kv_chunk;
  EXPECT_EQ(work.kv_chunk, 993);
  int32_t next = 0;
  for (const auto& it : work.decode_items) {
    EXPECT_EQ(it.kv_start, next);
    EXPECT_LE(it.kv_end - it.kv_start, 993);
    next = it.kv_end;
  }
  EXPECT_EQ(next, 32768);
  // A prefill tile in the plan keeps chunks at whole KV tiles.
  // (Without that rule this plan would cut 334-position chunks.)
  std::vector<kernels::AttentionSpan> mixed = {{0, 0, 1, 2000}, {1, 2048, 100, 1000}};
  kernels::PlanAttentionWork(mixed.data(), 2, 32, 8, /*causal=*/true, {.target_blocks = 264},
                             &work);
  EXPECT_LT(work.kv_chunk, 2000) << "the plan splits";
  EXPECT_EQ(work.kv_chunk % kernels::kKvTileRows, 0) << "kv_chunk " << work.kv_chunk;
}

// A plan without splits has no merge, so its waves count every resident block (unsplit_blocks);
// a split plan's count only those that leave room for a merge block (target_blocks). Head_dim
// 64 on the H200: 396 and 528.
TEST(AttentionPlan, UnsplitPlanCountsWavesInAllResidentBlocks) {
  std::vector<kernels::AttentionSpan> batch;
  for (int i = 0; i < 64; ++i) batch.push_back({i, i * 256, 1, 4096});
  kernels::AttentionWork work;
  // 512 (sequence, kv head) blocks: two waves of 396, so the plan splits...
  kernels::PlanAttentionWork(batch.data(), 64, 32, 8, /*causal=*/true, {.target_blocks = 396},
                             &work);
  EXPECT_LT(work.kv_chunk, 4096);
  // ...but one wave of 528: no split, no merge.
  kernels::PlanAttentionWork(batch.data(), 64, 32, 8, /*causal=*/true,
                             {.target_blocks = 396, .unsplit_blocks = 528}, &work);
  EXPECT_EQ(work.kv_chunk, 4096);
  EXPECT_EQ(work.decode_items.size(), 64u);
  EXPECT_TRUE(work.merge_tasks.empty());
  // A plan that splits either way is planned in waves of target_blocks alone.
  std::vector<kernels::AttentionSpan> one = {{0, 0, 1, 32768}};
  kernels::PlanAttentionWork(one.data(), 1, 32, 8, /*causal=*/true, {.target_blocks = 396}, &work);
  const int32_t chunk = work.kv_chunk;
  const size_t items = work.decode_items.size();
  EXPECT_LT(chunk, 32768);
  kernels::PlanAttentionWork(one.data(), 1, 32, 8, /*causal=*/true,
                             {.target_blocks = 396, .unsplit_blocks = 528}, &work);
  EXPECT_EQ(work.kv_chunk, chunk);
  EXPECT_EQ(work.decode_items.size(), items);
  // So is a plan with a prefill tile (the prefill kernels' residency is not the decode tile's):
  // 56 decode tiles and one of 32 queries x 4 heads, 456 blocks, split as with 396 alone.
  std::vector<kernels::AttentionSpan> mixed(batch.begin(), batch.begin() + 56);
  mixed.push_back({56, 56 * 256, 32, 4096});
  kernels::PlanAttentionWork(mixed.data(), 57, 32, 8, /*causal=*/true, {.target_blocks = 396},
                             &work);
  const int32_t mixed_chunk = work.kv_chunk;
  EXPECT_LT(mixed_chunk, 4096);
  kernels::PlanAttentionWork(mixed.data(), 57, 32, 8, /*causal=*/true,
                             {.target_blocks = 396, .unsplit_blocks = 528}, &work);
  EXPECT_EQ(work.kv_chunk, mixed_chunk);
}

// Beside each decode item go the page ids of its first kItemPages pages (from the page holding
// kv_start), 0 past its span's last page.
TEST(AttentionPlan, AttachFirstPagesCopiesEachItemsFirstPages) {
  constexpr int kPage = 16;
  // Span 0: 1000 positions (63 pages) from table entry 0; span 1: 40 positions (3 pages) from
  // entry 63; span 2: a prefill of 200 queries (13 pages) from entry 66.
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 1000}, {1, 63, 1, 40}, {2, 66, 200, 200}};
  std::vector<int32_t> table(79);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(1000 + 7 * i);
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 3, 32, 8, /*causal=*/true,
                             {.target_blocks = 264, .min_chunk = 64}, &work);
  ASSERT_GT(work.decode_items.size(), 2u) << "span 0 no longer splits";
  ASSERT_FALSE(work.prefill_items.empty());
  EXPECT_TRUE(work.decode_first_pages.empty()) << "attached only when asked";
  kernels::AttachFirstPages(table.data(), kPage, &work);
  ASSERT_EQ(work.decode_first_pages.size(), work.decode_items.size());
  ASSERT_EQ(work.decode_wide_first_pages.size(), work.decode_wide_items.size());
  for (size_t i = 0; i < work.decode_items.size(); ++i) {
    const auto& it = work.decode_items[i];
    const auto& sp = spans[it.span];
    const int64_t span_pages = (sp.kv_len + kPage - 1) / kPage;
    for (int j = 0; j < kernels::kItemPages; ++j) {
      const int64_t page = it.kv_start / kPage + j;
      const int32_t want = page < span_pages ? table[sp.page_table_offset + page] : 0;
      EXPECT_EQ(work.decode_first_pages[i].ids[j], want)
          << "span " << it.span << " kv_start " << it.kv_start << " page " << j;
    }
  }
  kernels::PlanAttentionWork(spans.data(), 3, 32, 8, /*causal=*/true,
                             {.target_blocks = 264, .min_chunk = 64}, &work);
  EXPECT_TRUE(work.decode_first_pages.empty()) << "a new plan drops the last one's pages";
}

// The tile grid is one block per (work item, kv head) in one dimension: its size, and a refusal
// naming both numbers once it would pass the 2^31 - 1 blocks of a grid dimension.
TEST(AttentionPlan, TileGridBlocksFitOneDimension) {
  unsigned blocks = 0;
  ASSERT_TRUE(kernels::TileGridBlocks(33, 8, &blocks).ok());
  EXPECT_EQ(blocks, 264u);
  ASSERT_TRUE(kernels::TileGridBlocks(int64_t{1} << 21, 1023, &blocks).ok());
  EXPECT_EQ(blocks, (1u << 21) * 1023u);
  const kernels::LaunchStatus over = kernels::TileGridBlocks(int64_t{1} << 21, 1024, &blocks);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.message().find("2097152 tiles x 1024 kv heads"), std::string::npos)
      << over.message();
}

// Wide tiles on few kv heads (32 q / 1 kv head) are cut in enough splits to fill the GPU, and
// their merge moves to the separate kernel; the usual decode shape keeps the in-kernel merge.
TEST(AttentionPlan, SeparateMergeOnlyForLargeMerges) {
  std::vector<kernels::AttentionSpan> spans = {{0, 0, 1, 131072}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 1, 32, 1, /*causal=*/true, {.target_blocks = 264},
                             &work);
  EXPECT_TRUE(work.separate_merge);
  EXPECT_GE(work.decode_wide_items.size(), 200u) << "kv_chunk " << work.kv_chunk;
  EXPECT_EQ(work.merge_rows, 32);
  ASSERT_EQ(work.merge_tasks.size(), 1u);
  EXPECT_EQ(work.merge_tasks[0].num_splits, static_cast<int>(work.decode_wide_items.size()));

  // 33 splits of 4 rows (one decode on 8 kv heads) merge separately; 2 splits of 4 rows (16
  // decodes) in the tile kernel.
  spans = {{7, 0, 1, 32768}};
  kernels::PlanAttentionWork(spans.data(), 1, 32, 8, /*causal=*/true, {.target_blocks = 264},
                             &work);
  EXPECT_TRUE(work.separate_merge);
  EXPECT_EQ(work.merge_rows, 4);
  ASSERT_FALSE(work.merge_tasks.empty());
  EXPECT_EQ(work.merge_tasks[0].q_offset, 7);
  EXPECT_EQ(work.merge_tasks[0].num_splits, 33);
  spans.clear();
  for (int i = 0; i < 16; ++i) spans.push_back({i, i * 256, 1, 4096});
  kernels::PlanAttentionWork(spans.data(), 16, 32, 8, /*causal=*/true, {.target_blocks = 264},
                             &work);
  ASSERT_FALSE(work.merge_tasks.empty());
  EXPECT_EQ(work.merge_tasks[0].num_splits, 2);
  EXPECT_FALSE(work.separate_merge);

  // A split prefill tile keeps the in-kernel merge (the separate one is measured for decode
  // tiles only), even beside a wide decode tile that would want the separate one.
  spans = {{0, 0, 300, 10000}, {300, 700, 1, 131072}};
  kernels::PlanAttentionWork(spans.data(), 2, 32, 1, /*causal=*/true, {.target_blocks = 264},
                             &work);
  bool prefill_split = false;
  for (const auto& it : work.prefill_items) prefill_split |= it.partial_row >= 0;
  ASSERT_TRUE(prefill_split) << "kv_chunk " << work.kv_chunk;
  EXPECT_FALSE(work.separate_merge);
}

// Prefill blocks run span by span, the span with the longest block first, and longest first
// within a span (load balance and L2 reuse of a span's K/V prefix; kernels/attention_plan.cc).
TEST(AttentionPlan, PrefillItemsBySpanLongestFirst) {
  // Span 1 is the longest; span 0 and 2 tie on their longest block (span order decides).
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 300, 300}, {300, 100, 900, 900}, {1200, 300, 300, 300}, {1500, 400, 1, 700}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 4, 32, 8, /*causal=*/true,
                             {.target_blocks = 100000, .min_chunk = 64}, &work);
  ASSERT_FALSE(work.prefill_items.empty());
  std::vector<int> span_order;
  for (size_t i = 0; i < work.prefill_items.size(); ++i) {
    const auto& it = work.prefill_items[i];
    EXPECT_NE(it.span, 3) << "a one-query span is a decode tile";
    if (span_order.empty() || span_order.back() != it.span) span_order.push_back(it.span);
    if (i > 0 && work.prefill_items[i - 1].span == it.span) {
      const auto& prev = work.prefill_items[i - 1];
      EXPECT_GE(prev.kv_end - prev.kv_start, it.kv_end - it.kv_start) << "item " << i;
    }
  }
  EXPECT_EQ(span_order, (std::vector<int>{1, 0, 2})) << "each span once, longest span first";
}

// The persistent prefill kernel's schedule: every (item, kv head) exactly once, the first jobs
// on blocks 0, 1, ... in the planner's order, each block's jobs in that order, and the blocks'
// estimated work within one job of each other (greedy list scheduling).
TEST(AttentionPlan, PrefillScheduleDealsEveryJobOnce) {
  std::vector<kernels::AttentionSpan> spans = {
      {0, 0, 4096, 4096}, {4096, 256, 4096, 4096}, {8192, 512, 1000, 9000}, {9192, 1200, 1, 700}};
  kernels::AttentionWork work;
  kernels::PlanAttentionWork(spans.data(), 4, 32, 8, /*causal=*/true, {.target_blocks = 264},
                             &work);
  ASSERT_FALSE(work.prefill_items.empty());
  constexpr int kHeads = 8, kBlocks = 132;
  kernels::SchedulePrefillJobs(kHeads, kBlocks, &work);
  const size_t num_jobs = work.prefill_items.size() * kHeads;
  ASSERT_EQ(work.prefill_jobs.size(), num_jobs);
  ASSERT_EQ(work.prefill_job_start.size(), static_cast<size_t>(kBlocks + 1));
  EXPECT_EQ(work.prefill_job_start.front(), 0);
  EXPECT_EQ(work.prefill_job_start.back(), static_cast<int32_t>(num_jobs));

  // Job (item i, head h) is the planner's job i * kHeads + h; find each in the schedule.
  auto key = [](const kernels::AttentionWorkItem& it, int h) {
    return std::make_tuple(it.span, it.row_start, it.kv_start, h);
  };
  std::map<std::tuple<int, int, int, int>, int> order;
  for (size_t i = 0; i < work.prefill_items.size(); ++i) {
    for (int h = 0; h < kHeads; ++h) order[key(work.prefill_items[i], h)] = i * kHeads + h;
  }
  ASSERT_EQ(order.size(), num_jobs) << "planner jobs are distinct";
  std::vector<int> seen(num_jobs, 0);
  int64_t min_load = INT64_MAX, max_load = 0, longest_job = 0;
  for (int b = 0; b < kBlocks; ++b) {
    int64_t load = 0;
    int prev = -1;
    for (int j = work.prefill_job_start[b]; j < work.prefill_job_start[b + 1]; ++j) {
      const kernels::AttentionPrefillJob& job = work.prefill_jobs[j];
      ASSERT_TRUE(order.count(key(job.item, job.kv_head)));
      const int k = order[key(job.item, job.kv_head)];
      ++seen[k];
      if (j == work.prefill_job_start[b]) {
        EXPECT_EQ(k, b) << "block " << b << "'s first job";
      }
      EXPECT_GT(k, prev) << "block " << b << " runs its jobs in the planner's order";
      prev = k;
      const int64_t cost = job.item.kv_end - job.item.kv_start + 128;  // the planner's estimate
      load += cost;
      longest_job = std::max(longest_job, cost);
    }
    min_load = std::min(min_load, load);
    max_load = std::max(max_load, load);
  }
  for (size_t k = 0; k < num_jobs; ++k) EXPECT_EQ(seen[k], 1) << "job " << k;
  // A job goes to the block with the least estimated work (positions + 128 per job), so no
  // block ends more than one job after the least loaded one.
  EXPECT_LE(max_load - min_load, longest_job);

  // Fewer jobs than blocks: one block per job; no blocks: no schedule.
  kernels::SchedulePrefillJobs(kHeads, 100000, &work);
  EXPECT_EQ(work.prefill_job_start.size(), num_jobs + 1);
  kernels::SchedulePrefillJobs(kHeads, 0, &work);
  EXPECT_TRUE(work.prefill_jobs.empty());
  EXPECT_TRUE(work.prefill_job_start.empty());
}

}  // namespace
}  // namespace pagedattn
