// ShardedClient against real servers on loopback: a cache split by KV head over 2 and 4 servers
// answers bit-identically to one unsharded server (prefill, decode, mixed, rewind, lse), bad
// configs name the field and the shard, and a shard that fails (out of pages, killed) leaves
// every shard's cache as it was, with an error naming the shard.
#include "client/sharded.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/service/server.h"
#include "spdlog/spdlog.h"
#include "tests/service/backend_under_test.h"
#include "tests/service/log_capture.h"

namespace pagedattn {
namespace {

constexpr int kLayers = 2, kQHeads = 8, kKvHeads = 4, kHeadDim = 64;

using testing::BackendOptionsUnderTest;
using testing::OnCpu;

std::unique_ptr<PagedAttnServer> StartServer() {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend = BackendOptionsUnderTest(1);
  return *PagedAttnServer::Start(o);
}

ClientOptions Options() {
  ClientOptions c;
  c.timeout = absl::Seconds(60);
  return c;
}

v1::CacheConfig Config(v1::DType dtype, int q_heads = kQHeads, int kv_heads = kKvHeads) {
  v1::CacheConfig c;
  c.set_num_layers(kLayers);
  c.set_num_q_heads(q_heads);
  c.set_num_kv_heads(kv_heads);
  c.set_head_dim(kHeadDim);
  c.set_page_size(7);
  c.set_kv_dtype(dtype);
  c.set_num_pages(64);
  return c;
}

// One Forward's inputs in the whole cache's layout, random but deterministic.
struct Step {
  int32_t layer;
  std::vector<wire::SpanRef> spans;  // seq, start, new, queries
  std::string q, k, v;
  std::vector<int64_t> q_shape, kv_shape;
  v1::DType dtype;

  Step(int32_t l, std::vector<wire::SpanRef> s, v1::DType d, uint64_t seed, int q_heads = kQHeads,
       int kv_heads = kKvHeads)
      : layer(l), spans(std::move(s)), dtype(d) {
    int64_t queries = 0, tokens = 0;
    for (const wire::SpanRef& span : spans) {
      queries += span.num_queries;
      tokens += span.num_new_tokens;
    }
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> dist;
    auto make = [&](int64_t n) {
      const size_t e = d == v1::FLOAT32 ? 4 : 2;
      std::string bytes(static_cast<size_t>(n) * e, '\0');
      for (int64_t i = 0; i < n; ++i) {
        const float f = dist(rng);
        if (e == 4) {
          std::memcpy(bytes.data() + 4 * i, &f, 4);
        } else {
          uint32_t u;
          std::memcpy(&u, &f, 4);
          const uint16_t h = static_cast<uint16_t>(u >> 16);  // bf16 by truncation
          std::memcpy(bytes.data() + 2 * i, &h, 2);
        }
      }
      return bytes;
    };
    q_shape = {queries, q_heads, kHeadDim};
    kv_shape = {tokens, kv_heads, kHeadDim};
    q = make(queries * q_heads * kHeadDim);
    k = make(tokens * kv_heads * kHeadDim);
    v = make(tokens * kv_heads * kHeadDim);
  }

  ForwardCall Call(const std::string& cache_id) const {
    ForwardCall call;
    call.cache_id = cache_id;
    call.layer = layer;
    call.spans = spans;
    call.options.return_lse = true;
    call.q = TensorArg::Host(dtype, q_shape, q.data(), q.size());
    if (kv_shape[0] > 0) {
      call.k = TensorArg::Host(dtype, kv_shape, k.data(), k.size());
      call.v = TensorArg::Host(dtype, kv_shape, v.data(), v.size());
    }
    return call;
  }
  size_t out_bytes() const { return q.size(); }
  size_t lse_bytes() const { return static_cast<size_t>(q_shape[0] * q_shape[1]) * 4; }
};

// Prefill, decode, a mixed batch, attend-only spans, a rewind, on both layers.
std::vector<Step> Script(v1::DType d, int q_heads = kQHeads, int kv_heads = kKvHeads) {
  std::vector<Step> s;
  uint64_t seed = 1;
  auto add = [&](int32_t layer, std::vector<wire::SpanRef> spans) {
    s.emplace_back(layer, std::move(spans), d, seed++, q_heads, kv_heads);
  };
  for (int32_t l = 0; l < kLayers; ++l) add(l, {{1, 0, 37, 37}, {2, 0, 19, 19}});
  for (int32_t l = 0; l < kLayers; ++l) add(l, {{1, 37, 1, 1}, {2, 19, 13, 13}, {3, 0, 5, 5}});
  add(0, {{1, 30, 3, 3}, {2, 32, 0, 4}, {3, 5, 0, 2}});  // rewind, attend-only
  add(1, {{1, 38, 2, 2}, {3, 5, 1, 1}});
  add(0, {{1, 33, 1, 1}, {3, 5, 1, 1}});
  return s;
}

struct Answer {
  std::string out, lse;
};

class ShardedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int i = 0; i < 5; ++i) servers_.push_back(StartServer());  // the last: unsharded
  }
  static void TearDownTestSuite() { servers_.clear(); }

  static std::string Target(int i) { return absl::StrCat("127.0.0.1:", servers_[i]->port()); }

  std::unique_ptr<ShardedClient> Sharded(int n) {
    std::vector<std::string> targets;
    for (int i = 0; i < n; ++i) targets.push_back(Target(i));
    return *ShardedClient::Connect(targets, Options());
  }
  std::unique_ptr<Client> Reference() {
    ClientOptions o = Options();
    o.target = Target(4);
    return *Client::Connect(o);
  }

  static absl::StatusOr<Answer> Run(ShardedClient& c, const ShardedCache& cache, const Step& s) {
    Answer a;
    a.out.resize(s.out_bytes());
    a.lse.resize(s.lse_bytes());
    absl::StatusOr<ForwardReply> r = c.Forward(
        cache, s.Call(""),
        {a.out.data(), a.out.size(), reinterpret_cast<float*>(a.lse.data()), a.lse.size()});
    if (!r.ok()) return r.status();
    EXPECT_EQ(r->out_shape, s.q_shape);
    return a;
  }
  static absl::StatusOr<Answer> Run(Client& c, const std::string& cache, const Step& s) {
    Answer a;
    a.out.resize(s.out_bytes());
    a.lse.resize(s.lse_bytes());
    absl::StatusOr<ForwardReply> r = c.ForwardTensors(
        s.Call(cache),
        {a.out.data(), a.out.size(), reinterpret_cast<float*>(a.lse.data()), a.lse.size()});
    if (!r.ok()) return r.status();
    return a;
  }

  static std::vector<std::unique_ptr<PagedAttnServer>> servers_;
};
std::vector<std::unique_ptr<PagedAttnServer>> ShardedTest::servers_;

