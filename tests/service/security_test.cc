// Operations end to end: TLS and mTLS with certificates made here (openssl), bearer tokens
// and tenant isolation, the plaintext health port, /metrics moving with traffic, and every
// limit with its error.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "absl/time/clock.h"
#include "client/client.h"
#include "server/core/cpu_backend.h"
#include "server/service/metrics.h"
#include "server/service/server.h"
#include "spdlog/spdlog.h"
#include "tests/service/log_capture.h"

namespace pagedattn {
namespace {

// Tokens of the test tenants (strong enough for the tokens file: 16+ characters).
constexpr char kAlpha[] = "alpha-3f9c2b7e1d4a8c05";
constexpr char kAlpha2[] = "alpha-b81e6f0c2a9d4e37";
constexpr char kBeta[] = "beta-5d2a7c9e0f3b6184";

namespace fs = std::filesystem;

// A CA, a server certificate for 127.0.0.1/localhost and a client certificate.
class Pki {
 public:
  Pki() {
    dir_ = fs::temp_directory_path() / ("pagedattn-pki-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string d = dir_.string();
    const std::string script =
        "set -e; cd '" + d +
        "'; exec >openssl.log 2>&1\n"
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj "
        "/CN=test-ca\n"
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > san.ext\n"
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "
        "/CN=localhost\n"
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
        "-days 2 -extfile san.ext\n"
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=client\n"
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem "
        "-days 2\n";
    std::ofstream(dir_ / "make-certs.sh") << script;
    ok_ = std::system(("bash '" + (dir_ / "make-certs.sh").string() + "'").c_str()) == 0;
  }
  ~Pki() { fs::remove_all(dir_); }
  bool ok() const { return ok_; }
  std::string path(const char* name) const { return (dir_ / name).string(); }

 private:
  fs::path dir_;
  bool ok_ = false;
};

std::string WriteTokens(const std::string& contents) {
  const std::string path =
      (fs::temp_directory_path() / ("pagedattn-tokens-" + std::to_string(::getpid()))).string();
  std::ofstream(path) << contents;
  return path;
}

v1::CacheConfig SmallConfig() {
  v1::CacheConfig c;
  c.set_num_layers(1);
  c.set_num_q_heads(2);
  c.set_num_kv_heads(1);
  c.set_head_dim(64);
  c.set_page_size(4);
  c.set_kv_dtype(v1::FLOAT16);
  c.set_num_pages(16);
  return c;
}

v1::ForwardRequest Prefill(const std::string& cache, uint64_t seq, int n) {
  v1::ForwardRequest r;
  r.set_cache_id(cache);
  v1::Span* s = r.add_spans();
  s->set_seq_id(seq);
  s->set_num_new_tokens(n);
  s->set_num_queries(n);
  std::vector<float> q(n * 2 * 64), kv(n * 64);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.1f * i);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = std::cos(0.07f * i);
  *r.mutable_q() = MakeTensor(v1::FLOAT16, {n, 2, 64}, q);
  *r.mutable_k() = MakeTensor(v1::FLOAT16, {n, 1, 64}, kv);
  *r.mutable_v() = MakeTensor(v1::FLOAT16, {n, 1, 64}, kv);
  return r;
}

// Value of one sample ("name{labels}" exactly as rendered) in Prometheus text, or -1.
double Sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = new Pki();
    ASSERT_TRUE(pki_->ok()) << "openssl failed; see its log in the temp dir";
    tokens_ = WriteTokens(absl::StrCat("# test tokens\n", kAlpha, " alpha\n", kBeta, " beta\n\n",
                                       kAlpha2, " alpha\n"));
    ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.backend = {.backend = BackendChoice::kCpu, .cpu_threads = 2};
    o.tls_cert_file = pki_->path("server.pem");
    o.tls_key_file = pki_->path("server.key");
    o.auth_tokens_file = tokens_;
    o.health_listen = "127.0.0.1:0";
    o.metrics_listen = "127.0.0.1:0";
    o.limits.max_caches_per_tenant = 2;
    o.limits.forward.max_tokens = 100;
    o.limits.forward.max_spans = 3;
    o.max_message_bytes = 256 << 10;
    auto s = PagedAttnServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete pki_;
    fs::remove(tokens_);
  }

