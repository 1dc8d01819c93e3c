// Random cache configs, in the capability table and out of it, and random scripts of Forwards on
// each config a server accepts: the promise that a config CreateCache accepts never fails a
// Forward for a configuration reason, checked over the table rather than over chosen cases: on
// unary Forwards, on Step streams (a model's steps, every layer of each, the answers bit for bit
// the unary ones') and on caches split over servers by ShardedClient (one server's answers). A
// config's line names the seed that rebuilds it (PAGEDATTN_FUZZ_SEED, PAGEDATTN_FUZZ_CONFIGS
// widen a run; Serve names the CUDA server's options); GPU cases skip without one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/sharded.h"
#include "common/reference.h"
#include "server/core/backend_factory.h"
#include "server/service/server.h"
#include "tests/service/random_script.h"

namespace pagedattn {
namespace {

using random_script::AnswerBytes;
using random_script::CallOf;
using random_script::Choose;
using random_script::Describe;
using random_script::EnvInt;
using random_script::Percent;
using random_script::RandomConfig;
using random_script::ScriptLimits;
using random_script::ScriptWriter;
using random_script::SpansOf;

// How far two backends' LSEs may be apart: 0.01 where the scores have unit spread (the default
// sm_scale on unit q and K), growing with it (sm_scale * sqrt(head_dim) on this data). An FP8
// cache twice that: its prefill tiles take K and V times their scales in bfloat16 (2^-9
// relative; tests/fp8_sweep.h), which the CPU backend keeps in float. Over 2000 configs on an
// H100, LSEs were up to 0.043 apart (FP8, head_dim 512, a custom sm_scale).
double LseTolerance(const v1::CacheConfig& config, const v1::ForwardRequest& req) {
  const double d = config.head_dim();
  const double scale = req.options().has_sm_scale() ? req.options().sm_scale() : 1 / std::sqrt(d);
  const double spread = std::max(1.0, scale * std::sqrt(d));
  return (config.kv_dtype() == v1::FLOAT8_E4M3 ? 2e-2 : 1e-2) * spread;
}

struct Served {
  std::unique_ptr<PagedAttnServer> server;
  std::unique_ptr<Client> client;
};

// PAGEDATTN_PREFILL_KERNEL=portable: the CUDA server's prefill on the portable kernel (the
// server's --prefill_kernel=portable); PAGEDATTN_FUZZ_PLAIN_LAUNCH=1: its kernels launched
// plainly, not through graphs (--graph_launch=false --forward_graph=false).
Served Serve(BackendChoice backend) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend.backend = backend;
  if (const char* k = std::getenv("PAGEDATTN_PREFILL_KERNEL"); k && std::string(k) == "portable") {
    o.backend.prefill_kernel = PrefillKernel::kPortable;
  }
  if (EnvInt("PAGEDATTN_FUZZ_PLAIN_LAUNCH", 0) != 0) {
    o.backend.graph_launch = false;
    o.backend.forward_graph = false;
  }
  Served s;
  absl::StatusOr<std::unique_ptr<PagedAttnServer>> server = PagedAttnServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = *std::move(server);
  ClientOptions c;
  c.target = absl::StrCat("127.0.0.1:", s.server->port());
  s.client = *Client::Connect(c);
  return s;
}

// What the servers did with one random config: every server's CreateCache must agree with its
// own ValidateCacheConfig, a refusal is INVALID_ARGUMENT, and every Forward of the script on a
// server that accepted it is answered, finite; with a second server, alike within tolerance.
struct FuzzTally {
  int accepted = 0, refused = 0, forwards = 0;
  // Against the first server's answers: out's relative error, LSEs apart (16-bit caches, FP8).
  double worst_out = 0, worst_lse = 0, worst_fp8_lse = 0;
  std::map<std::string, int> refused_fields;
};

void RunConfig(const std::vector<Served*>& servers, const v1::CacheConfig& config,
               const ScriptLimits& limits, uint32_t seed, FuzzTally& tally) {
  const std::string what = absl::StrCat("seed ", seed, ": ", Describe(config));
  std::vector<std::string> caches;
  for (size_t i = 0; i < servers.size(); ++i) {
    Client& client = *servers[i]->client;
    absl::StatusOr<v1::ValidateCacheConfigResponse> dry = client.ValidateCacheConfig(config);
    ASSERT_TRUE(dry.ok()) << what << ": " << dry.status();
    if (dry->valid()) {
      // A byte budget of what the dry run says num_pages take buys num_pages again.
      v1::CacheConfig budget = config;
      budget.set_max_bytes(dry->bytes());
      absl::StatusOr<v1::ValidateCacheConfigResponse> b = client.ValidateCacheConfig(budget);
      ASSERT_TRUE(b.ok()) << what << ": " << b.status();
      EXPECT_TRUE(b->valid()) << what;
      EXPECT_EQ(b->num_pages(), dry->num_pages()) << what << ": max_bytes " << dry->bytes();
      EXPECT_EQ(b->bytes(), dry->bytes()) << what;
    }
    absl::StatusOr<v1::CacheInfo> info = client.CreateCache(config);
    // The dry run's verdict is CreateCache's (the pools here are small: they always fit).
    ASSERT_EQ(dry->valid(), info.ok())
        << what << ": " << (info.ok() ? "" : info.status().ToString());
    if (!info.ok()) {
      EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument) << what;
      EXPECT_FALSE(dry->violations().empty()) << what;
      if (i == 0) {
        for (const v1::ConfigViolation& v : dry->violations()) ++tally.refused_fields[v.field()];
      }
    }
    caches.push_back(info.ok() ? info->cache_id() : "");
  }
  // The CPU server (the first) is the reference and implements every option: a config another
  // backend accepts, it accepts too; only FLOAT32 caches are the CPU's alone.
  const bool reference_accepts = !caches[0].empty();
  for (size_t i = 1; i < caches.size(); ++i) {
    if (config.kv_dtype() == v1::FLOAT32) {
      EXPECT_TRUE(caches[i].empty()) << what << ": FLOAT32 caches are the CPU backend's alone";
    } else {
      EXPECT_EQ(!caches[i].empty(), reference_accepts) << what;
    }
  }
  std::printf("%s %s\n", reference_accepts ? "accepted" : "refused ", what.c_str());
  if (!reference_accepts) {
    ++tally.refused;
    return;
  }
  ++tally.accepted;
  std::mt19937 rng(seed ^ 0x9e3779b9u);
  ScriptWriter script(config, limits, rng);
  for (int step = 0; step < limits.steps; ++step) {
    if (step > 0 && Percent(rng, 15)) {  // a finished sequence's pages back to the pool
      const uint64_t seq = static_cast<uint64_t>(script.RandomSequence());
      for (size_t i = 0; i < servers.size(); ++i) {
        if (caches[i].empty()) continue;
        absl::StatusOr<v1::ReleaseSequencesResponse> r =
            servers[i]->client->ReleaseSequences(caches[i], {seq});
        ASSERT_TRUE(r.ok()) << "server " << i << ", " << what << ": release " << seq << ": "
                            << r.status();
      }
      script.Release(static_cast<int>(seq));
    }
    v1::ForwardRequest req = script.Next();
    const std::string at = absl::StrCat(what, "; step ", step, " ", SpansOf(req));
    std::vector<std::vector<float>> outs, lses;
    for (size_t i = 0; i < servers.size(); ++i) {
      if (caches[i].empty()) continue;
      req.set_cache_id(caches[i]);
      absl::StatusOr<v1::ForwardResponse> r = servers[i]->client->Forward(req);
      ASSERT_TRUE(r.ok()) << "server " << i << ", " << at << ": " << r.status();
      ++tally.forwards;
      absl::StatusOr<std::vector<float>> out = TensorToFloats(r->out());
      ASSERT_TRUE(out.ok()) << at << ": " << out.status();
      for (float x : *out) ASSERT_TRUE(std::isfinite(x)) << "server " << i << ", " << at;
      outs.push_back(*std::move(out));
      lses.push_back(req.options().return_lse() ? *TensorToFloats(r->lse()) : std::vector<float>{});
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      ASSERT_EQ(outs[i].size(), outs[0].size()) << at;
      std::vector<double> ref(outs[0].begin(), outs[0].end()), got(outs[i].begin(), outs[i].end());
      const double err =
          testing::RelativeError(got.data(), ref.data(), static_cast<int64_t>(ref.size()));
      EXPECT_LE(err, 1e-2) << "server " << i << ", " << at;
      tally.worst_out = std::max(tally.worst_out, err);
      ASSERT_EQ(lses[i].size(), lses[0].size()) << at;
      double lse_diff = 0;
      for (size_t j = 0; j < lses[0].size(); ++j) {
        lse_diff = std::max(lse_diff, double{std::abs(lses[i][j] - lses[0][j])});
      }
      EXPECT_LE(lse_diff, LseTolerance(config, req)) << "server " << i << ", " << at;
      double& worst = config.kv_dtype() == v1::FLOAT8_E4M3 ? tally.worst_fp8_lse : tally.worst_lse;
      worst = std::max(worst, lse_diff);
    }
  }
  for (size_t i = 0; i < servers.size(); ++i) {
    if (caches[i].empty()) continue;
    absl::StatusOr<v1::CacheInfo> info = servers[i]->client->GetCache(caches[i]);
    ASSERT_TRUE(info.ok()) << what << ": " << info.status();
    EXPECT_EQ(info->stats().used_pages(), script.PagesHeld()) << "server " << i << ", " << what;
    EXPECT_EQ(info->stats().forward_calls(), limits.steps) << "server " << i << ", " << what;
    EXPECT_TRUE(servers[i]->client->DeleteCache(caches[i]).ok()) << what;
  }
}