TEST_F(ShardedTest, AnswersAreBitIdenticalToOneServer) {
  struct Variant {
    int shards;
    v1::DType dtype;
    int q_heads, kv_heads;
    bool layer_options = false;  // every layer windowed, soft-capped, with per-q-head sinks
  };
  for (const Variant& v : {Variant{2, v1::BFLOAT16, 8, 4}, Variant{4, v1::BFLOAT16, 8, 4},
                           Variant{2, v1::FLOAT32, 8, 4}, Variant{4, v1::BFLOAT16, 16, 4},
                           Variant{4, v1::BFLOAT16, 16, 4, true}}) {
    if (!OnCpu() && v.dtype == v1::FLOAT32) continue;  // the CUDA backend has no float32 cache
    SCOPED_TRACE(absl::StrCat(v.shards, " shards, dtype ", v.dtype, ", ", v.q_heads, "/",
                              v.kv_heads, " heads"));
    std::unique_ptr<ShardedClient> sharded = Sharded(v.shards);
    std::unique_ptr<Client> ref = Reference();
    v1::CacheConfig config = Config(v.dtype, v.q_heads, v.kv_heads);
    if (v.layer_options) {  // each shard must get its own q heads' sinks
      v1::LayerAttention* layer = config.add_layers();
      layer->set_sliding_window(3);
      layer->set_logit_softcap(5.f);
      for (int h = 0; h < v.q_heads; ++h) layer->add_sinks(0.5f * h - 1.f);
    }
    absl::StatusOr<ShardedCache> cache = sharded->CreateCache(config, "sharded");
    ASSERT_TRUE(cache.ok()) << cache.status();
    const std::string ref_cache = ref->CreateCache(config)->cache_id();
    int i = 0;
    for (const Step& s : Script(v.dtype, v.q_heads, v.kv_heads)) {
      SCOPED_TRACE(absl::StrCat("step ", i++));
      absl::StatusOr<Answer> want = Run(*ref, ref_cache, s);
      ASSERT_TRUE(want.ok()) << want.status();
      absl::StatusOr<Answer> got = Run(*sharded, *cache, s);
      ASSERT_TRUE(got.ok()) << got.status();
      if (OnCpu()) {
        EXPECT_TRUE(got->out == want->out) << "out differs";
        EXPECT_TRUE(got->lse == want->lse) << "lse differs";
      } else {
        EXPECT_EQ(got->out.size(), want->out.size());
      }
    }
    EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
    EXPECT_TRUE(ref->DeleteCache(ref_cache).ok());
  }
}

TEST_F(ShardedTest, ConfigErrorsNameTheFieldAndTheShard) {
  std::unique_ptr<ShardedClient> sharded = Sharded(4);
  v1::CacheConfig c = Config(v1::BFLOAT16, 6, 2);  // 2 kv heads over 4 shards
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(c, "");
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cache.status().message().find("num_kv_heads: 2"), std::string::npos) << cache.status();
  EXPECT_NE(cache.status().message().find("divide it: 1, 2"), std::string::npos) << cache.status();
  // Valid as a whole, not on shard 2 (its pool of -1 pages).
  cache = sharded->CreateCache(Config(v1::BFLOAT16), "", {64, 64, -1, 64});
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cache.status().message().find("shard 2 (" + Target(2) + "): num_pages"),
            std::string::npos)
      << cache.status();
  // Nothing was created anywhere.
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(sharded->shard(i).ListCaches()->empty());
}