  std::unique_ptr<Client> Connect(const std::string& token, bool tls = true) {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", server_->port());
    o.timeout = absl::Seconds(10);
    o.bearer_token = token;
    if (tls) o.tls_ca_file = pki_->path("ca.pem");
    return *Client::Connect(o);
  }
  std::string MetricsText() {
    absl::StatusOr<std::string> t =
        FetchMetrics(absl::StrCat("127.0.0.1:", server_->metrics_port()));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.value_or("");
  }

  static Pki* pki_;
  static std::string tokens_;
  static PagedAttnServer* server_;
};
Pki* SecurityTest::pki_ = nullptr;
std::string SecurityTest::tokens_;
PagedAttnServer* SecurityTest::server_ = nullptr;

TEST_F(SecurityTest, PlaintextClientIsRefusedByTlsPort) {
  auto c = Connect(kAlpha, /*tls=*/false);
  EXPECT_EQ(c->ListCaches().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(SecurityTest, MissingOrWrongTokenIsUnauthenticated) {
  EXPECT_EQ(Connect("")->ListCaches().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Connect("nope")->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(Connect(kAlpha)->ListCaches().ok());
}

// A call without a valid token is refused as its headers arrive (TokenAuthProcessor), before
// gRPC reads its request: a message over --max_message_mb says UNAUTHENTICATED, not that it is
// too large, and holds no request memory. The refusals are counted and logged as the handlers'.
TEST_F(SecurityTest, CallWithoutTokenIsRefusedBeforeItsRequestIsRead) {
  testing::LogCapture captured(spdlog::level::info);
  const std::string missing = "pagedattn_rpcs_total{method=\"Forward\",code=\"UNAUTHENTICATED\"}";
  const std::string wrong = "pagedattn_rpcs_total{method=\"GetCache\",code=\"UNAUTHENTICATED\"}";
  const std::string before = MetricsText();
  const v1::ForwardRequest big = Prefill("any", 1, 4096);  // 2 MiB, the limit 256 KiB
  ASSERT_GT(big.ByteSizeLong(), size_t{1} << 20);
  const absl::Status no_token = Connect("")->Forward(big).status();
  EXPECT_EQ(no_token.code(), absl::StatusCode::kUnauthenticated) << no_token;
  EXPECT_NE(no_token.message().find("missing 'authorization"), std::string::npos) << no_token;
  absl::Status bad_token;
  {
    RequestId id("step-9 layer-2");  // its line carries it, escaped as a field
    bad_token = Connect("nope-not-a-token-at-all")->GetCache("x").status();
  }
  EXPECT_EQ(bad_token.code(), absl::StatusCode::kUnauthenticated) << bad_token;
  // With a token the same message is refused for its size, as before.
  EXPECT_EQ(Connect(kAlpha)->Forward(big).status().code(), absl::StatusCode::kResourceExhausted);
  const std::string after = MetricsText();
  EXPECT_EQ(Sample(after, missing), std::max(0.0, Sample(before, missing)) + 1);
  EXPECT_EQ(Sample(after, wrong), std::max(0.0, Sample(before, wrong)) + 1);
  const std::string log = captured.str();
  // The line says what is known of the caller here (its user-agent; no address).
  EXPECT_NE(log.find("rpc Forward refused as its headers arrived (user-agent=grpc-c++/"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("): UNAUTHENTICATED: missing"), std::string::npos) << log;
  EXPECT_NE(log.find(" req=step-9\\x20layer-2): UNAUTHENTICATED: "), std::string::npos) << log;
  EXPECT_EQ(log.find("nope-not-a-token"), std::string::npos);
}

TEST_F(SecurityTest, HealthStaysOpenOnBothPorts) {
  auto tls = Connect("");
  EXPECT_TRUE(*tls->CheckHealth());
  ClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", server_->health_port());
  auto plain = *Client::Connect(o);
  absl::StatusOr<bool> h = plain->CheckHealth();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(*h);
  // The health port serves nothing else, and says where the service is.
  const absl::Status other = plain->ListCaches().status();
  EXPECT_EQ(other.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(other.message(),
            absl::StrCat("/pagedattn.v1.AttentionService/ListCaches: this port (--health_listen) "
                         "serves grpc.health.v1 and reflection only; the service listens on "
                         "127.0.0.1:",
                         server_->port()));
}

TEST_F(SecurityTest, TenantsCannotSeeEachOthersCaches) {
  auto alpha = Connect(kAlpha);
  auto alpha2 = Connect(kAlpha2);  // another token of the same tenant
  auto beta = Connect(kBeta);
  absl::StatusOr<v1::CacheInfo> a = alpha->CreateCache(SmallConfig(), "alpha's");
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string id = a->cache_id();
  EXPECT_EQ(beta->GetCache(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(beta->Forward(Prefill(id, 1, 4)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(beta->ReleaseSequences(id, {1}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(beta->DeleteCache(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(beta->ListCaches()->empty());
  EXPECT_TRUE(alpha2->GetCache(id).ok());
  ASSERT_EQ(alpha2->ListCaches()->size(), 1u);
  EXPECT_TRUE(alpha->Forward(Prefill(id, 1, 4)).ok());
  EXPECT_TRUE(alpha->DeleteCache(id).ok());
}

TEST_F(SecurityTest, TokensNeverAppearInLogs) {
  testing::LogCapture captured(spdlog::level::trace);
  (void)Connect("tok-secret-wrong")->ListCaches();
  auto alpha = Connect(kAlpha);
  auto c = alpha->CreateCache(SmallConfig());
  ASSERT_TRUE(c.ok());
  (void)alpha->DeleteCache(c->cache_id());
  const std::string log = captured.str();
  EXPECT_NE(log.find("UNAUTHENTICATED"), std::string::npos) << log;
  EXPECT_EQ(log.find("tok-secret-wrong"), std::string::npos);
  EXPECT_EQ(log.find(kAlpha), std::string::npos);
}

TEST_F(SecurityTest, MetricsMoveWithTraffic) {
  auto beta = Connect(kBeta);
  const std::string before = MetricsText();
  const std::string ok_fwd = "pagedattn_rpcs_total{method=\"Forward\",code=\"OK\"}";
  const std::string bad_fwd = "pagedattn_rpcs_total{method=\"Forward\",code=\"NOT_FOUND\"}";
  const double fwd0 = std::max(0.0, Sample(before, ok_fwd));
  const double nf0 = std::max(0.0, Sample(before, bad_fwd));
  const double tok0 = Sample(before, "pagedattn_tokens_appended_total");
  const double q0 = Sample(before, "pagedattn_queries_attended_total");
  const double n0 = Sample(before, "pagedattn_forward_latency_seconds_count");
  auto cache = beta->CreateCache(SmallConfig(), "metrics");
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(beta->Forward(Prefill(cache->cache_id(), 1, 5)).ok());
  v1::ForwardRequest decode = Prefill(cache->cache_id(), 1, 1);
  decode.mutable_spans(0)->set_start(5);
  ASSERT_TRUE(beta->Forward(decode).ok());
  EXPECT_FALSE(beta->Forward(Prefill("missing", 1, 1)).ok());
  const std::string after = MetricsText();
  EXPECT_EQ(Sample(after, ok_fwd), fwd0 + 2);
  EXPECT_EQ(Sample(after, bad_fwd), nf0 + 1);
  EXPECT_EQ(Sample(after, "pagedattn_tokens_appended_total"), tok0 + 6);
  EXPECT_EQ(Sample(after, "pagedattn_queries_attended_total"), q0 + 6);
  EXPECT_EQ(Sample(after, "pagedattn_forward_latency_seconds_count"), n0 + 2);
  EXPECT_EQ(Sample(after, "pagedattn_pages_used"), 2);  // 6 tokens, page 4
  EXPECT_EQ(Sample(after, "pagedattn_pages_free"), 14);
  EXPECT_EQ(Sample(after, "pagedattn_live_sequences"), 1);
  // /metrics needs no token: no cache id (a capability), cache name or tenant in it.
  EXPECT_EQ(after.find(cache->cache_id()), std::string::npos);
  EXPECT_EQ(after.find("\"metrics\""), std::string::npos);
  EXPECT_EQ(after.find("beta"), std::string::npos);
  EXPECT_GT(Sample(after, "pagedattn_device_memory_total_bytes"), 0);
  // Every line is a comment or "name{labels} value".
  std::istringstream in(after);
  std::string line;
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? [-+0-9.eEInfa]+$)");
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
  }
  EXPECT_TRUE(beta->DeleteCache(cache->cache_id()).ok());
}

// --metrics_per_cache: the per-cache series, labelled with the cache's id, name and tenant.
TEST(MetricsTest, PerCacheSeriesAreOptIn) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend.backend = BackendChoice::kCpu;
  o.metrics_listen = "127.0.0.1:0";
  o.metrics_per_cache = true;
  auto server = PagedAttnServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions c;
  c.target = absl::StrCat("127.0.0.1:", (*server)->port());
  auto client = *Client::Connect(c);
  auto cache = client->CreateCache(SmallConfig(), "metrics");
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(client->Forward(Prefill(cache->cache_id(), 1, 6)).ok());
  absl::StatusOr<std::string> text =
      FetchMetrics(absl::StrCat("127.0.0.1:", (*server)->metrics_port()));
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string labels =
      absl::StrCat("{cache_id=\"", cache->cache_id(), "\",name=\"metrics\",tenant=\"\"}");
  EXPECT_EQ(Sample(*text, "pagedattn_cache_pages_used" + labels), 2) << *text;
  EXPECT_EQ(Sample(*text, "pagedattn_cache_pages_free" + labels), 14);
  EXPECT_EQ(Sample(*text, "pagedattn_cache_live_sequences" + labels), 1);
}

// The latency histogram as Prometheus reads it: a Forward counts in every bucket whose bound is
// at least its latency (a bound is inclusive), the buckets add up to +Inf, and +Inf is the count.
TEST(MetricsTest, ForwardLatencyBucketsAreCumulativeAndInclusive) {
  CpuBackend backend({.num_threads = 1});
  CacheManager manager(&backend);
  Metrics metrics;
  for (double seconds : {0.0003, 0.001, 0.002, 10.0}) metrics.RecordForward(seconds, 1, 1);
  const std::string text = metrics.Render(manager);
  auto bucket = [&](const std::string& le) {
    return Sample(text, absl::StrCat("pagedattn_forward_latency_seconds_bucket{le=\"", le, "\"}"));
  };
  EXPECT_EQ(bucket("0.00025"), 0) << text;
  EXPECT_EQ(bucket("0.0005"), 1);
  EXPECT_EQ(bucket("0.001"), 2) << "0.001 s is in the bucket of bound 0.001";
  EXPECT_EQ(bucket("0.0025"), 3);
  EXPECT_EQ(bucket("5"), 3);
  EXPECT_EQ(bucket("+Inf"), 4);
  EXPECT_EQ(Sample(text, "pagedattn_forward_latency_seconds_count"), 4);
  EXPECT_NEAR(Sample(text, "pagedattn_forward_latency_seconds_sum"), 10.0033, 1e-6);
}

// Connections to the metrics port are answered one at a time: one that sends its request a byte
// at a time gets 2 s for all of it, not 2 s a byte, so a scrape behind it still gets through.
TEST(MetricsTest, ATricklingClientDoesNotHoldThePort) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend.backend = BackendChoice::kCpu;
  o.metrics_listen = "127.0.0.1:0";
  auto server = PagedAttnServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>((*server)->metrics_port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  std::thread trickle([fd] {  // "GET /metrics..." a byte every 250 ms, for 6 s
    for (int i = 0; i < 24; ++i) {
      if (send(fd, "G", 1, MSG_NOSIGNAL) != 1) break;
      absl::SleepFor(absl::Milliseconds(250));
    }
  });
  absl::SleepFor(absl::Milliseconds(100));  // the trickling connection is the one being read
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> text =
      FetchMetrics(absl::StrCat("127.0.0.1:", (*server)->metrics_port()));
  const absl::Duration took = absl::Now() - start;
  trickle.join();
  close(fd);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_LT(took, absl::Seconds(4)) << "the scrape waited behind a client sending a byte at a time";
}

TEST_F(SecurityTest, LimitsAreEnforcedWithClearErrors) {
  auto alpha = Connect(kAlpha);
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) ids.push_back(alpha->CreateCache(SmallConfig())->cache_id());
  absl::StatusOr<v1::CacheInfo> third = alpha->CreateCache(SmallConfig());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("caches per tenant"), std::string::npos);
  // At the limit, a bad config is still told what is wrong with it (not to delete a cache first).
  v1::CacheConfig bad = SmallConfig();
  bad.set_head_dim(100);
  absl::StatusOr<v1::CacheInfo> refused = alpha->CreateCache(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("head_dim"), std::string::npos) << refused.status();
  // Another tenant has its own quota.
  auto beta = Connect(kBeta);
  auto b = beta->CreateCache(SmallConfig());
  EXPECT_TRUE(b.ok()) << b.status();
  // Tokens per Forward (limit 100): 60 new + 60 queries.
  v1::ForwardRequest big = Prefill(ids[0], 1, 60);
  absl::StatusOr<v1::ForwardResponse> r = alpha->Forward(big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("at most 100 queries plus new tokens per Forward (got 120; "
                                      "the server's --max_forward_tokens)"),
            std::string::npos)
      << r.status();
  // Spans per Forward (limit 3).
  v1::ForwardRequest spans = Prefill(ids[0], 1, 1);
  for (uint64_t s = 2; s <= 4; ++s) {
    v1::Span* sp = spans.add_spans();
    sp->set_seq_id(s);
  }
  r = alpha->Forward(spans);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("at most 3 spans per Forward"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("the server's --max_forward_spans"), std::string::npos)
      << r.status();
  // Message size (256 KiB).
  v1::ForwardRequest huge = Prefill(ids[0], 1, 1);
  huge.mutable_q()->mutable_data()->append(300 << 10, 'x');
  r = alpha->Forward(huge);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  for (const std::string& id : ids) EXPECT_TRUE(alpha->DeleteCache(id).ok());
  EXPECT_TRUE(beta->DeleteCache(b->cache_id()).ok());
}

TEST(MutualTlsTest, ClientCertificateIsRequired) {
  Pki pki;
  ASSERT_TRUE(pki.ok());
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend.backend = BackendChoice::kCpu;
  o.tls_cert_file = pki.path("server.pem");
  o.tls_key_file = pki.path("server.key");
  o.tls_client_ca_file = pki.path("ca.pem");
  auto server = PagedAttnServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions c;
  c.target = absl::StrCat("127.0.0.1:", (*server)->port());
  c.timeout = absl::Seconds(10);
  c.tls_ca_file = pki.path("ca.pem");
  EXPECT_FALSE((*Client::Connect(c))->ListCaches().ok()) << "no client certificate";
  c.tls_cert_file = pki.path("client.pem");
  c.tls_key_file = pki.path("client.key");
  absl::StatusOr<std::vector<v1::CacheInfo>> list = (*Client::Connect(c))->ListCaches();
  EXPECT_TRUE(list.ok()) << list.status();
}

TEST(PoolBudgetTest, TotalPoolBytesLimit) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend.backend = BackendChoice::kCpu;
  o.limits.max_total_pool_bytes = 3 * 16 * 2 * 4 * 64 * 2;  // three caches of SmallConfig
  auto server = PagedAttnServer::Start(o);
  ASSERT_TRUE(server.ok());
  ClientOptions c;
  c.target = absl::StrCat("127.0.0.1:", (*server)->port());
  auto client = *Client::Connect(c);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client->CreateCache(SmallConfig()).ok()) << i;
  absl::StatusOr<v1::CacheInfo> r = client->CreateCache(SmallConfig());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  // The message names the flag that bounds it, not the device's memory.
  EXPECT_NE(r.status().message().find("--max_total_pool_gb"), std::string::npos) << r.status();
}

TEST(TokenFileTest, ParsesAndRejects) {
  const std::string t1 = "0123456789abcdef0123", t2 = "fedcba9876543210fedc";
  auto a = TokenAuthenticator::FromString(t1 + "\n" + t2 + " team\n# x\n");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*(*a)->TenantForToken(t1), "default");
  EXPECT_EQ(*(*a)->TenantForToken(t2), "team");
  EXPECT_EQ((*a)->TenantForToken("0123456789abcdef9999").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_FALSE(TokenAuthenticator::FromString("# only comments\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromString(t1 + " b c\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromString(t1 + "\n" + t1 + "\n").ok());
  EXPECT_EQ(TokenAuthenticator::FromFile("/nonexistent").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_NE(TokenAuthenticator::FromFile("/nonexistent")
                .status()
                .message()
                .find("No such file or directory"),
            std::string::npos);
  absl::Status dir = TokenAuthenticator::FromFile("/tmp").status();
  EXPECT_EQ(dir.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dir.message().find("is a directory"), std::string::npos) << dir;
}

// "token,tenant" (a separator other than whitespace) was one token of the tenant "default", so
// every tenant written that way shared one tenant's caches. Tokens are RFC 6750 characters; the
// error names the first other one and its place, never the token.
TEST(TokenFileTest, TokensAreRfc6750Characters) {
  const std::string t = "0123456789abcdef0123";
  for (const std::string& sep : {std::string(","), std::string(";"), std::string(":")}) {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> a =
        TokenAuthenticator::FromString("# tokens\n" + t + sep + "alice\n");
    ASSERT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << sep;
    EXPECT_NE(a.status().message().find("line 2: a token is letters, digits and -._~+/"),
              std::string::npos)
        << a.status();
    EXPECT_NE(a.status().message().find("'" + sep + "' at position 20 of 26"), std::string::npos)
        << a.status();
    EXPECT_NE(a.status().message().find("separator before a tenant is whitespace"),
              std::string::npos);
    EXPECT_EQ(a.status().message().find(t), std::string::npos) << a.status();
  }
  // Base64 with padding, and the other RFC 6750 characters, are tokens.
  EXPECT_TRUE(TokenAuthenticator::FromString("aGVsbG8td29ybGQtMTIzNA== team\n").ok());
  EXPECT_TRUE(TokenAuthenticator::FromString("a1-b2.c3_d4~e5+f6/g7h8 team\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromString("aGVsbG8=td29ybGQtMTIzNA team\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromString("0123456789abcdef\x01 team\n").ok());
}

// pagedattn::Client refuses a token gRPC could not send (it aborted the process and printed the
// token), without quoting it.
TEST(ClientTokenTest, UnsendableTokenIsRefusedAtConnect) {
  ClientOptions o;
  o.target = "127.0.0.1:1";
  for (const std::string& token :
       {std::string("s3cret-line-token\n"), std::string("s3cret-line-token\r\n"),
        std::string("s3cret line token")}) {
    o.bearer_token = token;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.status().message().find("s3cret"), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find("bearer token: byte 0x"), std::string::npos) << c.status();
  }
  o.bearer_token = "s3cret-line-token";
  EXPECT_TRUE(Client::Connect(o).ok());
}

// Half-given TLS settings are refused at Connect, naming what is missing: gRPC aborted the
// process on a certificate without its key, and a key or a server name without TLS sent the
// calls in plaintext unnoticed; a file that holds no PEM block is named.
TEST(ClientTlsTest, HalfGivenSettingsAreRefusedAtConnect) {
  Pki pki;
  ASSERT_TRUE(pki.ok());
  ClientOptions o;
  o.target = "127.0.0.1:1";
  o.tls_ca_file = pki.path("ca.pem");
  o.tls_cert_file = pki.path("client.pem");  // and no key
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("a certificate without a key"), std::string::npos);
  o.tls_cert_file.clear();
  o.tls_key_file = pki.path("client.key");
  c = Client::Connect(o);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("a key without a certificate"), std::string::npos);
  o = ClientOptions();
  o.target = "127.0.0.1:1";
  o.tls_server_name = "pagedattn.test";
  c = Client::Connect(o);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("tls_server_name applies to TLS"), std::string::npos);
  o.tls_ca_file = pki.path("client.key");  // a key, not a certificate
  c = Client::Connect(o);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("holds no PEM CERTIFICATE block"), std::string::npos)
      << c.status();
  o.tls_ca_file = "/nonexistent/ca.pem";  // named with what it is for, and why it is unread
  c = Client::Connect(o);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kNotFound) << c.status();
  EXPECT_NE(c.status().message().find(
                "TLS CA file /nonexistent/ca.pem: cannot read the file (No such file"),
            std::string::npos)
      << c.status();
  o.tls_ca_file = pki.path("ca.pem");
  EXPECT_TRUE(Client::Connect(o).ok());
}

// Weak tokens and the manifests' placeholders are refused when the server starts, and the
// message never quotes the token.
TEST(TokenFileTest, WeakAndPlaceholderTokensAreRefused) {
  for (const std::string& weak :
       {std::string("q7"), std::string("short-token"), std::string("aaaaaaaaaaaaaaaaaaaa"),
        std::string("REPLACE-WITH-A-LONG-RANDOM-TOKEN"), std::string("changeme-changeme-123")}) {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> a =
        TokenAuthenticator::FromString(weak + " team-a\n");
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << weak;
    EXPECT_EQ(a.status().message().find(weak), std::string::npos) << a.status();
  }
  EXPECT_FALSE(TokenAuthenticator::FromString("0123456789abcdef0123 bad/tenant\n").ok());
}

}  // namespace
}  // namespace pagedattn