// The script as steps (every layer of each, in order), random sequences released between some,
// through unary Forwards on one cache and one Step stream on another of the same server. The
// steps between two releases go on the stream at once, so the server runs layers of one step and
// of the next together (kStepMessagesAhead; one layer's messages in order). Every answer must
// be the unary one's, bit for bit, and both caches must hold the script's pages at the end.
void RunStepsOn(Served& server, const v1::CacheConfig& config, const ScriptLimits& limits,
                uint32_t seed, FuzzTally& tally) {
  const std::string what = absl::StrCat("seed ", seed, ": ", Describe(config));
  Client& client = *server.client;
  absl::StatusOr<v1::CacheInfo> unary_cache = client.CreateCache(config);
  std::printf("%s %s\n", unary_cache.ok() ? "accepted" : "refused ", what.c_str());
  if (!unary_cache.ok()) {
    EXPECT_EQ(unary_cache.status().code(), absl::StatusCode::kInvalidArgument) << what;
    absl::StatusOr<v1::ValidateCacheConfigResponse> dry = client.ValidateCacheConfig(config);
    ASSERT_TRUE(dry.ok()) << what << ": " << dry.status();
    EXPECT_FALSE(dry->valid()) << what;
    for (const v1::ConfigViolation& v : dry->violations()) ++tally.refused_fields[v.field()];
    ++tally.refused;
    return;
  }
  ++tally.accepted;
  absl::StatusOr<v1::CacheInfo> step_cache = client.CreateCache(config);
  ASSERT_TRUE(step_cache.ok()) << what << ": " << step_cache.status();
  const std::string unary_id = unary_cache->cache_id(), step_id = step_cache->cache_id();

  // The script: a release (seq > 0) or a step's Forwards.
  struct Event {
    uint64_t release = 0;
    std::vector<v1::ForwardRequest> step;
  };
  std::mt19937 rng(seed ^ 0x9e3779b9u);
  ScriptWriter script(config, limits, rng);
  std::vector<Event> events;
  int messages = 0;
  for (int n = 0; n < limits.steps; ++n) {
    if (n > 0 && Percent(rng, 15)) {
      const int seq = script.RandomSequence();
      events.push_back({static_cast<uint64_t>(seq), {}});
      script.Release(seq);
    }
    events.push_back({0, script.NextStep()});
    messages += static_cast<int>(events.back().step.size());
  }
  auto release = [&](const std::string& cache, uint64_t seq) {
    absl::StatusOr<v1::ReleaseSequencesResponse> r = client.ReleaseSequences(cache, {seq});
    EXPECT_TRUE(r.ok()) << what << ": release " << seq << ": " << r.status();
  };

  std::vector<AnswerBytes> unary;
  for (Event& e : events) {
    if (e.release > 0) release(unary_id, e.release);
    for (v1::ForwardRequest& req : e.step) {
      req.set_cache_id(unary_id);
      absl::StatusOr<v1::ForwardResponse> r = client.Forward(req);
      ASSERT_TRUE(r.ok()) << what << "; unary " << SpansOf(req) << ": " << r.status();
      unary.push_back({r->out().data(), r->lse().data()});
    }
  }

  absl::StatusOr<std::unique_ptr<StepStream>> stream = client.OpenStep();
  ASSERT_TRUE(stream.ok()) << what << ": " << stream.status();
  std::vector<const v1::ForwardRequest*> batch;  // sent at once
  size_t answered = 0;
  auto run_batch = [&] {
    std::thread sender([&] {
      for (const v1::ForwardRequest* req : batch) {
        const absl::Status s = (*stream)->Send(CallOf(*req, step_id, req->layer() == 0));
        EXPECT_TRUE(s.ok()) << what << ": send: " << s;
        if (!s.ok()) return;
      }
    });
    for (const v1::ForwardRequest* req : batch) {
      const std::string at = absl::StrCat(what, "; Forward ", answered, " ", SpansOf(*req));
      const AnswerBytes& want = unary[answered++];
      AnswerBytes got = AnswerBytes::For(*req);
      absl::StatusOr<ForwardReply> r = (*stream)->Receive(got.Output());
      EXPECT_TRUE(r.ok()) << at << ": " << r.status();
      if (!r.ok()) break;
      ++tally.forwards;
      EXPECT_EQ(r->layer, req->layer()) << at;
      EXPECT_EQ(r->out_dtype, req->q().dtype()) << at;
      EXPECT_EQ(got.out.size(), want.out.size()) << at;
      EXPECT_TRUE(got.out == want.out) << at << ": out differs from unary Forward's";
      EXPECT_TRUE(got.lse == want.lse) << at << ": lse differs from unary Forward's";
    }
    sender.join();
    batch.clear();
  };
  for (const Event& e : events) {
    if (e.release > 0) {
      run_batch();
      release(step_id, e.release);
    }
    for (const v1::ForwardRequest& req : e.step) batch.push_back(&req);
  }
  run_batch();
  EXPECT_TRUE((*stream)->Close().ok()) << what;
  EXPECT_EQ(answered, unary.size()) << what;

  for (const std::string& cache : {unary_id, step_id}) {
    absl::StatusOr<v1::CacheInfo> info = client.GetCache(cache);
    ASSERT_TRUE(info.ok()) << what << ": " << info.status();
    EXPECT_EQ(info->stats().used_pages(), script.PagesHeld()) << what;
    EXPECT_EQ(info->stats().forward_calls(), messages) << what;
    EXPECT_TRUE(client.DeleteCache(cache).ok()) << what;
  }
}