TEST_F(ShardedTest, OutOfPagesOnOneShardChangesNoShard) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  std::unique_ptr<Client> ref = Reference();
  const v1::CacheConfig config = Config(v1::BFLOAT16);
  // Shard 1 holds 10 pages (70 tokens), shard 0 and the reference 64.
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(config, "", {64, 10});
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::string ref_cache = ref->CreateCache(config)->cache_id();
  const Step first(0, {{1, 0, 40, 40}}, v1::BFLOAT16, 11);
  ASSERT_TRUE(Run(*sharded, *cache, first).ok());
  ASSERT_TRUE(Run(*ref, ref_cache, first).ok());
  std::vector<v1::CacheStats> before;
  for (int i = 0; i < 2; ++i)
    before.push_back(sharded->shard(i).GetCache(cache->cache_ids[i])->stats());

  // 40 more tokens of a new sequence need 6 more pages: shard 1 has 4.
  const Step big(0, {{1, 40, 1, 1}, {2, 0, 40, 40}}, v1::BFLOAT16, 12);
  absl::StatusOr<Answer> failed = Run(*sharded, *cache, big);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(failed.status().message().find("shard 1 (" + Target(1) + ")"), std::string::npos)
      << failed.status();
  for (int i = 0; i < 2; ++i) {
    const v1::CacheStats now = sharded->shard(i).GetCache(cache->cache_ids[i])->stats();
    EXPECT_EQ(now.used_pages(), before[i].used_pages()) << "shard " << i;
    EXPECT_EQ(now.live_sequences(), before[i].live_sequences()) << "shard " << i;
  }
  // The shards answer as the reference that never saw the failed call...
  const Step decode(0, {{1, 40, 1, 1}}, v1::BFLOAT16, 13);
  absl::StatusOr<Answer> want = Run(*ref, ref_cache, decode);
  absl::StatusOr<Answer> got = Run(*sharded, *cache, decode);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  if (OnCpu()) {
    EXPECT_TRUE(got->out == want->out && got->lse == want->lse);
  }
  // ... and a retry after pages are freed succeeds as the reference.
  const Step retry(1, {{2, 0, 40, 40}}, v1::BFLOAT16, 14);
  ASSERT_TRUE(sharded->ReleaseSequences(*cache, {1}).ok());
  ASSERT_TRUE(ref->ReleaseSequences(ref_cache, {1}).ok());
  want = Run(*ref, ref_cache, retry);
  got = Run(*sharded, *cache, retry);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  if (OnCpu()) {
    EXPECT_TRUE(got->out == want->out && got->lse == want->lse);
  }
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
}

// TruncateSequences and GetCache go to every shard: the shards then answer as one server
// rewound the same way, and a shard whose cache is gone is named while the others still rewind.
TEST_F(ShardedTest, TruncateAndGetCacheReachEveryShard) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  std::unique_ptr<Client> ref = Reference();
  const v1::CacheConfig config = Config(v1::BFLOAT16);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(config, "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::string ref_cache = ref->CreateCache(config)->cache_id();
  const Step prefill(0, {{1, 0, 40, 40}, {2, 0, 9, 9}}, v1::BFLOAT16, 21);
  ASSERT_TRUE(Run(*sharded, *cache, prefill).ok());
  ASSERT_TRUE(Run(*ref, ref_cache, prefill).ok());

  const std::vector<std::pair<uint64_t, int64_t>> lengths = {{1, 20}, {5, 3}};
  absl::StatusOr<std::vector<v1::TruncateSequencesResponse>> cut =
      sharded->TruncateSequences(*cache, 0, lengths);
  ASSERT_TRUE(cut.ok()) << cut.status();
  absl::StatusOr<v1::TruncateSequencesResponse> ref_cut =
      ref->TruncateSequences(ref_cache, 0, lengths);
  ASSERT_TRUE(ref_cut.ok()) << ref_cut.status();
  ASSERT_EQ(cut->size(), 2u);
  for (const v1::TruncateSequencesResponse& r : *cut) {
    EXPECT_EQ(r.truncated(), 1);
    EXPECT_EQ(r.freed_pages(), ref_cut->freed_pages());
    ASSERT_EQ(r.unknown_seq_ids_size(), 1);
    EXPECT_EQ(r.unknown_seq_ids(0), 5u);
  }
  absl::StatusOr<std::vector<v1::CacheInfo>> infos = sharded->GetCache(*cache);
  ASSERT_TRUE(infos.ok()) << infos.status();
  const v1::CacheStats ref_stats = ref->GetCache(ref_cache)->stats();
  ASSERT_EQ(infos->size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ((*infos)[i].cache_id(), cache->cache_ids[i]);
    EXPECT_EQ((*infos)[i].stats().used_pages(), ref_stats.used_pages()) << "shard " << i;
    EXPECT_EQ((*infos)[i].stats().live_sequences(), ref_stats.live_sequences()) << "shard " << i;
  }
  // Sequence 1 is 20 long on every shard, as on the reference: a span at 22 leaves a gap.
  const Step gap(0, {{1, 22, 1, 1}}, v1::BFLOAT16, 22);
  EXPECT_EQ(Run(*ref, ref_cache, gap).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<Answer> got = Run(*sharded, *cache, gap);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  const Step next(0, {{1, 20, 2, 2}}, v1::BFLOAT16, 23);
  absl::StatusOr<Answer> want = Run(*ref, ref_cache, next);
  ASSERT_TRUE(want.ok()) << want.status();
  got = Run(*sharded, *cache, next);
  ASSERT_TRUE(got.ok()) << got.status();
  if (OnCpu()) {
    EXPECT_TRUE(got->out == want->out && got->lse == want->lse);
  }

  // Shard 1's cache gone: named, and shard 0 rewound all the same (sequence 2's 9 tokens to 4:
  // one of its two pages of 7 freed).
  const int64_t used = sharded->shard(0).GetCache(cache->cache_ids[0])->stats().used_pages();
  ASSERT_TRUE(sharded->shard(1).DeleteCache(cache->cache_ids[1]).ok());
  cut = sharded->TruncateSequences(*cache, 0, {{2, 4}});
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(cut.status().message().find("shard 1 (" + Target(1) + ")"), std::string::npos)
      << cut.status();
  infos = sharded->GetCache(*cache);
  EXPECT_EQ(infos.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(infos.status().message().find("shard 1 ("), std::string::npos) << infos.status();
  EXPECT_EQ(sharded->shard(0).GetCache(cache->cache_ids[0])->stats().used_pages(), used - 1);
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
  EXPECT_TRUE(ref->DeleteCache(ref_cache).ok());
}

// A failure every shard shares is said once, with the shards it came from; each other failure
// after it.
TEST_F(ShardedTest, AFailureOfEveryShardIsSaidOnce) {
  std::unique_ptr<ShardedClient> sharded = Sharded(3);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16, 6, 3), "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  absl::StatusOr<std::vector<v1::TruncateSequencesResponse>> cut =
      sharded->TruncateSequences(*cache, 99, {{1, 0}});
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(cut.status().message());
  EXPECT_EQ(message.find("shards 0 (" + Target(0) + "), 1 (" + Target(1) + "), 2 (" + Target(2) +
                         ") of 3: layer must be in 0.."),
            0u)
      << message;
  EXPECT_EQ(message.find("layer must be"), message.rfind("layer must be")) << message;
  const Step bad_layer(99, {{1, 0, 3, 3}}, v1::BFLOAT16, 5, 6, 3);
  absl::StatusOr<Answer> forward = Run(*sharded, *cache, bad_layer);
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(forward.status().message()).find("shards 0 (" + Target(0) + "), 1 ("), 0u)
      << forward.status();
  EXPECT_EQ(forward.status().message().find("layer must be"),
            forward.status().message().rfind("layer must be"))
      << forward.status();

  // Shard 1's cache gone: the layer said once for shards 0 and 2, then shard 1's NOT_FOUND.
  ASSERT_TRUE(sharded->shard(1).DeleteCache(cache->cache_ids[1]).ok());
  cut = sharded->TruncateSequences(*cache, 99, {{1, 0}});
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kInvalidArgument) << cut.status();
  EXPECT_EQ(std::string(cut.status().message())
                .find("shards 0 (" + Target(0) + "), 2 (" + Target(2) + ") of 3: layer must be"),
            0u)
      << cut.status();
  EXPECT_NE(cut.status().message().find("; NOT_FOUND: shard 1 (" + Target(1) + "): "),
            std::string::npos)
      << cut.status();
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
}

