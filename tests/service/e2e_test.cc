// End to end: a real server on a free loopback port, driven by the project's client.
// Every RPC, every error code, rich error details, malformed tensors, atomic failure,
// health, and graceful shutdown.
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>

#include "client/client.h"
#include "client/smoke.h"
#include "common/dtype.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/core/cache_config.h"
#include "server/service/server.h"
#include "server/service/status.h"
#include "tests/service/backend_under_test.h"
#include "tests/test_util.h"

namespace pagedattn {
namespace {

using testing::BackendOptionsUnderTest;
using testing::BackendUnderTest;
using testing::OnCpu;

// FLOAT32 caches exist on the CPU backend only.
v1::DType CacheDType() { return OnCpu() ? v1::FLOAT32 : v1::FLOAT16; }

class E2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.backend = BackendOptionsUnderTest(2);
    absl::StatusOr<std::unique_ptr<PagedAttnServer>> s = PagedAttnServer::Start(options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", server_->port());
    client_ = *Client::Connect(o);
  }

  static v1::CacheConfig SmallConfig() {
    v1::CacheConfig c;
    c.set_num_layers(2);
    c.set_num_q_heads(4);
    c.set_num_kv_heads(2);
    c.set_head_dim(64);
    c.set_page_size(4);
    c.set_kv_dtype(CacheDType());
    c.set_num_pages(8);
    return c;
  }

  // The issue's invalid config: page_size 0, head_dim 100, 32 q heads over 5 kv heads, no dtype.
  static v1::CacheConfig IssueExampleConfig() {
    v1::CacheConfig c = SmallConfig();
    c.set_page_size(0);
    c.set_head_dim(100);
    c.set_num_q_heads(32);
    c.set_num_kv_heads(5);
    c.set_kv_dtype(v1::DTYPE_UNSPECIFIED);
    return c;
  }

  // A prefill (or continuation) of one sequence with deterministic random data.
  static v1::ForwardRequest Request(const std::string& cache, uint64_t seq, int64_t start, int n,
                                    uint64_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    auto values = [&](size_t count) {
      std::vector<float> v(count);
      for (float& x : v) x = d(rng);
      return v;
    };
    v1::ForwardRequest r;
    r.set_cache_id(cache);
    v1::Span* s = r.add_spans();
    s->set_seq_id(seq);
    s->set_start(start);
    s->set_num_new_tokens(n);
    s->set_num_queries(n);
    *r.mutable_q() = MakeTensor(v1::FLOAT32, {n, 4, 64}, values(n * 4 * 64));
    *r.mutable_k() = MakeTensor(v1::FLOAT32, {n, 2, 64}, values(n * 2 * 64));
    *r.mutable_v() = MakeTensor(v1::FLOAT32, {n, 2, 64}, values(n * 2 * 64));
    return r;
  }

  static PagedAttnServer* server_;
  std::unique_ptr<Client> client_;
};
PagedAttnServer* E2ETest::server_ = nullptr;

TEST_F(E2ETest, ServerInfoHasCapabilityTable) {
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), BackendUnderTest());
  EXPECT_FALSE(info->version().empty());
  EXPECT_GT(info->device_memory_bytes(), 0);
  EXPECT_EQ(std::vector<int>(info->capabilities().head_dims().begin(),
                             info->capabilities().head_dims().end()),
            (std::vector<int>{64, 80, 96, 128, 192, 256, 512}));
  EXPECT_EQ(info->capabilities().min_page_size(), 1);
  EXPECT_EQ(info->capabilities().max_page_size(), 1024);
  // f32 caches on the CPU only, FP8 on both; FP8 is never a tensor's dtype.
  EXPECT_EQ(info->capabilities().kv_dtypes_size(), OnCpu() ? 4 : 3);
  EXPECT_EQ(info->capabilities().io_dtypes_size(), 3);
}

TEST_F(E2ETest, HealthIsServing) {
  absl::StatusOr<bool> serving = client_->CheckHealth();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);
}

