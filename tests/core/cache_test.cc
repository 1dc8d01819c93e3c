// Cache::Forward: request validation, atomic failure, idempotent retry and rewind, and
// concurrent Forwards on different layers.
#include "server/core/cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/core/cache_manager.h"
#include "server/core/cpu_backend.h"
#include "tests/test_util.h"

namespace pagedattn {
namespace {

using testing::Encode;
using testing::ForwardModel;
using testing::MakeGeometry;

class CacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_ = MakeGeometry(4, 4, 2, 64, 8, DType::kBFloat16, 20);
    cache_ = std::make_unique<Cache>("c", "", "", g_, *backend_.AllocatePool(g_, StopToken()),
                                     &backend_, 0);
  }

  // A valid single-span prefill request over owned buffers.
  ForwardArgs Prefill(uint64_t seq, int64_t start, int n, float value = 0.5f) {
    q_ = Encode(DType::kFloat32, std::vector<float>(n * 4 * 64, value));
    k_ = Encode(DType::kFloat32, std::vector<float>(n * 2 * 64, value));
    v_ = k_;
    ForwardArgs a;
    a.spans = {{seq, start, n, n}};
    a.q = {DType::kFloat32, {n, 4, 64}, q_.data(), q_.size()};
    a.k = {DType::kFloat32, {n, 2, 64}, k_.data(), k_.size()};
    a.v = {DType::kFloat32, {n, 2, 64}, v_.data(), v_.size()};
    return a;
  }

  void ExpectUnchanged(const CacheStats& before) {
    CacheStats now = cache_->Stats();
    EXPECT_EQ(now.free_pages, before.free_pages);
    EXPECT_EQ(now.used_pages, before.used_pages);
    EXPECT_EQ(now.live_sequences, before.live_sequences);
  }

  CpuBackend backend_{{.num_threads = 2}};
  CacheGeometry g_;
  std::unique_ptr<Cache> cache_;
  std::vector<char> q_, k_, v_;
};