// Shapes, bytes and sinks are checked as the whole cache's before anything is sent: a shard's
// server would name its own part (4 q heads, not 8), and a short buffer would be read past.
TEST_F(ShardedTest, WholeCacheShapesAreCheckedBeforeSending) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  v1::CacheConfig with_sinks = Config(v1::BFLOAT16);
  v1::LayerAttention* layer = with_sinks.add_layers();
  for (int h = 0; h < 4; ++h) layer->add_sinks(0.5f);  // 4 sinks for 8 q heads
  absl::StatusOr<ShardedCache> refused = sharded->CreateCache(with_sinks, "");
  EXPECT_EQ(refused.status().message(),
            "layers[0].sinks: sinks must have num_q_heads=8 values, one per q head (got 4)");

  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16), "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  const Step step(0, {{1, 0, 5, 5}}, v1::BFLOAT16, 21);
  std::string out(step.out_bytes(), '\0'), lse(step.lse_bytes(), '\0');
  const ForwardOutput output{out.data(), out.size(), reinterpret_cast<float*>(lse.data()),
                             lse.size()};
  ForwardCall call = step.Call("");
  call.k.shape = {4, kKvHeads, kHeadDim};
  EXPECT_EQ(sharded->Forward(*cache, call, output).status().message(),
            "k.shape must be [5, 4, 64] = [total_new_tokens, num_kv_heads, head_dim] (got [4, 4, "
            "64])");
  call = step.Call("");
  call.q.bytes = 8;  // a buffer shorter than its shape: never sliced
  EXPECT_EQ(sharded->Forward(*cache, call, output).status().message(),
            "q.data must hold 5120 bytes (got 8)");
  call = step.Call("");
  call.k.shape = {-1, kKvHeads, kHeadDim};
  EXPECT_EQ(sharded->Forward(*cache, call, output).status().code(),
            absl::StatusCode::kInvalidArgument);
  call = step.Call("");
  call.options.return_lse = false;  // an lse buffer nobody would fill
  EXPECT_EQ(sharded->Forward(*cache, call, output).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(sharded->shard(i).GetCache(cache->cache_ids[i])->stats().forward_calls(), 0);
  }
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
}