TEST_F(E2ETest, ValidateReportsEveryViolationAndAllocatesNothing) {
  const v1::CacheConfig c = IssueExampleConfig();
  absl::StatusOr<v1::ValidateCacheConfigResponse> r = client_->ValidateCacheConfig(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->valid());
  ASSERT_EQ(r->violations_size(), 4);
  absl::StatusOr<v1::ValidateCacheConfigResponse> ok = client_->ValidateCacheConfig(SmallConfig());
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->valid());
  EXPECT_EQ(ok->num_pages(), 8);
  EXPECT_EQ(ok->bytes(), 8 * 2 * 2 * 2 * 4 * 64 * (OnCpu() ? 4 : 2));
  EXPECT_TRUE(client_->ListCaches()->empty());
}

TEST_F(E2ETest, CreateCacheInvalidCarriesBadRequestDetails) {
  const v1::CacheConfig c = IssueExampleConfig();
  // The raw stub, to see the status details the typed client folds away.
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::CreateCacheRequest req;
  *req.mutable_config() = c;
  v1::CacheInfo resp;
  grpc::Status s = stub->CreateCache(&ctx, req, &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  for (const char* f : {"page_size", "head_dim", "num_q_heads", "kv_dtype"}) {
    EXPECT_NE(s.error_message().find(f), std::string::npos) << f;
  }
  google::rpc::Status rich;
  ASSERT_TRUE(rich.ParseFromString(s.error_details()));
  ASSERT_EQ(rich.details_size(), 1);
  google::rpc::BadRequest bad;
  ASSERT_TRUE(rich.details(0).UnpackTo(&bad));
  ASSERT_EQ(bad.field_violations_size(), 4);
  EXPECT_EQ(bad.field_violations(2).field(), "page_size");
  EXPECT_NE(bad.field_violations(2).description().find("(got 0"), std::string::npos);
}

// A name the server refuses is a violation of the field "name", as a config's fields are, and
// listed with them.
TEST_F(E2ETest, CreateCacheBadNameCarriesBadRequestDetails) {
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  for (const std::string& name : {std::string("tab\there"), std::string(129, 'n')}) {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest req;
    *req.mutable_config() = SmallConfig();
    req.set_name(name);
    v1::CacheInfo resp;
    grpc::Status s = stub->CreateCache(&ctx, req, &resp);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name;
    google::rpc::Status rich;
    ASSERT_TRUE(rich.ParseFromString(s.error_details())) << name;
    ASSERT_EQ(rich.details_size(), 1);
    google::rpc::BadRequest bad;
    ASSERT_TRUE(rich.details(0).UnpackTo(&bad));
    ASSERT_EQ(bad.field_violations_size(), 1);
    EXPECT_EQ(bad.field_violations(0).field(), "name");
    EXPECT_EQ(bad.field_violations(0).description(), s.error_message());
  }
  // With a bad config too: one answer names the name and every field of the config.
  grpc::ClientContext ctx;
  v1::CreateCacheRequest req;
  *req.mutable_config() = IssueExampleConfig();
  req.set_name("tab\there");
  v1::CacheInfo resp;
  grpc::Status s = stub->CreateCache(&ctx, req, &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  google::rpc::Status rich;
  ASSERT_TRUE(rich.ParseFromString(s.error_details()));
  google::rpc::BadRequest bad;
  ASSERT_TRUE(rich.details(0).UnpackTo(&bad));
  ASSERT_EQ(bad.field_violations_size(), 5) << s.error_message();
  EXPECT_EQ(bad.field_violations(0).field(), "name");
  EXPECT_EQ(bad.field_violations(3).field(), "page_size");
  EXPECT_NE(s.error_message().find("printable ASCII"), std::string::npos) << s.error_message();
  EXPECT_TRUE(client_->ListCaches()->empty());
}

// A violation's description travels whole in the BadRequest details, as ValidateCacheConfig
// gives it: a cut one (160 bytes) read "nearest valid: 167772..." for 16777215.
TEST_F(E2ETest, BadRequestDescriptionsAreWhole) {
  v1::CacheConfig c = SmallConfig();
  c.set_num_q_heads(8);
  c.set_num_kv_heads(8);
  c.set_head_dim(128);
  c.set_page_size(16);
  c.set_num_pages(100000000);  // 100e6 x 8 heads x 16 rows: past 2^31 rows of a layer
  absl::StatusOr<v1::ValidateCacheConfigResponse> validated = client_->ValidateCacheConfig(c);
  ASSERT_TRUE(validated.ok()) << validated.status();
  ASSERT_EQ(validated->violations_size(), 1);
  const std::string& description = validated->violations(0).description();
  EXPECT_GT(description.size(), 160u) << description;
  EXPECT_NE(description.find("nearest valid: 16777215"), std::string::npos) << description;
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::CreateCacheRequest req;
  *req.mutable_config() = c;
  v1::CacheInfo resp;
  const grpc::Status s = stub->CreateCache(&ctx, req, &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  google::rpc::Status rich;
  ASSERT_TRUE(rich.ParseFromString(s.error_details()));
  google::rpc::BadRequest bad;
  ASSERT_TRUE(rich.details(0).UnpackTo(&bad));
  ASSERT_EQ(bad.field_violations_size(), 1);
  EXPECT_EQ(bad.field_violations(0).field(), "num_pages");
  EXPECT_EQ(bad.field_violations(0).description(), description);
  // No config at all is that, not six violations of an all-zero one.
  grpc::ClientContext empty_ctx;
  const grpc::Status empty = stub->CreateCache(&empty_ctx, v1::CreateCacheRequest(), &resp);
  EXPECT_EQ(empty.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(empty.error_message().find("config: config is required"), std::string::npos)
      << empty.error_message();
  ASSERT_TRUE(rich.ParseFromString(empty.error_details()));
  ASSERT_TRUE(rich.details(0).UnpackTo(&bad));
  ASSERT_EQ(bad.field_violations_size(), 1);
  EXPECT_EQ(bad.field_violations(0).field(), "config");
}

// The status that carries violations stays bounded (clients cap trailing metadata at 8 KiB): at
// most 10 violations, each description at most 512 bytes, 1600 together, the message 1024,
// each cut one saying its length.
TEST(StatusTest, ViolationDetailsShareABoundedBudget) {
  ValidationResult many;
  for (int i = 0; i < 12; ++i) {
    many.violations.push_back({absl::StrCat("field", i), std::string(600, 'a' + i)});
  }
  const grpc::Status s = ToGrpcStatus(ValidationStatus(many));
  EXPECT_LE(s.error_message().size(), kMaxStatusMessageBytes);
  google::rpc::Status rich;
  ASSERT_TRUE(rich.ParseFromString(s.error_details()));
  google::rpc::BadRequest bad;
  ASSERT_TRUE(rich.details(0).UnpackTo(&bad));
  ASSERT_EQ(bad.field_violations_size(), 10);
  size_t total = 0;
  for (const auto& v : bad.field_violations()) {
    EXPECT_LE(v.description().size(), kMaxViolationDescriptionBytes) << v.field();
    EXPECT_GE(v.description().size(), kMinViolationDescriptionBytes) << v.field();
    EXPECT_NE(v.description().find("(600 bytes)"), std::string::npos) << v.description();
    total += v.description().size();
  }
  EXPECT_LE(total, kMaxViolationDescriptionsBytes);
  EXPECT_GT(total, kMaxViolationDescriptionsBytes - 100);  // the budget is used, not wasted
}

TEST_F(E2ETest, OversizedCacheIsResourceExhaustedWithNumbers) {
  v1::CacheConfig c = SmallConfig();
  c.set_num_layers(4096);
  c.set_num_kv_heads(64);
  c.set_num_q_heads(64);
  c.set_head_dim(256);
  c.set_page_size(1024);
  c.set_num_pages(30000);  // 1.97e9 rows of a layer, under 2^31; 2^53 bytes
  absl::StatusOr<v1::CacheInfo> r = client_->CreateCache(c);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find(OnCpu() ? "bytes are free in host memory (the CPU backend's)"
                                              : "bytes are free on device 0"),
            std::string::npos)
      << r.status();
}

TEST_F(E2ETest, CacheLifecycle) {
  absl::StatusOr<v1::CacheInfo> created = client_->CreateCache(SmallConfig(), "lifecycle");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->cache_id().size(), 32u);
  EXPECT_EQ(created->num_pages(), 8);
  EXPECT_EQ(created->capacity_tokens(), 32);
  EXPECT_EQ(created->stats().free_pages(), 8);
  absl::StatusOr<v1::CacheInfo> got = client_->GetCache(created->cache_id());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->name(), "lifecycle");
  auto list = client_->ListCaches();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  absl::StatusOr<int64_t> freed = client_->DeleteCache(created->cache_id());
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, created->bytes());
  EXPECT_EQ(client_->GetCache(created->cache_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteCache(created->cache_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->GetCache("nope").status().code(), absl::StatusCode::kNotFound);
  // No id at all is a missing field, not an unknown cache.
  const absl::Status empty = client_->GetCache("").status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_NE(empty.message().find("cache_id is required"), std::string::npos) << empty;
}

TEST_F(E2ETest, SmokeMixedBatchMatchesReference) {
  SmokeOptions o;
  absl::StatusOr<SmokeReport> r;
  if (OnCpu()) {
    o.kv_dtype = v1::FLOAT32;
    r = RunSmoke(*client_, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->passed) << r->summary;
    EXPECT_LE(r->max_rel_error, 1e-5);
  }
  o.kv_dtype = v1::BFLOAT16;
  o.q_dtype = v1::BFLOAT16;
  r = RunSmoke(*client_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed) << r->summary;
  o.kv_dtype = v1::FLOAT8_E4M3;  // against the unquantized K/V, within FP8's bound
  r = RunSmoke(*client_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed) << r->summary;
}

// No valid request returns NaN: with the largest finite sm_scale every score overflows, and
// with inputs near the dtype's largest value the dot products do too; the softmax saturates
// (the largest score wins) instead of computing inf - inf. Prefill and decode tiles both, on a
// 16/32-bit cache and on an FP8 one (whose rows' scales then near float's largest too).
TEST_F(E2ETest, ExtremeScalesAndValuesGiveFiniteOutputs) {
  v1::CacheConfig fp8 = SmallConfig();
  fp8.set_kv_dtype(v1::FLOAT8_E4M3);
  for (const v1::CacheConfig& config : {SmallConfig(), fp8}) {
    const std::string id = client_->CreateCache(config)->cache_id();
    for (float scale : {3.4e38f, 1e30f, 1.0f}) {
      for (float magnitude : {1.0f, 3e38f}) {
        for (int n : {1, 7}) {  // a decode-shaped and a prefill-shaped span
          v1::ForwardRequest r = Request(id, 1, 0, n, static_cast<uint64_t>(n));
          r.mutable_options()->set_sm_scale(scale);
          r.mutable_options()->set_return_lse(true);
          std::vector<float> big(static_cast<size_t>(n) * 2 * 64);
          for (size_t i = 0; i < big.size(); ++i) big[i] = (i % 3 == 0 ? -magnitude : magnitude);
          if (magnitude > 1) *r.mutable_k() = MakeTensor(v1::FLOAT32, {n, 2, 64}, big);
          absl::StatusOr<v1::ForwardResponse> out = client_->Forward(r);
          ASSERT_TRUE(out.ok()) << out.status();
          absl::StatusOr<std::vector<float>> values = TensorToFloats(out->out());
          ASSERT_TRUE(values.ok());
          for (float x : *values) {
            ASSERT_TRUE(std::isfinite(x)) << "scale " << scale << " magnitude " << magnitude;
          }
          absl::StatusOr<std::vector<float>> lse = TensorToFloats(out->lse());
          for (float x : *lse) ASSERT_FALSE(std::isnan(x)) << "scale " << scale;
        }
      }
    }
  }
}

// NaN in q, K or V counts as 0 and a magnitude past 2^48 as 2^48 (AttentionValue): a Forward
// that sends them answers, to the bit and finite, as one that sends those values does; a prefill,
// then a decode step over the rows stored so.
TEST_F(E2ETest, NanAndHugeInputsCountAsTheirAttentionValues) {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), -3e30f, 1e20f};
  const std::string raw = client_->CreateCache(SmallConfig())->cache_id();
  const std::string clean = client_->CreateCache(SmallConfig())->cache_id();
  for (int step = 0; step < 2; ++step) {
    const int start = step == 0 ? 0 : 7, n = step == 0 ? 7 : 1;
    v1::ForwardRequest r = Request(raw, 1, start, n, 40 + static_cast<uint64_t>(step));
    v1::ForwardRequest c = r;
    c.set_cache_id(clean);
    for (auto field : {&v1::ForwardRequest::mutable_q, &v1::ForwardRequest::mutable_k,
                       &v1::ForwardRequest::mutable_v}) {
      v1::Tensor* t = (r.*field)();
      absl::StatusOr<std::vector<float>> values = TensorToFloats(*t);
      ASSERT_TRUE(values.ok());
      std::vector<float> sent = *values, stored = *values;
      for (size_t i = 0; i < sent.size(); i += 5) {
        sent[i] = specials[i / 5 % 4];
        stored[i] = AttentionValue(sent[i]);
      }
      const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
      *t = MakeTensor(v1::FLOAT32, shape, sent);
      *(c.*field)() = MakeTensor(v1::FLOAT32, shape, stored);
    }
    absl::StatusOr<v1::ForwardResponse> got = client_->Forward(r);
    absl::StatusOr<v1::ForwardResponse> want = client_->Forward(c);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<std::vector<float>> a = TensorToFloats(got->out());
    absl::StatusOr<std::vector<float>> b = TensorToFloats(want->out());
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->size(), b->size());
    for (size_t i = 0; i < a->size(); ++i) {
      ASSERT_TRUE(std::isfinite((*a)[i])) << "step " << step << " element " << i;
      ASSERT_EQ((*a)[i], (*b)[i]) << "step " << step << " element " << i;
    }
  }
}