// The config split by kv head over 2-4 servers (ShardedClient), against one server: where the
// one server accepts it and the shard count divides its kv heads, the sharded cache is accepted
// (a byte budget buys each shard the whole's pages); elsewhere it is refused, INVALID_ARGUMENT.
// The script's Forwards on both must give the same answers, bit for bit (servers[0] the one
// server, servers[1..4] the shards; the CPU backend, whose heads are computed apart).
void RunSharded(const std::vector<Served*>& servers, const v1::CacheConfig& whole_config,
                const ScriptLimits& limits, uint32_t seed, FuzzTally& tally) {
  std::mt19937 rng(seed ^ 0x5bd1e995u);
  // Mostly a shard count that divides the kv heads; a fifth any of 2-4.
  std::vector<int> divisors;
  for (int d = 2; d <= 4; ++d) {
    if (whole_config.num_kv_heads() % d == 0) divisors.push_back(d);
  }
  const int n = divisors.empty() || Percent(rng, 20) ? Choose(rng, {2, 3, 4})
                                                     : divisors[rng() % divisors.size()];
  std::vector<std::string> targets;
  for (int i = 1; i <= n; ++i)
    targets.push_back(absl::StrCat("127.0.0.1:", servers[i]->server->port()));
  absl::StatusOr<std::unique_ptr<ShardedClient>> sharded = ShardedClient::Connect(targets, {});
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  Client& one = *servers[0]->client;
  v1::CacheConfig config = whole_config;
  const std::string what = absl::StrCat("seed ", seed, ": ", n, " shards of ", Describe(config));
  absl::StatusOr<v1::ValidateCacheConfigResponse> dry = one.ValidateCacheConfig(config);
  ASSERT_TRUE(dry.ok()) << what << ": " << dry.status();
  if (dry->valid() && Percent(rng, 30)) config.set_max_bytes(dry->bytes());  // the same pages
  absl::StatusOr<v1::CacheInfo> one_cache = one.CreateCache(config);
  absl::StatusOr<ShardedCache> cache = (*sharded)->CreateCache(config, "fuzz");
  const bool divides = config.num_kv_heads() % n == 0;
  std::printf("%s %s\n", cache.ok() ? "accepted" : "refused ", what.c_str());
  EXPECT_EQ(cache.ok(), one_cache.ok() && divides)
      << what << ": one server " << one_cache.status() << "; sharded " << cache.status();
  if (!cache.ok()) {
    EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument) << what;
    if (!divides) {
      EXPECT_TRUE(absl::StrContains(cache.status().message(), "num_kv_heads")) << cache.status();
    }
    ++tally.refused;
    ++tally.refused_fields[divides ? "(one server's)" : "num_kv_heads % shards"];
    if (one_cache.ok()) {
      EXPECT_TRUE(one.DeleteCache(one_cache->cache_id()).ok());
    }
    return;
  }
  ++tally.accepted;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<v1::CacheInfo> part = (*sharded)->shard(i).GetCache(cache->cache_ids[i]);
    ASSERT_TRUE(part.ok()) << what << ": " << part.status();
    EXPECT_EQ(part->num_pages(), one_cache->num_pages()) << what << ": shard " << i;
  }

  std::mt19937 script_rng(seed ^ 0x9e3779b9u);
  ScriptWriter script(config, limits, script_rng);
  for (int step = 0; step < limits.steps; ++step) {
    if (step > 0 && Percent(script_rng, 15)) {
      const int seq = script.RandomSequence();
      EXPECT_TRUE(one.ReleaseSequences(one_cache->cache_id(), {static_cast<uint64_t>(seq)}).ok());
      const absl::Status released =
          (*sharded)->ReleaseSequences(*cache, {static_cast<uint64_t>(seq)});
      EXPECT_TRUE(released.ok()) << what << ": release " << seq << ": " << released;
      script.Release(seq);
    }
    v1::ForwardRequest req = script.Next();
    const std::string at = absl::StrCat(what, "; step ", step, " ", SpansOf(req));
    req.set_cache_id(one_cache->cache_id());
    absl::StatusOr<v1::ForwardResponse> want = one.Forward(req);
    ASSERT_TRUE(want.ok()) << at << ": one server: " << want.status();
    AnswerBytes got = AnswerBytes::For(req);
    absl::StatusOr<ForwardReply> r = (*sharded)->Forward(*cache, CallOf(req, ""), got.Output());
    ASSERT_TRUE(r.ok()) << at << ": sharded: " << r.status();
    ++tally.forwards;
    EXPECT_TRUE(got.out == want->out().data()) << at << ": out differs from one server's";
    EXPECT_TRUE(got.lse == want->lse().data()) << at << ": lse differs from one server's";
  }
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<v1::CacheInfo> part = (*sharded)->shard(i).GetCache(cache->cache_ids[i]);
    ASSERT_TRUE(part.ok()) << what << ": " << part.status();
    EXPECT_EQ(part->stats().used_pages(), script.PagesHeld()) << what << ": shard " << i;
  }
  EXPECT_TRUE((*sharded)->DeleteCache(*cache).ok()) << what;
  EXPECT_TRUE(one.DeleteCache(one_cache->cache_id()).ok()) << what;
}

// RunStepsOn on each server in turn (each against its own unary answers).
void RunSteps(const std::vector<Served*>& servers, const v1::CacheConfig& config,
              const ScriptLimits& limits, uint32_t seed, FuzzTally& tally) {
  for (Served* served : servers) RunStepsOn(*served, config, limits, seed, tally);
}

using ConfigRun = void (*)(const std::vector<Served*>&, const v1::CacheConfig&, const ScriptLimits&,
                           uint32_t, FuzzTally&);

// `run` over random configs (RunConfig or RunSteps), their count and seeds from the environment.
void RunFuzz(ConfigRun run, const std::vector<Served*>& servers, int default_configs,
             const ScriptLimits& limits) {
  const uint32_t base = static_cast<uint32_t>(EnvInt("PAGEDATTN_FUZZ_SEED", 20261206));
  const int configs = EnvInt("PAGEDATTN_FUZZ_CONFIGS", default_configs);
  FuzzTally tally;
  for (int n = 0; n < configs && !::testing::Test::HasFatalFailure(); ++n) {
    const uint32_t seed = base + static_cast<uint32_t>(n);
    std::mt19937 rng(seed);
    run(servers, RandomConfig(rng, limits), limits, seed, tally);
  }
  std::string fields;
  for (const auto& [field, count] : tally.refused_fields)
    absl::StrAppend(&fields, " ", field, "=", count);
  std::printf("%d configs accepted (%d Forwards), %d refused:%s\n", tally.accepted, tally.forwards,
              tally.refused, fields.c_str());
  if (run == &RunConfig && servers.size() > 1) {
    std::printf(
        "against the CPU: out's relative error at most %.3g, LSE at most %.3g apart (FP8 %.3g)\n",
        tally.worst_out, tally.worst_lse, tally.worst_fp8_lse);
  }
  // The generator keeps most configs in the table: a run that accepts none tests nothing.
  EXPECT_GT(tally.accepted, configs / 2);
}

// The scripts of the CPU-only runs, which CI runs: shorter, so that a config takes milliseconds.
constexpr ScriptLimits kCpuLimits = {.max_len = 600, .max_new = 200, .max_step_queries = 64};

// Every config the CPU backend accepts runs its script: each Forward answered, every value finite.
TEST(ConfigFuzzTest, EveryAcceptedConfigRunsItsForwardsOnTheCpu) {
  Served cpu = Serve(BackendChoice::kCpu);
  ASSERT_TRUE(cpu.client);
  RunFuzz(RunConfig, {&cpu}, 12, kCpuLimits);
}

// The Step stream over random configs on the CPU: every layer of each step, the steps between
// releases sent at once, answered as unary Forwards answer them, bit for bit.
TEST(ConfigFuzzTest, StepStreamsAnswerAsUnaryForwardsOnTheCpu) {
  Served cpu = Serve(BackendChoice::kCpu);
  ASSERT_TRUE(cpu.client);
  RunFuzz(RunSteps, {&cpu}, 12, kCpuLimits);
}

// Why the CUDA tests cannot run here, or "" where they can.
std::string NoCuda() {
  if (!BuiltWithCuda()) return "built without CUDA (no nvcc at build time)";
  absl::StatusOr<CreatedBackend> cuda = CreateBackend({.backend = BackendChoice::kCuda});
  return cuda.ok() ? "" : absl::StrCat("no CUDA GPU visible: ", cuda.status().ToString());
}

// A CUDA server beside the CPU server: it accepts the same configs (FLOAT32 caches aside), answers
// every Forward of each script, and agrees with the CPU's answers.
TEST(ConfigFuzzTest, CudaAcceptsAndAnswersAsTheCpu) {
  if (const std::string why = NoCuda(); !why.empty()) GTEST_SKIP() << why;
  Served cpu = Serve(BackendChoice::kCpu), cuda = Serve(BackendChoice::kCuda);
  ASSERT_TRUE(cpu.client && cuda.client);
  RunFuzz(RunConfig, {&cpu, &cuda}, 48, ScriptLimits{});
}

// Random configs split by kv head over 2-4 CPU servers, against one server: accepted where it is
// and the shards divide the kv heads, answered bit for bit as one server answers.
TEST(ConfigFuzzTest, ShardedCachesAnswerAsOneServer) {
  std::vector<Served> served;
  for (int i = 0; i < 5; ++i) served.push_back(Serve(BackendChoice::kCpu));
  std::vector<Served*> servers;
  for (Served& s : served) {
    ASSERT_TRUE(s.client);
    servers.push_back(&s);
  }
  RunFuzz(RunSharded, servers, 12, kCpuLimits);
}

// The same on a CUDA server, whose concurrent Forwards (a Step stream's layers) each run on a
// stream and workspace of their own.
TEST(ConfigFuzzTest, StepStreamsAnswerAsUnaryForwardsOnCuda) {
  if (const std::string why = NoCuda(); !why.empty()) GTEST_SKIP() << why;
  Served cuda = Serve(BackendChoice::kCuda);
  ASSERT_TRUE(cuda.client);
  RunFuzz(RunSteps, {&cuda}, 48, ScriptLimits{});
}

}  // namespace
}  // namespace pagedattn