TEST_F(CacheTest, MalformedRequestsAreRejectedWithoutHarm) {
  ASSERT_TRUE(cache_->Forward(Prefill(1, 0, 5)).ok());
  const CacheStats before = cache_->Stats();
  struct Case {
    std::string name;
    std::function<void(ForwardArgs&)> mutate;
    absl::StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"layer", [](ForwardArgs& a) { a.layer = 4; }, absl::StatusCode::kInvalidArgument,
       "layer must be in 0..3"},
      {"no spans", [](ForwardArgs& a) { a.spans.clear(); }, absl::StatusCode::kInvalidArgument,
       "spans"},
      {"truncated q", [](ForwardArgs& a) { a.q.size_bytes -= 1; },
       absl::StatusCode::kInvalidArgument, "q.data must hold"},
      {"wrong dtype", [](ForwardArgs& a) { a.q.dtype = DType::kUnspecified; },
       absl::StatusCode::kInvalidArgument, "q.dtype"},
      {"bad dtype value", [](ForwardArgs& a) { a.k.dtype = static_cast<DType>(9); },
       absl::StatusCode::kInvalidArgument, "k.dtype"},
      {"no v to append", [](ForwardArgs& a) { a.v = {}; }, absl::StatusCode::kInvalidArgument,
       "v is required: the spans append 5 new tokens"},
      {"no q to attend", [](ForwardArgs& a) { a.q = {}; }, absl::StatusCode::kInvalidArgument,
       "q is required: the spans' num_queries total 5"},
      {"negative dim", [](ForwardArgs& a) { a.q.shape[0] = -3; },
       absl::StatusCode::kInvalidArgument, "q.shape"},
      {"huge dim",
       [](ForwardArgs& a) {
         a.q.shape = {int64_t{1} << 62, 4, 64};
       },
       absl::StatusCode::kInvalidArgument, "q.shape"},
      {"rank",
       [](ForwardArgs& a) {
         a.k.shape = {5, 128};
       },
       absl::StatusCode::kInvalidArgument, "k.shape"},
      {"k/v dtype",
       [](ForwardArgs& a) {
         a.v.dtype = DType::kBFloat16;
         a.v.size_bytes /= 2;
       },
       absl::StatusCode::kInvalidArgument, "same dtype"},
      {"missing kv",
       [](ForwardArgs& a) {
         a.k = {};
         a.v = {};
       },
       absl::StatusCode::kInvalidArgument, "k is required: the spans append 5 new tokens"},
      {"queries > length", [](ForwardArgs& a) { a.spans[0].num_queries = 20; },
       absl::StatusCode::kInvalidArgument, "num_queries"},
      {"negative start", [](ForwardArgs& a) { a.spans[0].start = -1; },
       absl::StatusCode::kInvalidArgument, "start"},
      // Before start + num_new_tokens is summed: past 2^63 it would wrap.
      {"start past every position",
       [](ForwardArgs& a) { a.spans[0].start = std::numeric_limits<int64_t>::max(); },
       absl::StatusCode::kInvalidArgument,
       "start must be in 0..1099511627776 (got 9223372036854775807)"},
      {"negative new", [](ForwardArgs& a) { a.spans[0].num_new_tokens = -1; },
       absl::StatusCode::kInvalidArgument, "num_new_tokens"},
      {"duplicate seq", [](ForwardArgs& a) { a.spans.push_back(a.spans[0]); },
       absl::StatusCode::kInvalidArgument, "more than once"},
      {"sm_scale", [](ForwardArgs& a) { a.sm_scale = -1.f; }, absl::StatusCode::kInvalidArgument,
       "sm_scale"},
      {"nan sm_scale", [](ForwardArgs& a) { a.sm_scale = NAN; }, absl::StatusCode::kInvalidArgument,
       "sm_scale"},
      {"gap", [](ForwardArgs& a) { a.spans[0].start = 7; }, absl::StatusCode::kFailedPrecondition,
       "gap"},
      {"unknown seq",
       [](ForwardArgs& a) {
         a.spans[0].seq_id = 99;
         a.spans[0].start = 3;
       },
       absl::StatusCode::kFailedPrecondition, "gap"},
      // A gap is reported as a gap even when the span would not fit either: the caller's
      // mistake, not a capacity problem that more pages would solve.
      {"gap past capacity", [](ForwardArgs& a) { a.spans[0].start = 160; },
       absl::StatusCode::kFailedPrecondition, "gap"},
  };
  for (const Case& c : cases) {
    ForwardArgs a = Prefill(1, 5, 5);
    c.mutate(a);
    absl::StatusOr<ForwardResult> r = cache_->Forward(a);
    EXPECT_EQ(r.status().code(), c.code) << c.name << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos)
        << c.name << ": " << r.status();
    ExpectUnchanged(before);
  }
  // Longer than the whole pool (20 pages x 8 tokens), without a gap.
  absl::StatusOr<ForwardResult> too_long = cache_->Forward(Prefill(2, 0, 161));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kResourceExhausted) << too_long.status();
  EXPECT_NE(too_long.status().message().find("capacity of 160 tokens"), std::string::npos)
      << too_long.status();
  ExpectUnchanged(before);
}

TEST_F(CacheTest, OutOfPagesChangesNothingAndRetryAfterReleaseMatches) {
  ForwardModel model(g_, DType::kFloat32, 3);
  ASSERT_TRUE(model.Run(*cache_, 0, {{1, 0, 100, 100}}).status.ok());  // 13 of 20 pages
  const CacheStats before = cache_->Stats();
  // Needs 4 + 5 = 9 pages > 7 free: nothing may change, not even seq 2's creation.
  ForwardModel::Outcome o = model.Run(*cache_, 1, {{2, 0, 30, 30}, {3, 0, 40, 1}});
  EXPECT_EQ(o.status.code(), absl::StatusCode::kResourceExhausted);
  ExpectUnchanged(before);
  cache_->Release(std::vector<uint64_t>{1});
  EXPECT_TRUE(model.Run(*cache_, 1, {{2, 0, 30, 30}, {3, 0, 40, 1}}).status.ok());
}

TEST_F(CacheTest, RetriedRequestIsIdempotent) {
  ForwardModel model(g_, DType::kFloat32, 5);
  ASSERT_TRUE(model.Run(*cache_, 2, {{1, 0, 20, 20}}).status.ok());
  // The same request (same bytes) twice: the second rewinds to start and rewrites.
  ForwardArgs a = Prefill(1, 20, 6, 0.25f);
  a.layer = 2;
  absl::StatusOr<ForwardResult> first = cache_->Forward(a);
  ASSERT_TRUE(first.ok());
  const CacheStats after_first = cache_->Stats();
  absl::StatusOr<ForwardResult> second = cache_->Forward(a);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(first->out, second->out);
  ExpectUnchanged(after_first);
}