TEST_F(E2ETest, ForwardErrorsLeaveCacheUnchangedAndRetryMatches) {
  const std::string id = client_->CreateCache(SmallConfig())->cache_id();
  ASSERT_TRUE(client_->Forward(Request(id, 1, 0, 10, 1)).ok());  // 3 of 8 pages
  const v1::CacheStats before = client_->GetCache(id)->stats();
  auto expect_code = [&](v1::ForwardRequest r, absl::StatusCode code, const std::string& what) {
    absl::StatusOr<v1::ForwardResponse> resp = client_->Forward(r);
    EXPECT_EQ(resp.status().code(), code) << what << ": " << resp.status();
    const v1::CacheStats now = client_->GetCache(id)->stats();
    EXPECT_EQ(now.used_pages(), before.used_pages()) << what;
    EXPECT_EQ(now.live_sequences(), before.live_sequences()) << what;
  };
  v1::ForwardRequest good = Request(id, 1, 10, 3, 2);
  v1::ForwardRequest r = good;
  r.set_cache_id("unknown");
  expect_code(r, absl::StatusCode::kNotFound, "unknown cache");
  r = good;
  r.mutable_spans(0)->set_start(11);
  expect_code(r, absl::StatusCode::kFailedPrecondition, "gap");
  r = good;
  r.mutable_q()->mutable_data()->pop_back();
  expect_code(r, absl::StatusCode::kInvalidArgument, "truncated");
  r = good;
  r.mutable_k()->set_dtype(static_cast<v1::DType>(77));
  expect_code(r, absl::StatusCode::kInvalidArgument, "bad dtype");
  r = good;
  r.mutable_q()->set_shape(0, -5);
  expect_code(r, absl::StatusCode::kInvalidArgument, "negative dim");
  r = good;
  r.mutable_q()->set_shape(1, int64_t{1} << 60);
  expect_code(r, absl::StatusCode::kInvalidArgument, "huge dim");
  r = good;
  r.set_layer(-1);
  expect_code(r, absl::StatusCode::kInvalidArgument, "layer");
  r = Request(id, 2, 0, 30, 3);  // 8 pages > 5 free
  expect_code(r, absl::StatusCode::kResourceExhausted, "out of pages");
  // The good request now, and again (idempotent retry): identical bytes.
  absl::StatusOr<v1::ForwardResponse> a = client_->Forward(good);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<v1::ForwardResponse> b = client_->Forward(good);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->out().data(), b->out().data());
  EXPECT_EQ(a->out().shape_size(), 3);
  auto rel = client_->ReleaseSequences(id, {1, 42});
  ASSERT_TRUE(rel.ok());
  EXPECT_EQ(rel->released(), 1);
  EXPECT_EQ(rel->freed_pages(), 4);
  ASSERT_EQ(rel->unknown_seq_ids_size(), 1);
  EXPECT_EQ(rel->unknown_seq_ids(0), 42u);
  EXPECT_EQ(client_->GetCache(id)->stats().used_pages(), 0);
  ASSERT_TRUE(client_->DeleteCache(id).ok());
}