// The unsharded client checks its output buffers before sending: found after the answer came,
// the server would have committed the call's tokens already.
TEST_F(ShardedTest, OutputBuffersAreCheckedBeforeSending) {
  std::unique_ptr<Client> ref = Reference();
  const std::string cache = ref->CreateCache(Config(v1::BFLOAT16))->cache_id();
  const Step step(0, {{1, 0, 6, 6}}, v1::BFLOAT16, 41);
  std::string out(step.out_bytes() - 2, '\0'), lse(step.lse_bytes(), '\0');
  absl::StatusOr<ForwardReply> r = ref->ForwardTensors(
      step.Call(cache), {out.data(), out.size(), reinterpret_cast<float*>(lse.data()), lse.size()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  out.resize(step.out_bytes());
  ForwardCall no_lse = step.Call(cache);
  no_lse.options.return_lse = false;
  r = ref->ForwardTensors(
      no_lse, {out.data(), out.size(), reinterpret_cast<float*>(lse.data()), lse.size()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(ref->GetCache(cache)->stats().live_sequences(), 0) << "a refused call was sent";
  // Errors keep the server's details (here the ErrorInfo of RESOURCE_EXHAUSTED).
  const Step too_long(0, {{2, 0, 500, 1}}, v1::BFLOAT16, 42);
  out.resize(too_long.out_bytes());
  lse.resize(too_long.lse_bytes());
  r = ref->ForwardTensors(too_long.Call(cache), {out.data(), out.size(),
                                                 reinterpret_cast<float*>(lse.data()), lse.size()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(r.status().GetPayload(kStatusDetailsPayload).has_value()) << r.status();
  EXPECT_TRUE(ref->DeleteCache(cache).ok());
}

// A call that every shard refused before writing is not rolled back: a rewinding span's
// sequence keeps its rows before the span's start on every shard.
TEST_F(ShardedTest, ACallNoShardWroteIsNotRolledBack) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16), "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(Run(*sharded, *cache, Step(0, {{1, 0, 20, 20}}, v1::BFLOAT16, 31)).ok());
  ForwardCall call;
  const Step rewind(0, {{1, 10, 4, 4}}, v1::BFLOAT16, 32);
  call = rewind.Call("");
  call.options.sm_scale = -1.0f;  // every shard refuses it: INVALID_ARGUMENT
  std::string out(rewind.out_bytes(), '\0'), lse(rewind.lse_bytes(), '\0');
  absl::StatusOr<ForwardReply> r = sharded->Forward(
      *cache, call,
      {out.data(), out.size(), reinterpret_cast<float*>(lse.data()), lse.size()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(r.status().message().find("rewind"), std::string::npos) << r.status();
  // Still 20 tokens on both shards: appending at 20 leaves no gap.
  EXPECT_TRUE(Run(*sharded, *cache, Step(0, {{1, 20, 1, 1}}, v1::BFLOAT16, 33)).ok());
  // A shard whose cache is gone counts as deleted (its server restarted, say).
  ASSERT_TRUE(sharded->shard(1).DeleteCache(cache->cache_ids[1]).ok());
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
  EXPECT_TRUE(sharded->shard(0).ListCaches()->empty());
}

// The sharded Forward gathers into the caller's out: none, or one of another size, is refused
// naming the sizes the answer takes.
TEST_F(ShardedTest, OutputBuffersNameTheAnswersSize) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16), "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  const Step step(0, {{1, 0, 6, 6}}, v1::BFLOAT16, 51);
  const absl::Status none = sharded->Forward(*cache, step.Call(""), {}).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument) << none;
  EXPECT_NE(none.message().find(absl::StrCat("out ", step.out_bytes(), " bytes (got 0)")),
            std::string::npos)
      << none;
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
}

// A shard index out of range is refused, not read past the sinks (ShardConfig's split).
TEST_F(ShardedTest, ShardConfigRefusesAShardOutOfRange) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  v1::CacheConfig config = Config(v1::BFLOAT16);
  v1::LayerAttention* layer = config.add_layers();
  for (int h = 0; h < kQHeads; ++h) layer->add_sinks(0.5f * h);
  EXPECT_TRUE(sharded->ShardConfig(config, 1).ok());
  for (int shard : {-1, 2, 5}) {
    EXPECT_EQ(sharded->ShardConfig(config, shard).status().code(),
              absl::StatusCode::kInvalidArgument)
        << shard;
  }
}

// A tensor whose shape's product passes 64 bits is refused, not read (TensorToFloats).
TEST(TensorToFloatsTest, AShapeWhoseProductOverflowsIsRefused) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  for (int64_t d : {int64_t{1} << 62, int64_t{2}}) t.add_shape(d);
  EXPECT_EQ(TensorToFloats(t).status().code(), absl::StatusCode::kInvalidArgument);
  t.clear_shape();
  for (int64_t d : {(int64_t{1} << 62) + 1, int64_t{4}}) t.add_shape(d);
  t.set_data(std::string(16, '\0'));  // 4 floats: the product wraps to 4 in 64 bits
  EXPECT_EQ(TensorToFloats(t).status().code(), absl::StatusCode::kInvalidArgument);
  t.clear_shape();
  for (int64_t d : {2, 2}) t.add_shape(d);
  EXPECT_EQ(TensorToFloats(t)->size(), 4u);
  t.add_shape(0);
  EXPECT_EQ(TensorToFloats(t).status().code(), absl::StatusCode::kInvalidArgument);
  t.set_data("");
  EXPECT_TRUE(TensorToFloats(t)->empty());
}

// A tensor TensorToFloats cannot read is refused naming the field and the value it holds.
TEST(TensorToFloatsTest, ABadDtypeOrDimensionIsNamed) {
  v1::Tensor t;
  t.set_dtype(static_cast<v1::DType>(77));
  absl::Status s = TensorToFloats(t).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tensor.dtype must be FLOAT32, FLOAT16 or BFLOAT16 (got 77)");
  t.set_dtype(v1::FLOAT32);
  for (int64_t d : {2, -1, 4}) t.add_shape(d);
  s = TensorToFloats(t).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tensor.shape must have no negative dimension (got [2, -1, 4])");
}

// Targets gRPC would take to a channel that fails every call (empty) or to another port
// (99999 is 34463 modulo 65536), dns: URIs' too (they went to port 34463), are refused at
// Connect; other URIs and sockets pass as they are.
TEST(ClientConnectTest, TargetsAreCheckedAtConnect) {
  ClientOptions o = Options();
  for (const char* bad : {"", "127.0.0.1:99999", "localhost:-1", "dns:localhost:99999",
                          "dns:///localhost:99999", "dns://8.8.8.8/localhost:70000"}) {
    o.target = bad;
    EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  o.target = "127.0.0.1:1";
  o.max_message_bytes = 0;  // every answer would be refused
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.max_message_bytes = Options().max_message_bytes;
  for (const char* good :
       {"127.0.0.1:1", "[::1]:1", "localhost:50051", "unix:/tmp/none.sock", "dns:///localhost:1",
        "dns:localhost:1", "ipv4:127.0.0.1:1", "localhost", "dns:///localhost"}) {
    o.target = good;
    EXPECT_TRUE(Client::Connect(o).ok()) << good;
  }
}

// A Client made on a channel of the caller's checks what Connect would before each call: a
// token with a line end (gRPC aborted the process sending it) and a timeout of zero.
TEST(ClientConnectTest, AClientOnAChannelChecksItsTokenAndTimeout) {
  auto channel = grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials());
  ClientOptions o = Options();
  o.bearer_token = "a-token-read-from-a-file\n";
  Client with_line_end(channel, o);
  const absl::Status s = with_line_end.GetServerInfo().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("a line end"), std::string::npos) << s;
  o = Options();
  o.timeout = absl::ZeroDuration();
  Client no_time(channel, o);
  EXPECT_EQ(no_time.GetServerInfo().status().code(), absl::StatusCode::kInvalidArgument);
}

// A rewind of a 20-token sequence from 10 with 1500 new rows and queries (about 1.5 MiB a
// shard) over a 1 MiB message limit: refused on every shard with `why` in its message, and
// rolled back on none, since none wrote it: still 20 tokens, appending at 20 leaves no gap.
void ExpectRefusedRewindKeepsTheRows(ShardedClient& sharded, const std::string& why) {
  v1::CacheConfig config = Config(v1::BFLOAT16);
  config.set_num_pages(512);
  absl::StatusOr<ShardedCache> cache = sharded.CreateCache(config, "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto run = [&](const Step& step) {
    std::string out(step.out_bytes(), '\0'), lse(step.lse_bytes(), '\0');
    return sharded
        .Forward(*cache, step.Call(""),
                 {out.data(), out.size(), reinterpret_cast<float*>(lse.data()), lse.size()})
        .status();
  };
  ASSERT_TRUE(run(Step(0, {{1, 0, 20, 20}}, v1::BFLOAT16, 41)).ok());
  const absl::Status big = run(Step(0, {{1, 10, 1500, 1500}}, v1::BFLOAT16, 42));
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  EXPECT_NE(big.message().find(why), std::string::npos) << big;
  EXPECT_EQ(big.message().find("rewound"), std::string::npos) << big;
  EXPECT_TRUE(run(Step(0, {{1, 20, 1, 1}}, v1::BFLOAT16, 43)).ok());
  EXPECT_TRUE(sharded.DeleteCache(*cache).ok());
}

// Every shard's server refuses it (gRPC's receive limit, no details: the server's
// --max_message_mb, not this client's limit, which refuses an answer sent after the commit).
TEST_F(ShardedTest, ARewindOverTheServersMessageLimitIsNotRolledBack) {
  std::vector<std::unique_ptr<PagedAttnServer>> servers;
  std::vector<std::string> targets;
  for (int i = 0; i < 2; ++i) {
    ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.backend = BackendOptionsUnderTest(1);
    o.max_message_bytes = 1 << 20;
    servers.push_back(*PagedAttnServer::Start(o));
    targets.push_back(absl::StrCat("127.0.0.1:", servers.back()->port()));
  }
  ExpectRefusedRewindKeepsTheRows(**ShardedClient::Connect(targets, Options()),
                                  "Received message larger than max");
}

// This client's own limit refuses it before it is sent: no shard saw it.
TEST_F(ShardedTest, ARewindOverThisClientsSendLimitIsNotRolledBack) {
  ClientOptions options = Options();
  options.max_message_bytes = 1 << 20;
  ExpectRefusedRewindKeepsTheRows(**ShardedClient::Connect({Target(0), Target(1)}, options),
                                  "Sent message larger than max");
}

// max_bytes is the whole cache's budget: each shard gets its share, as many pages as one
// server holding every head would.
TEST_F(ShardedTest, MaxBytesIsSplitOverTheShards) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  std::unique_ptr<Client> ref = Reference();
  v1::CacheConfig config = Config(v1::BFLOAT16);
  config.set_max_bytes(1 << 20);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(config, "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  absl::StatusOr<v1::CacheInfo> whole = ref->CreateCache(config);
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(sharded->shard(i).GetCache(cache->cache_ids[i])->num_pages(), whole->num_pages());
  }
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
  EXPECT_TRUE(ref->DeleteCache(whole->cache_id()).ok());
  // Too small: each shard names its own part's values, and the error says they are a shard's
  // (taken for the whole cache's, the suggestion failed again).
  config.set_max_bytes(1000);
  const absl::Status small = sharded->CreateCache(config, "").status();
  EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.message().find("max_bytes: max_bytes (500 bytes)"), std::string::npos) << small;
  EXPECT_NE(small.message().find("the values are a shard's: each takes 1/2 of the cache's "
                                 "max_bytes, so the cache's are 2 times them"),
            std::string::npos)
      << small;
}

TEST(ShardedKillTest, KilledShardIsNamedAndTheOthersAreRewound) {
  std::vector<std::unique_ptr<PagedAttnServer>> servers;
  for (int i = 0; i < 2; ++i) servers.push_back(StartServer());
  std::vector<std::string> targets;
  for (const auto& s : servers) targets.push_back(absl::StrCat("127.0.0.1:", s->port()));
  ClientOptions options = Options();
  options.timeout = absl::Seconds(5);
  std::unique_ptr<ShardedClient> sharded = *ShardedClient::Connect(targets, options);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16), "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  const Step first(0, {{1, 0, 20, 20}}, v1::BFLOAT16, 21);
  std::string out(first.out_bytes(), '\0');
  std::string lse(first.lse_bytes(), '\0');
  ForwardOutput o{out.data(), out.size(), reinterpret_cast<float*>(lse.data()), lse.size()};
  ASSERT_TRUE(sharded->Forward(*cache, first.Call(""), o).ok());
  const v1::CacheStats before = sharded->shard(0).GetCache(cache->cache_ids[0])->stats();

  servers[1]->Shutdown(absl::ZeroDuration());
  servers[1].reset();
  const Step next(0, {{1, 20, 1, 1}, {2, 0, 9, 9}}, v1::BFLOAT16, 22);
  std::string out2(next.out_bytes(), '\0');
  std::string lse2(next.lse_bytes(), '\0');
  absl::StatusOr<ForwardReply> r = sharded->Forward(
      *cache, next.Call(""),
      {out2.data(), out2.size(), reinterpret_cast<float*>(lse2.data()), lse2.size()});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("shard 1 (" + targets[1] + ")"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("could not rewind shard 1"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("shard 0 rewound to the call's span starts"),
            std::string::npos)
      << r.status();
  const v1::CacheStats now = sharded->shard(0).GetCache(cache->cache_ids[0])->stats();
  EXPECT_EQ(now.used_pages(), before.used_pages());
  EXPECT_EQ(now.live_sequences(), before.live_sequences());
  // Shard 0 still ends sequence 1 at 20 tokens: a write at 21 is a gap there.
  const Step gap(0, {{1, 21, 1, 1}}, v1::BFLOAT16, 23, kQHeads / 2, kKvHeads / 2);
  std::string out3(gap.out_bytes(), '\0');
  std::string lse3(gap.lse_bytes(), '\0');
  EXPECT_EQ(sharded->shard(0)
                .ForwardTensors(
                    gap.Call(cache->cache_ids[0]),
                    {out3.data(), out3.size(), reinterpret_cast<float*>(lse3.data()), lse3.size()})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // A delete with shard 1 gone deletes shard 0's cache and names shard 1 (a second try then
  // counts shard 0's NOT_FOUND as done).
  const absl::Status deleted = sharded->DeleteCache(*cache);
  EXPECT_EQ(deleted.code(), absl::StatusCode::kUnavailable) << deleted;
  EXPECT_NE(deleted.message().find("shard 1 (" + targets[1] + ")"), std::string::npos) << deleted;
  EXPECT_EQ(sharded->shard(0).GetCache(cache->cache_ids[0]).status().code(),
            absl::StatusCode::kNotFound);
}

// A RequestId in force on the calling thread reaches every shard's server, though each shard
// past the first is called from a thread of its own: validation, creation, Forward, the rewind
// of a failed Forward, ReleaseSequences and DeleteCache. Calls outside it carry none.
TEST_F(ShardedTest, EveryShardsCallsCarryTheRequestId) {
  testing::LogCapture captured(spdlog::level::debug);
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  absl::StatusOr<ShardedCache> cache;
  {
    RequestId id("sharded-7");
    // Shard 1 holds 10 pages (70 tokens): the second Forward fails there and is rewound.
    cache = sharded->CreateCache(Config(v1::BFLOAT16), "", {64, 10});
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE(Run(*sharded, *cache, Step(0, {{1, 0, 40, 40}}, v1::BFLOAT16, 21)).ok());
    EXPECT_EQ(Run(*sharded, *cache, Step(0, {{2, 0, 40, 40}}, v1::BFLOAT16, 22)).status().code(),
              absl::StatusCode::kResourceExhausted);
  }
  ASSERT_TRUE(sharded->ReleaseSequences(*cache, {1}).ok());
  {
    RequestId id("sharded-8");
    ASSERT_TRUE(sharded->DeleteCache(*cache).ok());
  }

  const std::string log = captured.str();
  auto lines_with = [&](const std::string& needle) {
    std::vector<std::string> found;
    for (absl::string_view line : absl::StrSplit(log, '\n')) {
      if (absl::StrContains(line, needle)) found.emplace_back(line);
    }
    return found;
  };
  // Validation names no cache: one line from each shard's server.
  const std::vector<std::string> validated = lines_with("rpc ValidateCacheConfig ");
  EXPECT_EQ(validated.size(), 2u) << log;
  for (const std::string& line : validated) {
    EXPECT_TRUE(absl::StrContains(line, " req=sharded-7 ")) << line;
  }
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(absl::StrCat("shard ", i));
    const std::string cache_id = cache->cache_ids[i];
    struct Want {
      std::string needle, id;  // id empty: none
    };
    // Shard 1's refusal is a throttled line (perhaps held back): its first Forward's line is
    // enough.
    for (const Want& want : {Want{"rpc CreateCache cache=" + cache_id, "sharded-7"},
                             Want{"rpc Forward cache=" + cache_id, "sharded-7"},
                             Want{"rpc TruncateSequences cache=" + cache_id, "sharded-7"},
                             Want{"rpc ReleaseSequences cache=" + cache_id, ""},
                             Want{"rpc DeleteCache cache=" + cache_id, "sharded-8"}}) {
      const std::vector<std::string> lines = lines_with(want.needle);
      EXPECT_FALSE(lines.empty()) << want.needle << " in:\n" << log;
      for (const std::string& line : lines) {
        if (want.id.empty()) {
          EXPECT_FALSE(absl::StrContains(line, "req=")) << line;
        } else {
          EXPECT_TRUE(absl::StrContains(line, absl::StrCat(" req=", want.id, " "))) << line;
        }
      }
    }
  }
}

// The same server given twice would hold two shards' heads in two caches of one server.
// Shard caches are named "<name> [shard i/N]" (the Python client's form), the name cut so that
// a name the server takes unsharded is taken sharded too.
TEST_F(ShardedTest, ShardCachesAreNamedForTheirPart) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  const std::string longest(128, 'n');
  for (const std::string& name : {std::string("llama"), std::string(), longest}) {
    absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16), name);
    ASSERT_TRUE(cache.ok()) << cache.status();
    for (int i = 0; i < 2; ++i) {
      const std::string got = sharded->shard(i).GetCache(cache->cache_ids[i])->name();
      const std::string suffix = absl::StrCat("[shard ", i, "/2]");
      EXPECT_TRUE(absl::EndsWith(got, suffix)) << got;
      EXPECT_LE(got.size(), 128u);
      if (name == "llama") {
        EXPECT_EQ(got, "llama " + suffix);
      } else if (name.empty()) {
        EXPECT_EQ(got, suffix);
      }
    }
    EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
  }
}

// A sharded cache goes with the targets it was made through: a client of the same servers in
// another order refuses it (shard 0's id would go to shard 1's server, whose NOT_FOUND a delete
// took as "deleted already": it returned OK and left every part). A count of pages a shard must
// give one a shard.
TEST_F(ShardedTest, ACacheGoesWithItsTargetsInOrder) {
  std::unique_ptr<ShardedClient> sharded = Sharded(2);
  absl::StatusOr<ShardedCache> cache = sharded->CreateCache(Config(v1::BFLOAT16), "");
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->targets, (std::vector<std::string>{Target(0), Target(1)}));
  std::unique_ptr<ShardedClient> swapped =
      *ShardedClient::Connect({Target(1), Target(0)}, Options());
  const absl::Status deleted = swapped->DeleteCache(*cache);
  EXPECT_EQ(deleted.code(), absl::StatusCode::kFailedPrecondition) << deleted;
  EXPECT_NE(deleted.message().find("made through the targets"), std::string::npos) << deleted;
  EXPECT_EQ(Run(*swapped, *cache, Step(0, {{1, 0, 4, 4}}, v1::BFLOAT16, 61)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(swapped->ReleaseSequences(*cache, {1}).code(), absl::StatusCode::kFailedPrecondition);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(sharded->shard(i).GetCache(cache->cache_ids[i]).ok());
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());
  EXPECT_TRUE(sharded->DeleteCache(*cache).ok());  // a retry completes
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(sharded->shard(i).GetCache(cache->cache_ids[i]).status().code(),
              absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(sharded->CreateCache(Config(v1::BFLOAT16), "", {8}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShardTargetsTest, TheSameTargetTwiceIsRefused) {
  absl::StatusOr<std::unique_ptr<ShardedClient>> twice =
      ShardedClient::Connect({"127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50051"}, Options());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("shard targets 0 and 2 are the same (127.0.0.1:50051)"),
            std::string::npos)
      << twice.status();
}

TEST(ShardTargetsTest, StatefulSetNamesAndResolvedAddresses) {
  EXPECT_EQ(StatefulSetTargets("pagedattn", "pagedattn-headless.ml.svc", 2, 50051),
            (std::vector<std::string>{"pagedattn-0.pagedattn-headless.ml.svc:50051",
                                      "pagedattn-1.pagedattn-headless.ml.svc:50051"}));
  absl::StatusOr<std::vector<std::string>> r = ResolveShardTargets("127.0.0.1", 7);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, std::vector<std::string>{"127.0.0.1:7"});
  EXPECT_FALSE(ResolveShardTargets("no-such-host.invalid", 7).ok());
}

}  // namespace
}  // namespace pagedattn