TEST_F(CacheTest, FailedForwardThenRetryGivesIdenticalOutput) {
  ASSERT_TRUE(cache_->Forward(Prefill(1, 0, 9, 0.1f)).ok());
  ForwardArgs good = Prefill(1, 9, 3, 0.7f);
  ForwardArgs bad = good;
  bad.q.size_bytes -= 2;  // truncated: must fail before touching anything
  ASSERT_FALSE(cache_->Forward(bad).ok());
  absl::StatusOr<ForwardResult> r1 = cache_->Forward(good);
  ASSERT_TRUE(r1.ok());
  // Rewind and replay: same answer as the first successful attempt.
  absl::StatusOr<ForwardResult> r2 = cache_->Forward(good);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r1->out, r2->out);
}

TEST_F(CacheTest, AppendOnlyForwardMayOmitQ) {
  ForwardArgs a = Prefill(1, 0, 6);
  a.spans[0].num_queries = 0;
  a.q = {};
  absl::StatusOr<ForwardResult> r = cache_->Forward(a);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->out.empty());
  EXPECT_EQ(r->out_shape, (std::vector<int64_t>{0, 4, 64}));
  EXPECT_EQ(r->out_dtype, DType::kBFloat16);  // the cache's
  EXPECT_EQ(cache_->Stats().used_pages, 1);
  // An FP8 cache's empty out is bfloat16: FP8 is never a tensor's dtype on the wire.
  CacheGeometry fp8 = g_;
  fp8.kv_dtype = DType::kFloat8E4M3;
  EXPECT_EQ(ForwardOutDType(fp8, a), DType::kBFloat16);
  EXPECT_EQ(ForwardOutDType(fp8, Prefill(2, 0, 1)), DType::kFloat32);  // q's
  // Queries later attend what was appended.
  ForwardModel model(g_, DType::kFloat32, 9);
  EXPECT_TRUE(model.Run(*cache_, 1, {{1, 0, 3, 3}}).status.ok());
}

TEST_F(CacheTest, SpeculativeTokensRollBack) {
  ForwardModel model(g_, DType::kFloat32, 8);
  ASSERT_TRUE(model.Run(*cache_, 0, {{1, 0, 10, 10}}).status.ok());
  ASSERT_TRUE(model.Run(*cache_, 0, {{1, 10, 4, 4}}).status.ok());   // speculative
  ForwardModel::Outcome o = model.Run(*cache_, 0, {{1, 11, 1, 1}});  // keep 1 of 4, append 1
  ASSERT_TRUE(o.status.ok());
  EXPECT_LE(o.max_rel_error, 1e-5);
  EXPECT_EQ(model.Length(0, 1), 12);
}

TEST_F(CacheTest, ConcurrentForwardsOnDifferentLayersAreCorrect) {
  std::vector<std::thread> threads;
  std::vector<double> errors(4, 1.0);
  std::vector<absl::Status> statuses(4);
  for (int layer = 0; layer < 4; ++layer) {
    threads.emplace_back([&, layer] {
      ForwardModel model(g_, DType::kFloat32, 100 + layer);
      double worst = 0;
      for (int step = 0; step < 10; ++step) {
        ForwardModel::Outcome o = model.Run(*cache_, layer, {{1, step * 3, 3, 3}, {2, step, 1, 1}});
        if (!o.status.ok()) {
          statuses[layer] = o.status;
          return;
        }
        worst = std::max(worst, o.max_rel_error);
      }
      errors[layer] = worst;
    });
  }
  for (auto& t : threads) t.join();
  for (int layer = 0; layer < 4; ++layer) {
    EXPECT_TRUE(statuses[layer].ok()) << statuses[layer];
    EXPECT_LE(errors[layer], 1e-5) << "layer " << layer;
  }
  EXPECT_EQ(cache_->Stats().live_sequences, 2);
  EXPECT_EQ(cache_->Stats().used_pages, 4 + 2);  // 30 tokens -> 4 pages, 10 -> 2
}