TEST_F(E2ETest, ConcurrentClientsOnSeveralCaches) {
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(client_->CreateCache(SmallConfig())->cache_id());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      const std::string& id = ids[t % 3];
      const int layer = t / 3;
      for (int step = 0; step < 5; ++step) {
        v1::ForwardRequest r = Request(id, 1, step, 1, t * 100 + step);
        r.set_layer(layer);
        if (!client_->Forward(r).ok()) failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (const std::string& id : ids) {
    EXPECT_EQ(client_->GetCache(id)->stats().forward_calls(), 10);
    EXPECT_TRUE(client_->DeleteCache(id).ok());
  }
}

// Random, mostly malformed Forwards: whatever the answer, the server stays up, and a refused
// request leaves the cache's pages and sequences exactly as they were.
TEST_F(E2ETest, RandomRequestsNeverCrashOrLeak) {
  const std::string id = client_->CreateCache(SmallConfig())->cache_id();
  std::mt19937 rng(20261129);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int accepted = 0;
  std::map<std::pair<int, int>, int64_t> len;  // (layer, seq) -> tokens, from accepted Forwards
  for (int iter = 0; iter < 300; ++iter) {
    // Half the requests are built valid from what the cache holds; the rest are random.
    const bool valid = pick(0, 1) == 0;
    v1::ForwardRequest r;
    r.set_cache_id(id);
    r.set_layer(valid ? pick(0, 1) : pick(-1, 2));
    int64_t total_q = 0, total_new = 0;
    const int num_spans = valid ? pick(1, 2) : pick(0, 3);
    const int first_seq = pick(0, 3);
    for (int i = 0; i < num_spans; ++i) {
      v1::Span* sp = r.add_spans();
      if (valid) {
        const int seq = (first_seq + i) % 4;
        const int64_t have = len[{r.layer(), seq}];
        sp->set_seq_id(static_cast<uint64_t>(seq));
        sp->set_start(pick(0, static_cast<int>(have)));
        sp->set_num_new_tokens(pick(1, 4));
        sp->set_num_queries(pick(0, static_cast<int>(sp->start()) + sp->num_new_tokens()));
      } else {
        sp->set_seq_id(static_cast<uint64_t>(pick(0, 3)));
        sp->set_start(pick(-2, 12));
        sp->set_num_new_tokens(pick(-1, 9));
        sp->set_num_queries(pick(-1, 9));
      }
      total_q += std::max(0, sp->num_queries());
      total_new += std::max(0, sp->num_new_tokens());
    }
    auto tensor = [&](int64_t rows, int heads) {
      // Usually well-formed; sometimes a wrong dtype, dim or byte count.
      const int fault = valid ? 9 : pick(0, 9);
      const v1::DType dtype = fault == 0 ? static_cast<v1::DType>(pick(0, 6)) : v1::BFLOAT16;
      std::vector<int64_t> shape = {rows, heads, 64};
      if (fault == 1) shape[pick(0, 2)] += pick(-3, 3);
      if (fault == 2) shape.push_back(1);
      v1::Tensor t = MakeTensor(v1::BFLOAT16, {rows, heads, 64},
                                std::vector<float>(rows * heads * 64, 0.25f * pick(-4, 4)));
      t.set_dtype(dtype);
      t.clear_shape();
      for (int64_t d : shape) t.add_shape(d);
      if (fault == 3 && !t.data().empty()) t.mutable_data()->resize(t.data().size() - pick(1, 3));
      return t;
    };
    if (valid || pick(0, 9) > 0) *r.mutable_q() = tensor(total_q, 4);
    if (total_new > 0 || pick(0, 3) == 0) {
      *r.mutable_k() = tensor(total_new, 2);
      *r.mutable_v() = tensor(total_new, 2);
    }
    if (!valid && pick(0, 4) == 0) r.mutable_options()->set_sm_scale(pick(-1, 1) * 0.5f);
    const v1::CacheStats before = client_->GetCache(id)->stats();
    absl::StatusOr<v1::ForwardResponse> resp = client_->Forward(r);
    const v1::CacheStats after = client_->GetCache(id)->stats();
    if (resp.ok()) {
      ++accepted;
      for (const v1::Span& sp : r.spans()) {
        if (sp.num_new_tokens() > 0)
          len[{r.layer(), static_cast<int>(sp.seq_id())}] = sp.start() + sp.num_new_tokens();
      }
      // Held in a variable: `for (x : *TensorToFloats(...))` would iterate a vector inside a
      // temporary destroyed before the loop runs (a dangling read that failed this test once).
      const absl::StatusOr<std::vector<float>> out = TensorToFloats(resp->out());
      ASSERT_TRUE(out.ok()) << out.status();
      for (float x : *out) ASSERT_FALSE(std::isnan(x)) << r.DebugString();
    } else {
      ASSERT_NE(resp.status().code(), absl::StatusCode::kInternal) << resp.status();
      ASSERT_NE(resp.status().code(), absl::StatusCode::kUnavailable) << resp.status();
      EXPECT_EQ(after.used_pages(), before.used_pages()) << resp.status();
      EXPECT_EQ(after.live_sequences(), before.live_sequences()) << resp.status();
    }
    if (after.used_pages() > 6) {
      ASSERT_TRUE(client_->ReleaseSequences(id, {0, 1, 2, 3}).ok());
      len.clear();
    }
  }
  EXPECT_GT(accepted, 50);  // the valid half mostly goes through
  EXPECT_TRUE(*client_->CheckHealth());
  ASSERT_TRUE(client_->DeleteCache(id).ok());
}

TEST(E2EShutdownTest, ShutdownRefusesNewRpcs) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.backend = BackendOptionsUnderTest(2);
  auto server = PagedAttnServer::Start(options);
  ASSERT_TRUE(server.ok());
  ClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", (*server)->port());
  o.timeout = absl::Seconds(2);
  auto client = *Client::Connect(o);
  ASSERT_TRUE(client->GetServerInfo().ok());
  (*server)->Shutdown(absl::Seconds(1));
  (*server)->Wait();
  EXPECT_FALSE(client->GetServerInfo().ok());
}

TEST(E2EStartTest, BadListenAddressIsAnError) {
  ServerOptions options;
  options.listen = "not-an-address:99999";
  options.backend.backend = BackendChoice::kCpu;
  EXPECT_FALSE(PagedAttnServer::Start(options).ok());
}


// A Gemma-style cache (windowed and global layers, soft-capped, sinks on the global one) over
// gRPC: every backend takes it and echoes the per-layer table, and the window changes the answer
// of its layer; a bad table is refused with each field named.
TEST_F(E2ETest, LayerVariantsAreValidatedAtCreateCache) {
  v1::CacheConfig c = SmallConfig();
  v1::LayerAttention* windowed = c.add_layers();
  windowed->set_sliding_window(3);
  windowed->set_logit_softcap(20.f);
  v1::LayerAttention* global = c.add_layers();
  global->set_logit_softcap(20.f);
  for (int h = 0; h < 4; ++h) global->add_sinks(0.25f * h);
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->capabilities().supports_sliding_window());
  EXPECT_TRUE(info->capabilities().supports_logit_softcap());
  EXPECT_TRUE(info->capabilities().supports_sinks());
  absl::StatusOr<v1::CacheInfo> cache = client_->CreateCache(c);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_EQ(cache->config().layers_size(), 2);
  EXPECT_EQ(cache->config().layers(0).sliding_window(), 3);
  EXPECT_FALSE(cache->config().layers(1).has_sliding_window());
  EXPECT_EQ(cache->config().layers(1).sinks_size(), 4);
  // The same inputs on a plain cache and on this one: layer 0 (window 3 over 8 tokens) differs.
  const std::string plain = client_->CreateCache(SmallConfig())->cache_id();
  v1::ForwardRequest req = Request(cache->cache_id(), 1, 0, 8, 5);
  absl::StatusOr<v1::ForwardResponse> varied = client_->Forward(req);
  req.set_cache_id(plain);
  absl::StatusOr<v1::ForwardResponse> base = client_->Forward(req);
  ASSERT_TRUE(varied.ok() && base.ok()) << varied.status() << base.status();
  EXPECT_NE(varied->out().data(), base->out().data());
  // Bad tables are refused with every field named.
  c.mutable_layers(0)->set_sliding_window(0);
  c.mutable_layers(1)->add_sinks(1.f);  // 5 sinks for 4 q heads
  absl::StatusOr<v1::ValidateCacheConfigResponse> v = client_->ValidateCacheConfig(c);
  ASSERT_TRUE(v.ok());
  ASSERT_EQ(v->violations_size(), 2);
  EXPECT_EQ(v->violations(0).field(), "layers[0].sliding_window");
  EXPECT_EQ(v->violations(1).field(), "layers[1].sinks");
}

}  // namespace
}  // namespace pagedattn