TEST_F(CacheTest, TruncateRewindsOneLayerAndFreesWhatNoLayerNeeds) {
  for (int32_t layer : {0, 1}) {
    ForwardArgs a = Prefill(1, 0, 20);  // 3 pages of 8
    a.layer = layer;
    ASSERT_TRUE(cache_->Forward(a).ok());
  }
  ASSERT_EQ(cache_->Stats().used_pages, 3);
  // Layer 1 back to 4 tokens: layer 0 still needs 3 pages.
  absl::StatusOr<TruncateResult> r = cache_->Truncate(1, {{1, 4}, {7, 0}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->truncated, 1);
  EXPECT_EQ(r->freed_pages, 0);
  EXPECT_EQ(r->unknown_seq_ids, std::vector<uint64_t>{7});
  ForwardArgs gap = Prefill(1, 5, 1);
  gap.layer = 1;
  EXPECT_EQ(cache_->Forward(gap).status().code(), absl::StatusCode::kFailedPrecondition);
  ForwardArgs next = Prefill(1, 4, 1);
  next.layer = 1;
  EXPECT_TRUE(cache_->Forward(next).ok());
  // Longer than the layer: nothing changes.
  r = cache_->Truncate(0, {{1, 100}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->truncated, 0);
  // Layer 0 to 2 tokens: one page is left for the longest layer (5 tokens).
  r = cache_->Truncate(0, {{1, 2}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->freed_pages, 2);
  EXPECT_EQ(cache_->Stats().used_pages, 1);
  // Both layers at 0: the sequence is gone.
  ASSERT_TRUE(cache_->Truncate(0, {{1, 0}}).ok());
  r = cache_->Truncate(1, {{1, 0}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->freed_pages, 1);
  EXPECT_EQ(cache_->Stats().live_sequences, 0);
  EXPECT_EQ(cache_->Stats().used_pages, 0);
}

TEST_F(CacheTest, TruncateRejectsBadArgumentsAndChangesNothing) {
  ASSERT_TRUE(cache_->Forward(Prefill(1, 0, 10)).ok());
  const CacheStats before = cache_->Stats();
  absl::StatusOr<TruncateResult> r = cache_->Truncate(4, {{1, 0}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layer must be in 0..3"), std::string::npos);
  r = cache_->Truncate(0, {{1, 0}, {2, -1}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // The entry is named as the request holds it (lengths[i]), with the value received.
  EXPECT_EQ(r.status().message(), "lengths[1].length must be >= 0 (got -1, for sequence 2)");
  // A sequence given twice (which length would win?) is refused whole, the first not applied.
  r = cache_->Truncate(0, {{1, 3}, {1, 1}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "lengths[1].seq_id: sequence 1 appears more than once in lengths (give each once)");
  ExpectUnchanged(before);
}

TEST_F(CacheTest, ReleaseCountsAnIdGivenTwiceOnce) {
  ASSERT_TRUE(cache_->Forward(Prefill(1, 0, 10)).ok());
  const ReleaseResult r = cache_->Release(std::vector<uint64_t>{1, 1, 9});
  EXPECT_EQ(r.released, 1);
  EXPECT_EQ(r.freed_pages, 2);  // 10 tokens in pages of 8
  EXPECT_EQ(r.unknown_seq_ids, std::vector<uint64_t>{9});
  EXPECT_EQ(cache_->Stats().used_pages, 0);
}

// A CacheManager's request for a bfloat16 cache of head_dim 64 in pages of 16 tokens.
CacheConfigRequest Bf16Request(int32_t layers, int32_t q_heads, int32_t kv_heads, int64_t pages) {
  CacheConfigRequest c;
  c.num_layers = layers;
  c.num_q_heads = q_heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 64;
  c.page_size = 16;
  c.kv_dtype = DType::kBFloat16;
  c.num_pages = pages;
  return c;
}

// A deleted cache's pool counts against --max_total_pool_gb until the last Forward holding it
// lets go (its memory is mapped until then): a cache created meanwhile is refused, as the
// pool budget's message says, and admitted once it is gone.
TEST(CacheManagerTest, DeletedPoolCountsUntilItsLastHolderLetsGo) {
  CpuBackend backend;
  const CacheConfigRequest c = Bf16Request(2, 4, 2, 32);
  const int64_t bytes = 2 * 2 * 2 * 16 * 64 * 2 * 32;  // K and V, 2 layers x 2 heads x 32 pages
  CacheManagerLimits limits;
  limits.max_total_pool_bytes = bytes + bytes / 2;  // one such pool, not two
  CacheManager m(&backend, limits);
  absl::StatusOr<std::shared_ptr<Cache>> a = m.Create(c, "a", "");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(m.total_pool_bytes(), bytes);
  std::shared_ptr<Cache> in_flight = *a;  // what a running Forward holds
  a->reset();
  ASSERT_EQ(*m.Delete(in_flight->id(), ""), bytes);
  EXPECT_EQ(m.total_pool_bytes(), bytes);
  absl::StatusOr<std::shared_ptr<Cache>> b = m.Create(c, "b", "");
  ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  EXPECT_NE(b.status().message().find("--max_total_pool_gb"), std::string::npos) << b.status();
  in_flight.reset();
  EXPECT_EQ(m.total_pool_bytes(), 0);
  b = m.Create(c, "b", "");
  EXPECT_TRUE(b.ok()) << b.status();
}

// A cache with a call on it is in use, not idle, however long ago the call began (a prefill of
// a minute under a 30 s timeout); its end counts as a use.
TEST(CacheManagerTest, DeleteIdleLeavesACacheWithACallInFlight) {
  CpuBackend backend;
  CacheManager m(&backend);
  absl::StatusOr<std::shared_ptr<Cache>> cache = m.Create(Bf16Request(1, 4, 2, 512), "busy", "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  const int64_t tokens = 2048;  // a prefill of a tenth of a second or more
  std::vector<char> q = testing::Encode(DType::kFloat32, std::vector<float>(tokens * 4 * 64, 0.5f));
  std::vector<char> kv =
      testing::Encode(DType::kFloat32, std::vector<float>(tokens * 2 * 64, 0.25f));
  ForwardArgs prefill;
  prefill.spans = {{1, 0, tokens, tokens}};
  prefill.q = {DType::kFloat32, {tokens, 4, 64}, q.data(), q.size()};
  prefill.k = {DType::kFloat32, {tokens, 2, 64}, kv.data(), kv.size()};
  prefill.v = prefill.k;
  std::atomic<bool> done{false};
  const auto launched = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point returned;
  std::thread forward([&] {
    EXPECT_TRUE((*cache)->Forward(prefill).ok());
    returned = std::chrono::steady_clock::now();
    done = true;
  });
  while (!(*cache)->in_use() && !done) {
  }
  const bool seen_in_flight = !done;
  std::vector<IdleCache> gone =
      m.DeleteIdle(std::chrono::steady_clock::now() + std::chrono::hours(24), absl::Hours(1));
  const int64_t idle_ms = (*cache)->Stats().idle_ms;
  const bool still_in_flight = !done;
  forward.join();
  ASSERT_TRUE(seen_in_flight && still_in_flight) << "the prefill ended too soon to test";
  EXPECT_TRUE(gone.empty());
  EXPECT_EQ(idle_ms, 0);
  EXPECT_FALSE((*cache)->in_use());
  // An hour after the call began, less than one after it ended: not idle (its end counts).
  EXPECT_TRUE(
      m.DeleteIdle(launched + std::chrono::hours(1) + (returned - launched) / 2, absl::Hours(1))
          .empty());
  EXPECT_EQ(m.DeleteIdle(returned + std::chrono::minutes(61), absl::Hours(1)).size(), 1u);
}

// A Forward's lookup (GetToUse) restarts the idle clock, under the lock the sweep takes: a
// sweep between the lookup and the Forward's start leaves the cache (it took it, and the call
// answered OK on a cache already gone).
TEST(CacheManagerTest, ALookupToUseRestartsTheIdleClock) {
  CpuBackend backend;
  CacheManager m(&backend);
  absl::StatusOr<std::shared_ptr<Cache>> made = m.Create(Bf16Request(1, 4, 2, 8), "c", "t");
  ASSERT_TRUE(made.ok()) << made.status();
  const std::string id = (*made)->id();
  made->reset();
  while (std::chrono::steady_clock::now() == m.ListAll()[0]->last_used()) {
  }
  const auto before = std::chrono::steady_clock::now();
  ASSERT_TRUE(m.Get(id, "t").ok());  // a look: no use
  EXPECT_LE(m.ListAll()[0]->last_used(), before);
  ASSERT_TRUE(m.GetToUse(id, "t").ok());
  EXPECT_GT(m.ListAll()[0]->last_used(), before);
  EXPECT_TRUE(m.DeleteIdle(before + std::chrono::hours(1), absl::Hours(1)).empty());
  EXPECT_EQ(m.GetToUse(id, "other").status().code(), absl::StatusCode::kNotFound);
}

// A call on its way to a cache (waiting for a thread, or for its layer's turn) keeps every cache
// that was not yet idle for the timeout when it arrived, until its lookup: the call came in time,
// and may be for any of them. A cache already idle for the timeout when the call arrived goes.
TEST(CacheManagerTest, DeleteIdleLeavesACacheACallOnItsWayMayBeFor) {
  CpuBackend backend;
  CacheManagerLimits limits;
  limits.cache_idle_timeout = absl::Hours(1);
  CacheManager m(&backend, limits);
  absl::StatusOr<std::shared_ptr<Cache>> made = m.Create(Bf16Request(1, 4, 2, 8), "c", "t");
  ASSERT_TRUE(made.ok()) << made.status();
  const std::string id = (*made)->id();
  made->reset();
  const auto created = m.ListAll()[0]->last_used();
  CacheManager::Arrival arrival = m.Arrive();
  CacheManager::Arrival copy = arrival;  // copies share the call's one record
  const auto day = std::chrono::hours(24);
  EXPECT_TRUE(m.DeleteIdle(created + day, absl::Hours(1)).empty());
  // Its lookup marks the use, then ends the arrival: the next sweep measures from the use.
  ASSERT_TRUE(m.GetToUse(id, "t", std::move(arrival)).ok());
  const auto used = m.ListAll()[0]->last_used();
  EXPECT_TRUE(m.DeleteIdle(used + std::chrono::minutes(59), absl::Hours(1)).empty());
  EXPECT_EQ(m.DeleteIdle(used + day, absl::Hours(1)).size(), 1u);
  copy.End();  // idempotent once ended

  // A call that arrived after a cache went idle for the timeout leaves it to the sweep; a call
  // on its way that never looks a cache up holds the sweep until it ends.
  CacheManagerLimits short_limits;
  short_limits.cache_idle_timeout = absl::Milliseconds(5);
  CacheManager s(&backend, short_limits);
  ASSERT_TRUE(s.Create(Bf16Request(1, 4, 2, 8), "old", "t").ok());
  absl::SleepFor(absl::Milliseconds(20));  // the cache's idle time passing, not a wait
  ASSERT_TRUE(s.Create(Bf16Request(1, 4, 2, 8), "new", "t").ok());
  CacheManager::Arrival late = s.Arrive();
  std::vector<IdleCache> gone =
      s.DeleteIdle(std::chrono::steady_clock::now() + day, absl::Milliseconds(5));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].name, "old");
  late = {};  // its last copy gone: the arrival ends
  gone = s.DeleteIdle(std::chrono::steady_clock::now() + day, absl::Milliseconds(5));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].name, "new");

  // Without an idle timeout no arrival is recorded.
  CacheManager none(&backend);
  ASSERT_TRUE(none.Create(Bf16Request(1, 4, 2, 8), "c", "t").ok());
  CacheManager::Arrival untracked = none.Arrive();
  EXPECT_EQ(none.DeleteIdle(std::chrono::steady_clock::now() + day, absl::Hours(1)).size(), 1u);
}

// DeleteIdle takes the caches that no Forward, release or truncate came to for the timeout (a
// failed Forward counts: its caller is alive), whoever owns them, as Delete would; the others
// stay. Its clock is the caller's, so the test needs no waiting.
TEST(CacheManagerTest, DeleteIdleTakesOnlyCachesUnusedForTheTimeout) {
  CpuBackend backend;
  const CacheConfigRequest c = Bf16Request(2, 4, 2, 32);
  CacheManager m(&backend);
  absl::StatusOr<std::shared_ptr<Cache>> forwarded = m.Create(c, "forwarded", "tenant-b");
  absl::StatusOr<std::shared_ptr<Cache>> released = m.Create(c, "released", "");
  absl::StatusOr<std::shared_ptr<Cache>> truncated = m.Create(c, "truncated", "");
  absl::StatusOr<std::shared_ptr<Cache>> failed = m.Create(c, "failed", "");
  // Made last: a cache whose use was not marked is older than it, and would go with it.
  absl::StatusOr<std::shared_ptr<Cache>> left = m.Create(c, "left", "tenant-a");
  for (const auto* r : {&left, &forwarded, &released, &truncated, &failed}) {
    ASSERT_TRUE(r->ok()) << r->status();
  }
  const std::string left_id = (*left)->id();
  const int64_t bytes = (*left)->geometry().TotalBytes();
  // Each use comes after every creation: its time is later than the left cache's creation.
  while (std::chrono::steady_clock::now() == (*left)->last_used()) {
  }
  ForwardArgs append;
  std::vector<char> kv = testing::Encode(DType::kFloat32, std::vector<float>(2 * 64, 0.25f));
  append.spans = {{7, 0, 1, 0}};
  append.k = {DType::kFloat32, {1, 2, 64}, kv.data(), kv.size()};
  append.v = append.k;
  ASSERT_TRUE((*forwarded)->Forward(append).ok());
  (*released)->Release(std::vector<uint64_t>{7});
  ASSERT_TRUE((*truncated)->Truncate(0, {{7, 0}}).ok());
  ForwardArgs bad = append;
  bad.layer = 9;
  ASSERT_FALSE((*failed)->Forward(bad).ok());
  const auto first_use = std::min({(*forwarded)->last_used(), (*released)->last_used(),
                                   (*truncated)->last_used(), (*failed)->last_used()});
  ASSERT_GT(first_use, (*left)->last_used());

  // Just under an hour after the first use: every cache used since is idle for less than an
  // hour, the one left alone for longer.
  left->reset();
  const auto now = first_use + std::chrono::hours(1) - std::chrono::nanoseconds(1);
  std::vector<IdleCache> gone = m.DeleteIdle(now, absl::Hours(1));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].id, left_id);
  EXPECT_EQ(gone[0].name, "left");
  EXPECT_EQ(gone[0].owner, "tenant-a");
  EXPECT_EQ(gone[0].bytes, bytes);
  EXPECT_GE(gone[0].idle, absl::Hours(1));
  // A call naming it is told why it is gone; another tenant learns nothing of it.
  for (const absl::Status& s :
       {m.Get(left_id, "tenant-a").status(), m.Delete(left_id, "tenant-a").status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_NE(s.message().find("was deleted by the server after 3600 s unused (its "
                               "--cache_idle_timeout_s): create the cache again"),
              std::string::npos)
        << s;
  }
  const absl::Status other = m.Get(left_id, "tenant-b").status();
  EXPECT_EQ(other.message(), absl::StrCat("cache '", left_id, "' not found")) << other;
  EXPECT_EQ(m.total_pool_bytes(), 4 * bytes);  // its pool went with it
  EXPECT_EQ(m.ListAll().size(), 4u);
  EXPECT_TRUE(m.DeleteIdle(now, absl::Hours(1)).empty());
  // A day on, every one of them (every tenant's), oldest first.
  gone = m.DeleteIdle(now + std::chrono::hours(24), absl::Hours(1));
  ASSERT_EQ(gone.size(), 4u);
  EXPECT_EQ(gone[0].name, "forwarded");
  EXPECT_EQ(gone[3].name, "failed");
  EXPECT_TRUE(m.ListAll().empty());
  EXPECT_EQ(m.total_pool_bytes(), 4 * bytes);  // the test still holds them
}

// A cache's idle_ms counts from its last use.
TEST_F(CacheTest, IdleMsCountsFromTheLastUse) {
  const auto created = cache_->last_used();
  absl::SleepFor(absl::Milliseconds(300));  // time passing, not a wait for another thread
  EXPECT_GE(cache_->Stats().idle_ms, 300);
  ASSERT_TRUE(cache_->Forward(Prefill(1, 0, 3)).ok());
  EXPECT_GT(cache_->last_used(), created);
  EXPECT_LT(cache_->Stats().idle_ms, 300);
}

// A call gRPC cancelled because its deadline passed is DEADLINE_EXCEEDED, not CANCELLED (the
// server's logs and metrics would blame the caller); one cancelled before it is CANCELLED.
TEST(StopTokenTest, APassedDeadlineIsDeadlineExceededThoughCancelled) {
  const StopToken late([] { return true; }, absl::Now() - absl::Milliseconds(1));
  EXPECT_EQ(late.Check().code(), absl::StatusCode::kDeadlineExceeded);
  const StopToken early([] { return true; }, absl::Now() + absl::Hours(1));
  EXPECT_EQ(early.Check().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(StopToken([] { return false; }, absl::Now() + absl::Hours(1)).Check().ok());
}

// The CPU backend, whose Forward throws std::bad_alloc while `throws` is set (memory the
// backend could not have).
class ThrowingBackend final : public Backend {
 public:
  bool throws = false;
  BackendKind kind() const override { return cpu_.kind(); }
  std::string name() const override { return cpu_.name(); }
  std::string device_name() const override { return cpu_.device_name(); }
  int device_count() const override { return cpu_.device_count(); }
  absl::StatusOr<MemoryInfo> memory(int device) const override { return cpu_.memory(device); }
  absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry& g,
                                                       const StopToken& stop) override {
    return cpu_.AllocatePool(g, stop);
  }
  absl::Status Forward(KvPool& pool, const CacheGeometry& g, const ForwardPlan& plan,
                       const ForwardIO& io) override {
    if (throws) throw std::bad_alloc();
    return cpu_.Forward(pool, g, plan, io);
  }

 private:
  CpuBackend cpu_;
};

// A backend's exception is the Forward's error (RESOURCE_EXHAUSTED for memory), and the cache
// is as it was: the reservation rolled back (a rewind's length too), not left by the unwinding.
TEST(CacheExceptionTest, ABackendsExceptionFailsTheForwardAndRollsBack) {
  ThrowingBackend backend;
  const CacheGeometry g = MakeGeometry(2, 4, 2, 64, 8, DType::kFloat32, 20);
  Cache cache("c", "", "", g, *backend.AllocatePool(g, StopToken()), &backend, 0);
  ForwardModel model(g, DType::kFloat32, 17);
  ASSERT_TRUE(model.Run(cache, 0, {{1, 0, 20, 20}}).status.ok());
  const CacheStats before = cache.Stats();
  backend.throws = true;
  const ForwardModel::Outcome failed = model.Run(cache, 0, {{1, 12, 3, 3}, {2, 0, 9, 9}});
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kResourceExhausted) << failed.status;
  EXPECT_EQ(cache.Stats().used_pages, before.used_pages);
  EXPECT_EQ(cache.Stats().live_sequences, before.live_sequences);
  backend.throws = false;
  // Sequence 1 still has its 20 tokens (the rewind to 12 undone): its decode at 20 runs and
  // reads them; sequence 2 starts afresh.
  const ForwardModel::Outcome next = model.Run(cache, 0, {{1, 20, 1, 1}, {2, 0, 9, 9}});
  ASSERT_TRUE(next.status.ok()) << next.status;
  EXPECT_LE(next.max_rel_error, 1e-5);
}

// A listing gives caches in the order they were made, also those made within one millisecond
// (a small CPU cache is made in microseconds: sixteen of them share a few milliseconds, whose
// random ids would order them otherwise), and a page token goes on exactly after its cache.
TEST(CacheManagerTest, ListsInTheOrderCachesWereMade) {
  CpuBackend backend;
  const CacheConfigRequest c = Bf16Request(1, 2, 1, 2);
  CacheManager m(&backend);
  std::vector<std::string> made;
  for (int i = 0; i < 16; ++i) {
    absl::StatusOr<std::shared_ptr<Cache>> cache = m.Create(c, absl::StrCat("c", i), "");
    ASSERT_TRUE(cache.ok()) << cache.status();
    made.push_back((*cache)->id());
  }
  auto ids = [](const std::vector<std::shared_ptr<Cache>>& caches) {
    std::vector<std::string> out;
    for (const auto& cache : caches) out.push_back(cache->id());
    return out;
  };
  EXPECT_EQ(ids(m.List("")), made);
  const std::vector<std::shared_ptr<Cache>> all = m.List("");
  ASSERT_TRUE(m.Delete(made[5], "").ok());  // the token's own cache gone: the listing goes on
  absl::StatusOr<std::vector<std::shared_ptr<Cache>>> rest = m.ListAfter("", m.ListToken(*all[5]));
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(ids(*rest), std::vector<std::string>(made.begin() + 6, made.end()));
  for (const char* bad : {"x", "0", "-1", "3:abc", "6", "0000000000000006", "ffffffffffffffff"}) {
    EXPECT_EQ(m.ListAfter("", bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // A token is not the cache's serial (which would tell a tenant how many caches others made
  // between two of its own), and holds for its owner only.
  absl::StatusOr<std::shared_ptr<Cache>> a1 = m.Create(c, "a1", "alice");
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(m.Create(c, "b", "bob").ok());
  absl::StatusOr<std::shared_ptr<Cache>> a2 = m.Create(c, "a2", "alice");
  ASSERT_TRUE(a1.ok() && a2.ok());
  const std::string t1 = m.ListToken(**a1), t2 = m.ListToken(**a2);
  EXPECT_EQ(t1.size(), 16u);
  uint64_t plain = 0;
  ASSERT_TRUE(absl::SimpleHexAtoi(t1, &plain)) << t1;
  EXPECT_NE(plain, (*a1)->serial()) << t1;
  EXPECT_NE(plain >> 24, (*a1)->serial()) << t1;
  absl::StatusOr<std::vector<std::shared_ptr<Cache>>> after = m.ListAfter("alice", t1);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(ids(*after), std::vector<std::string>{(*a2)->id()});
  EXPECT_TRUE(m.ListAfter("alice", t2)->empty());
  EXPECT_EQ(m.ListAfter("bob", t1).status().code(), absl::StatusCode::kInvalidArgument);
  CacheManager other(&backend);  // another server's token
  EXPECT_EQ(other.ListAfter("alice", t1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagedattn
