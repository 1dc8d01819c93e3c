// What a hostile or unlucky client can do to a running server, end to end on the CPU backend:
// shutdown during long work, cancelled and timed-out Forwards, answers too large to send,
// oversized error texts, unauthenticated health streams, forged log lines, orphan caches,
// requests whose parse would take many times their bytes, compressed requests, reflection.
#include <arpa/inet.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/dynamic_message.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/channel_arguments.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "pagedattn/v1/attention.grpc.pb.h"
#include "server/service/convert.h"
#include "server/service/forward_wire.h"
#include "server/service/http_server.h"
#include "server/service/request_parse.h"
#include "server/service/serial_queues.h"
#include "server/service/server.h"
#include "server/service/throttled_log.h"
#include "spdlog/spdlog.h"
#include "tests/service/log_capture.h"
#include "tests/service/random_script.h"

namespace pagedattn {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

constexpr int kHeads = 8, kKvHeads = 2, kHeadDim = 128;
// Built with ASan or TSan (scripts/test-sanitizers.sh): slower, and their runtimes hold
// descriptors of their own.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

ServerOptions CpuOptions() {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend = {.backend = BackendChoice::kCpu, .cpu_threads = 2};
  return o;
}

std::unique_ptr<Client> ConnectTo(const PagedAttnServer& server, absl::Duration timeout,
                                  const std::string& token = "") {
  ClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", server.port());
  o.timeout = timeout;
  o.bearer_token = token;
  return *Client::Connect(o);
}

v1::CacheConfig Config(int64_t pages) {
  v1::CacheConfig c;
  c.set_num_layers(1);
  c.set_num_q_heads(kHeads);
  c.set_num_kv_heads(kKvHeads);
  c.set_head_dim(kHeadDim);
  c.set_page_size(16);
  c.set_kv_dtype(v1::BFLOAT16);
  c.set_num_pages(pages);
  return c;
}

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// One span of seq: n new tokens at start, the last `queries` positions queried.
v1::ForwardRequest Request(const std::string& cache, uint64_t seq, int64_t start, int n,
                           int queries, uint64_t seed) {
  v1::ForwardRequest r;
  r.set_cache_id(cache);
  v1::Span* s = r.add_spans();
  s->set_seq_id(seq);
  s->set_start(start);
  s->set_num_new_tokens(n);
  s->set_num_queries(queries);
  if (queries > 0) {
    *r.mutable_q() = MakeTensor(v1::BFLOAT16, {queries, kHeads, kHeadDim},
                                Random(size_t{1} * queries * kHeads * kHeadDim, seed));
  }
  if (n > 0) {
    const std::vector<int64_t> shape = {n, kKvHeads, kHeadDim};
    *r.mutable_k() =
        MakeTensor(v1::BFLOAT16, shape, Random(size_t{1} * n * kKvHeads * kHeadDim, seed + 1));
    *r.mutable_v() =
        MakeTensor(v1::BFLOAT16, shape, Random(size_t{1} * n * kKvHeads * kHeadDim, seed + 2));
  }
  return r;
}

// A prefill that keeps the CPU backend busy for seconds (4096 x 4096 causal, 8 heads).
constexpr int kLongTokens = 4096;

// Waits until the server runs n AttentionService calls (the long Forward is being computed). A
// call counts until its answer has gone out: after a CreateCache, wait for 0 before starting the
// call to count.
void WaitForCalls(const PagedAttnServer& server, int64_t n) {
  for (int i = 0; i < 2000 && server.calls_in_flight() != n; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(server.calls_in_flight(), n);
}

CacheStats OnlyCacheStats(const PagedAttnServer& server) {
  std::vector<std::shared_ptr<Cache>> caches = server.manager().ListAll();
  EXPECT_EQ(caches.size(), 1u);
  return caches.empty() ? CacheStats{} : caches[0]->Stats();
}

// SIGTERM during a long Forward: the process must be done within the grace period, and the
// stopped Forward commits nothing.
TEST(ShutdownTest, LongForwardIsStoppedWithinTheGracePeriod) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string cache = client->CreateCache(Config(512))->cache_id();
  WaitForCalls(*server, 0);
  absl::StatusOr<v1::ForwardResponse> result;
  std::thread forward(
      [&] { result = client->Forward(Request(cache, 1, 0, kLongTokens, kLongTokens, 1)); });
  WaitForCalls(*server, 1);
  absl::SleepFor(absl::Milliseconds(200));  // well into its attention
  const absl::Time start = absl::Now();
  server->Shutdown(absl::Seconds(1));
  server->Wait();
  const absl::Duration took = absl::Now() - start;
  forward.join();
  EXPECT_LT(took, absl::Milliseconds(1500)) << "shutdown took " << took;
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(OnlyCacheStats(*server).live_sequences, 0) << "the stopped Forward committed";
  EXPECT_EQ(OnlyCacheStats(*server).used_pages, 0);
}

// A Watch stream and an idle connection do not hold a shutdown up for its grace period.
TEST(ShutdownTest, WatchStreamsAndIdleConnectionsDoNotDelayIt) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto idle = ConnectTo(*server, absl::Seconds(5));
  ASSERT_TRUE(idle->GetServerInfo().ok());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  HealthCheckRequest req;
  auto reader = stub->Watch(&ctx, req);
  HealthCheckResponse resp;
  ASSERT_TRUE(reader->Read(&resp));
  EXPECT_EQ(resp.status(), HealthCheckResponse::SERVING);
  const absl::Time start = absl::Now();
  std::thread stop([&] { server->Shutdown(absl::Seconds(10)); });
  // The stream sees NOT_SERVING, then its end; a shutdown under load may end it before the
  // update is sent, but never sends anything else.
  while (reader->Read(&resp)) {
    EXPECT_EQ(resp.status(), HealthCheckResponse::NOT_SERVING);
  }
  stop.join();
  server->Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

// While a shutdown waits for calls in flight, the main port's health says NOT_SERVING and new
// calls are refused with UNAVAILABLE.
TEST(ShutdownTest, DrainingServerIsNotServingAndRefusesNewCalls) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string cache = client->CreateCache(Config(512))->cache_id();
  WaitForCalls(*server, 0);
  std::thread forward(
      [&] { (void)client->Forward(Request(cache, 1, 0, kLongTokens, kLongTokens, 1)); });
  WaitForCalls(*server, 1);
  std::thread stop([&] { server->Shutdown(absl::Seconds(2)); });
  auto other = ConnectTo(*server, absl::Seconds(5));
  absl::StatusOr<bool> serving = true;
  for (int i = 0; i < 200 && serving.ok() && *serving; ++i) {
    serving = other->CheckHealth();
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_FALSE(*serving);
  absl::StatusOr<std::vector<v1::CacheInfo>> list = other->ListCaches();
  EXPECT_EQ(list.status().code(), absl::StatusCode::kUnavailable) << list.status();
  EXPECT_NE(list.status().message().find("shutting down"), std::string::npos);
  forward.join();  // the long Forward is stopped at the end of the grace period
  stop.join();
  server->Wait();
}

class HardeningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = *PagedAttnServer::Start(CpuOptions());
    client_ = ConnectTo(*server_, absl::Seconds(60));
    cache_ = client_->CreateCache(Config(512))->cache_id();
    WaitIdle();
  }
  void WaitIdle() { WaitForCalls(*server_, 0); }

  std::unique_ptr<PagedAttnServer> server_;
  std::unique_ptr<Client> client_;
  std::string cache_;
};

// A Forward past its deadline stops on the server and commits nothing; the same request then
// succeeds.
TEST_F(HardeningTest, TimedOutForwardCommitsNothing) {
  auto hurried = ConnectTo(*server_, absl::Milliseconds(300));
  const v1::ForwardRequest req = Request(cache_, 1, 0, kLongTokens, kLongTokens, 1);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ForwardResponse> r = hurried->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  WaitIdle();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "the server did not stop the Forward";
  EXPECT_EQ(OnlyCacheStats(*server_).live_sequences, 0);
  EXPECT_EQ(OnlyCacheStats(*server_).forward_calls, 0);
  EXPECT_TRUE(client_->Forward(Request(cache_, 1, 0, 64, 64, 1)).ok());
}

// A CPU Forward whose one work item is long (64 queries over 65536 positions: seconds) stops
// within a query's time of its deadline, not at the item's end, and commits nothing.
TEST_F(HardeningTest, LongWorkItemStopsWithinAQuery) {
  constexpr int kContext = 65536;
  const std::string cache = client_->CreateCache(Config(kContext / 16))->cache_id();
  ASSERT_TRUE(client_->Forward(Request(cache, 1, 0, kContext, 0, 1)).ok());
  auto hurried = ConnectTo(*server_, absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ForwardResponse> r = hurried->Forward(Request(cache, 1, kContext, 0, 64, 4));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  WaitIdle();
  // The whole Forward takes 3.3 s on two cores (about ten times that under a sanitizer).
  EXPECT_LT(absl::Now() - start, absl::Seconds(kSanitized ? 8 : 1.5))
      << "the server did not stop the Forward";
  // The sequence is as it was: kContext positions, queried again without appending.
  EXPECT_TRUE(client_->Forward(Request(cache, 1, kContext, 0, 1, 5)).ok());
}

// A rewinding Forward that is stopped puts back the committed rows it overwrote (and, in an FP8
// cache, their scales): attention over the sequence afterwards is bit-identical to before it.
TEST_F(HardeningTest, StoppedRewindRestoresTheRowsItOverwrote) {
  v1::CacheConfig fp8 = Config(512);
  fp8.set_kv_dtype(v1::FLOAT8_E4M3);
  for (const std::string& cache : {cache_, client_->CreateCache(fp8)->cache_id()}) {
    ASSERT_TRUE(client_->Forward(Request(cache, 1, 0, 64, 1, 1)).ok());
    const v1::ForwardRequest look = Request(cache, 1, 64, 0, 1, 7);  // attend only
    absl::StatusOr<v1::ForwardResponse> before = client_->Forward(look);
    ASSERT_TRUE(before.ok()) << before.status();
    auto hurried = ConnectTo(*server_, absl::Milliseconds(300));
    absl::StatusOr<v1::ForwardResponse> r =
        hurried->Forward(Request(cache, 1, 32, kLongTokens, kLongTokens, 2));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    WaitIdle();
    absl::StatusOr<v1::ForwardResponse> after = client_->Forward(look);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->out().data(), before->out().data());
    // Still 64 tokens long: position 65 would leave a gap.
    EXPECT_EQ(client_->Forward(Request(cache, 1, 65, 1, 1, 3)).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

// A Forward whose answer is over --max_message_mb is refused before anything is written
// (before, the K/V were committed and the answer then failed to send).
TEST(MessageLimitTest, OverLimitAnswerCommitsNothing) {
  ServerOptions o = CpuOptions();
  o.max_message_bytes = 1 << 20;
  auto server = *PagedAttnServer::Start(o);
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string cache = client->CreateCache(Config(512))->cache_id();
  // 1009 tokens, then one more with 510 queries and their lse: the request (q: 510 x 8 x 128
  // bf16 = 1044480 bytes) is under 1 MiB, the answer (q's bytes plus 16320 of lse) over it.
  constexpr int kTokens = 1009;
  ASSERT_TRUE(client->Forward(Request(cache, 1, 0, kTokens, 0, 1)).ok());
  v1::ForwardRequest req = Request(cache, 1, kTokens, 1, 510, 2);
  req.mutable_options()->set_return_lse(true);
  ASSERT_LT(req.ByteSizeLong(), size_t{1} << 20);
  absl::StatusOr<v1::ForwardResponse> r = client->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("--max_message_mb"), std::string::npos) << r.status();
  // The appended token was not committed: the sequence is still kTokens long.
  EXPECT_EQ(client->Forward(Request(cache, 1, kTokens + 1, 1, 1, 3)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(client->Forward(Request(cache, 1, kTokens, 1, 1, 3)).ok());
}

// An answer its client does not read keeps its bytes in the Forward data budget until it is sent
// or its call ends: other callers are refused (the server busy) instead of the process growing
// past --request_memory_mb with unsent answers; once the call is cancelled they run again.
TEST(RequestMemoryTest, UnreadAnswersHoldTheBudgetUntilTheirCallEnds) {
  ServerOptions o = CpuOptions();
  o.request_memory_bytes = 32 << 20;
  auto server = *PagedAttnServer::Start(o);
  auto client = ConnectTo(*server, absl::Seconds(60));
  constexpr int kSeqs = 768, kTokens = 4;
  const std::string cache = client->CreateCache(Config(kSeqs + 1))->cache_id();
  // kSeqs sequences of kTokens tokens, every one queried, q in float32: a 15 MB request (under
  // gRPC's quota: the same 32 MiB and a read), staged whole, and a 12.6 MB answer (float32, like
  // q): more than the whole budget, so that it runs alone.
  v1::ForwardRequest big;
  big.set_cache_id(cache);
  for (int i = 0; i < kSeqs; ++i) {
    v1::Span* s = big.add_spans();
    s->set_seq_id(i + 1);
    s->set_num_new_tokens(kTokens);
    s->set_num_queries(kTokens);
  }
  const int64_t rows = int64_t{kSeqs} * kTokens;
  *big.mutable_q() = MakeTensor(v1::FLOAT32, {rows, kHeads, kHeadDim},
                                Random(static_cast<size_t>(rows) * kHeads * kHeadDim, 1));
  *big.mutable_k() = MakeTensor(v1::BFLOAT16, {rows, kKvHeads, kHeadDim},
                                Random(static_cast<size_t>(rows) * kKvHeads * kHeadDim, 2));
  *big.mutable_v() = MakeTensor(v1::BFLOAT16, {rows, kKvHeads, kHeadDim},
                                Random(static_cast<size_t>(rows) * kKvHeads * kHeadDim, 3));
  // Sent on a channel of its own whose stream window stays at 64 KiB, and never read.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server->port()),
                                           grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  std::string bytes;
  ASSERT_TRUE(big.SerializeToString(&bytes));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(&ctx, "/pagedattn.v1.AttentionService/Forward", request, &cq);
  call->StartCall();
  // Sends the request (gRPC batches a unary call's sends with its first read) and reads the
  // initial metadata only; the queue is polled (it moves this channel's bytes), the answer never
  // asked for.
  call->ReadInitialMetadata(reinterpret_cast<void*>(1));
  std::thread poller([&cq] {
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
    }
  });
  // The Forward has run (committed, counted in the cache's forward_calls): from here what holds
  // the budget is its answer, which is never read.
  for (int i = 0; i < 2000 && OnlyCacheStats(*server).forward_calls < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(OnlyCacheStats(*server).forward_calls, 1);
  ASSERT_EQ(OnlyCacheStats(*server).used_pages, kSeqs);
  const v1::ForwardRequest small = Request(cache, kSeqs + 1, 0, 1, 1, 4);
  absl::StatusOr<v1::ForwardResponse> r = client->Forward(small);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("the server is busy"), std::string::npos) << r.status();
  // What the unread call holds: its request and what it staged, q, k and v each in a buffer of
  // its own, and its answer (out, float32 like q). Counting k and v as one buffer left 1.6 MB of
  // a Forward's memory outside the budget.
  const size_t held =
      bytes.size() + 2 * big.q().data().size() + big.k().data().size() + big.v().data().size();
  EXPECT_NE(r.status().message().find(absl::StrCat(held, " bytes of request memory are in use")),
            std::string::npos)
      << "want " << held << " held: " << r.status();
  // The unread call ends: its answer's bytes leave the budget and the others run again.
  ctx.TryCancel();
  for (int i = 0; i < 200; ++i) {
    r = client->Forward(small);
    if (r.status().code() != absl::StatusCode::kResourceExhausted) break;
    absl::SleepFor(absl::Milliseconds(25));
  }
  EXPECT_TRUE(r.ok()) << r.status();
  call.reset();
  cq.Shutdown();
  poller.join();
}

// gRPC runs a unary handler with no request at all when it reset the call's stream before its
// message arrived whole, as it does when the requests in flight pass --request_memory_mb (its
// client gets RESOURCE_EXHAUSTED). Counted and logged as the caller's INVALID_ARGUMENT, that
// pressure showed only as bad requests in the metrics and nowhere in the log at info.
TEST(RequestMemoryTest, ARequestThatNeverArrivedIsTheTransportsRefusal) {
  ReceivedForward received;
  const absl::Status s = ParseForward(grpc::ByteBuffer(), 65536, &received);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--request_memory_mb"), std::string::npos) << s;
}

// 64 layers x 1024 q heads of sinks: 65536 values, 256 KiB a config, on one page.
v1::CacheConfig ManySinksConfig() {
  v1::CacheConfig c;
  c.set_num_layers(64);
  c.set_num_q_heads(1024);
  c.set_num_kv_heads(32);
  c.set_head_dim(64);
  c.set_page_size(1);
  c.set_kv_dtype(v1::BFLOAT16);
  c.set_num_pages(1);
  v1::LayerAttention* layer = c.add_layers();
  for (int h = 0; h < 1024; ++h) layer->add_sinks(0.25f * h);
  return c;
}

// Caches whose configs hold many sinks make a long listing: ListCaches answers in pages that fit
// the largest message (or page_size), each with the token for the next, which holds where
// caches were deleted in between; the client follows them to the end.
TEST(ListCachesTest, PagesFitTheLargestMessageAndGoOnAfterDeletions) {
  ServerOptions o = CpuOptions();
  o.max_message_bytes = 1 << 20;
  auto server = *PagedAttnServer::Start(o);
  auto client = ConnectTo(*server, absl::Seconds(60));
  const v1::CacheConfig c = ManySinksConfig();  // five over 1 MiB
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<v1::CacheInfo> info = client->CreateCache(c);
    ASSERT_TRUE(info.ok()) << info.status();
    ids.push_back(info->cache_id());
  }
  auto ids_of = [](const auto& caches) {
    std::vector<std::string> out;
    for (const v1::CacheInfo& i : caches) out.push_back(i.cache_id());
    return out;
  };
  absl::StatusOr<std::vector<v1::CacheInfo>> all = client->ListCaches();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(ids_of(*all), ids);

  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials()));
  auto list = [&](int32_t page_size, const std::string& token, v1::ListCachesResponse* resp) {
    grpc::ClientContext ctx;
    v1::ListCachesRequest req;
    req.set_page_size(page_size);
    req.set_page_token(token);
    return stub->ListCaches(&ctx, req, resp);
  };
  v1::ListCachesResponse first;
  ASSERT_TRUE(list(0, "", &first).ok());  // as many as fit 1 MiB: three
  EXPECT_EQ(first.caches_size(), 3);
  EXPECT_LE(first.ByteSizeLong(), size_t{1} << 20);
  ASSERT_FALSE(first.next_page_token().empty());
  v1::ListCachesResponse page;
  ASSERT_TRUE(list(2, "", &page).ok());
  EXPECT_EQ(ids_of(page.caches()), std::vector<std::string>(ids.begin(), ids.begin() + 2));
  // The next page's first cache deleted in between: the listing goes on after it.
  ASSERT_TRUE(client->DeleteCache(ids[2]).ok());
  const std::string token = page.next_page_token();
  page.Clear();
  ASSERT_TRUE(list(2, token, &page).ok());
  EXPECT_EQ(ids_of(page.caches()), std::vector<std::string>(ids.begin() + 3, ids.end()));
  EXPECT_TRUE(page.next_page_token().empty());
  // What no answer gave is refused, naming the field.
  grpc::Status st = list(0, "not-a-token", &page);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("page_token"), std::string::npos) << st.error_message();
  st = list(-1, "", &page);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("page_size"), std::string::npos) << st.error_message();
}

// GetServerInfo says the limits the server was started with, and what its pool budget leaves,
// so that a client sizes its requests to them (a prefill chunked to max_forward_tokens) rather
// than learn them from errors.
TEST(ServerInfoTest, ReportsTheServersLimits) {
  ServerOptions o = CpuOptions();
  o.max_message_bytes = 8 << 20;
  o.limits.max_caches_per_tenant = 3;
  o.limits.max_total_pool_bytes = 64 << 20;
  o.limits.forward.max_tokens = 1000;
  o.limits.forward.max_spans = 50;
  o.cache_idle_timeout = absl::Seconds(600);
  auto server = *PagedAttnServer::Start(o);
  auto client = ConnectTo(*server, absl::Seconds(60));
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const v1::ServerLimits& l = info->limits();
  EXPECT_EQ(l.max_forward_tokens(), 1000);
  EXPECT_EQ(l.max_forward_spans(), 50);
  EXPECT_EQ(l.max_message_bytes(), 8 << 20);
  EXPECT_EQ(l.max_caches_per_tenant(), 3);
  EXPECT_EQ(l.max_total_pool_bytes(), 64 << 20);
  EXPECT_EQ(l.pool_free_bytes(), 64 << 20);  // the budget, far below the host's free memory
  EXPECT_EQ(l.cache_idle_timeout_s(), 600);
  absl::StatusOr<v1::CacheInfo> cache = client->CreateCache(Config(4));
  ASSERT_TRUE(cache.ok()) << cache.status();
  info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->limits().pool_free_bytes(), (64 << 20) - cache->bytes());
}

// With page_size 0 a page fits gRPC's default 4 MiB receive limit, whatever --max_message_mb:
// a client that never raised its limit can list 17 caches of 256 KiB configs (pages sized to
// the server's 512 MiB made it RESOURCE_EXHAUSTED).
TEST(ListCachesTest, PagesFitAClientsDefaultReceiveLimit) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(60));
  const v1::CacheConfig c = ManySinksConfig();
  for (int i = 0; i < 17; ++i) ASSERT_TRUE(client->CreateCache(c).ok()) << i;
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials()));
  size_t listed = 0;
  std::string token;
  int pages = 0;
  do {
    grpc::ClientContext ctx;
    v1::ListCachesRequest req;
    req.set_page_token(token);
    v1::ListCachesResponse page;
    const grpc::Status st = stub->ListCaches(&ctx, req, &page);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_LE(page.ByteSizeLong(), size_t{4} << 20);
    listed += page.caches_size();
    token = page.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(listed, 17u);
  EXPECT_EQ(pages, 2);
}

// Error texts that quote request data stay short: a 20 kB id or a 5000-dim shape gets its
// NOT_FOUND / INVALID_ARGUMENT, and other calls on the same connection keep working (an
// error text over the client's 8 KiB metadata limit used to break the connection).
TEST_F(HardeningTest, LongValuesInErrorsDoNotBreakTheConnection) {
  std::atomic<bool> done{false};
  std::atomic<int> good_failures{0}, good_calls{0};
  std::thread good([&] {
    while (!done.load()) {
      if (!client_->GetServerInfo().ok()) ++good_failures;
      ++good_calls;
    }
  });
  const std::string long_id(20000, 'a');
  v1::ForwardRequest wide = Request(cache_, 9, 0, 1, 1, 1);
  wide.mutable_q()->clear_shape();
  for (int i = 0; i < 5000; ++i) wide.mutable_q()->add_shape(1);
  for (int i = 0; i < 30; ++i) {
    absl::StatusOr<v1::CacheInfo> r = client_->GetCache(long_id);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status().code();
    EXPECT_LT(r.status().message().size(), 200u);
    absl::StatusOr<v1::ForwardResponse> f = client_->Forward(wide);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status().code();
    EXPECT_LT(f.status().message().size(), 1100u);
  }
  done = true;
  good.join();
  EXPECT_GT(good_calls.load(), 0);
  EXPECT_EQ(good_failures.load(), 0);
}

// A name with a newline could forge a log line: names are printable ASCII, and request text
// that reaches a log (a cache id) is escaped.
TEST_F(HardeningTest, LogLinesCannotBeForged) {
  testing::LogCapture captured(spdlog::level::debug);
  absl::StatusOr<v1::CacheInfo> named = client_->CreateCache(Config(4), "ok\nFORGED info line");
  (void)client_->GetCache("x\nFORGED2 info line");
  EXPECT_EQ(named.status().code(), absl::StatusCode::kInvalidArgument) << named.status();
  EXPECT_NE(named.status().message().find("printable"), std::string::npos);
  const std::string log = captured.str();
  std::istringstream lines(log);
  std::string line;
  while (std::getline(lines, line)) EXPECT_NE(line.rfind("FORGED", 0), 0u) << line;
  EXPECT_NE(log.find("x\\nFORGED2"), std::string::npos) << log;
  // 100 characters of two bytes each: refused for what they are, not as 200 "characters".
  std::string accented;
  for (int i = 0; i < 100; ++i) accented += "\xc3\xa9";  // U+00E9 in UTF-8
  named = client_->CreateCache(Config(4), accented);
  EXPECT_EQ(named.status().code(), absl::StatusCode::kInvalidArgument) << named.status();
  EXPECT_NE(named.status().message().find("printable ASCII"), std::string::npos) << named.status();
}

// A call's x-request-id metadata is on its log lines (escaped as one field, and cut), so that
// an orchestrator's failed call can be found in the server's log; a call without one has none.
TEST_F(HardeningTest, LogLinesCarryTheRequestId) {
  testing::LogCapture captured(spdlog::level::debug);
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  auto get = [&](const std::string& cache_id, const std::string& request_id) {
    grpc::ClientContext ctx;
    if (!request_id.empty()) ctx.AddMetadata(std::string(kRequestIdKey), request_id);
    v1::GetCacheRequest req;
    req.set_cache_id(cache_id);
    v1::CacheInfo resp;
    return stub->GetCache(&ctx, req, &resp);
  };
  EXPECT_TRUE(get(cache_, "step-41-layer-7").ok());
  const std::string long_id(100, 'r');
  EXPECT_EQ(get("no-such-cache", long_id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(get("unnamed-call", "").error_code(), grpc::StatusCode::NOT_FOUND);
  // Values that would write fields of their own into the line.
  EXPECT_EQ(
      get("forged x tenant=acme", "x tenant=acme peer=ipv4:10.1.2.3:443 req=\\y").error_code(),
      grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx;
  ctx.AddMetadata(std::string(kRequestIdKey), "create-1");
  v1::CreateCacheRequest create;
  *create.mutable_config() = Config(4);
  create.set_name("x' req=forged \\");  // a quote that would end the name's quotes
  v1::CacheInfo created;
  ASSERT_TRUE(stub->CreateCache(&ctx, create, &created).ok());

  const std::string log = captured.str();
  auto line_of = [&](const std::string& needle) {
    std::istringstream lines(log);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.find(needle) != std::string::npos) return line;
    }
    return std::string();
  };
  EXPECT_NE(line_of("rpc GetCache cache=" + cache_).find(" req=step-41-layer-7 ok"),
            std::string::npos)
      << log;
  // Cut as all request text is (gRPC itself refuses control characters in metadata values).
  EXPECT_NE(line_of("cache=no-such-cache")
                .find(absl::StrCat(" req=", long_id.substr(0, 64), "...(100 bytes) NOT_FOUND")),
            std::string::npos)
      << log;
  const std::string forged = line_of("cache=forged");
  EXPECT_NE(forged.find("cache=forged\\x20x\\x20tenant=acme peer="), std::string::npos) << log;
  EXPECT_NE(forged.find(" req=x\\x20tenant=acme\\x20peer=ipv4:10.1.2.3:443\\x20req=\\x5cy "),
            std::string::npos)
      << log;
  // The fields end where the message (free text, quoting the id as the caller was told) starts.
  EXPECT_EQ(forged.substr(0, forged.find(" ms: ")).find(" tenant="), std::string::npos) << forged;
  const std::string unnamed = line_of("cache=unnamed-call");
  ASSERT_FALSE(unnamed.empty()) << log;
  EXPECT_EQ(unnamed.find("req="), std::string::npos) << unnamed;
  const std::string created_line = line_of("created cache " + created.cache_id());
  EXPECT_NE(created_line.find(" 'x\\x27 req=forged \\x5c' peer="), std::string::npos) << log;
  EXPECT_NE(created_line.find(" req=create-1:"), std::string::npos) << log;
}

// The lines of `log` that contain `needle`.
std::vector<std::string> LinesWith(const std::string& log, const std::string& needle) {
  std::vector<std::string> found;
  std::istringstream lines(log);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find(needle) != std::string::npos) found.push_back(line);
  }
  return found;
}

// One decode token of a new sequence of the fixture's cache (zeros), and the buffer its answer
// needs.
struct DecodeToken {
  std::vector<uint16_t> q = std::vector<uint16_t>(kHeads * kHeadDim);
  std::vector<uint16_t> kv = std::vector<uint16_t>(kKvHeads * kHeadDim);
  std::vector<uint16_t> out = std::vector<uint16_t>(kHeads * kHeadDim);

  ForwardCall Call(const std::string& cache, uint64_t seq) const {
    ForwardCall call;
    call.cache_id = cache;
    call.spans = {{seq, 0, 1, 1}};
    call.q = TensorArg::Host(v1::BFLOAT16, {1, kHeads, kHeadDim}, q.data(), q.size() * 2);
    call.k = TensorArg::Host(v1::BFLOAT16, {1, kKvHeads, kHeadDim}, kv.data(), kv.size() * 2);
    call.v = call.k;
    return call;
  }
  ForwardOutput Output() { return {out.data(), out.size() * 2}; }
};

// pagedattn::RequestId: every call its thread makes while it lives carries its id (unary calls,
// ForwardTensors, the messages of a Step stream opened then), the innermost of nested ones
// wins, and calls outside any carry none: the server's line for each call says which.
TEST_F(HardeningTest, ClientRequestIdReachesTheServersLog) {
  static_assert(std::string_view(RequestId::kMetadataKey) == std::string_view(kRequestIdKey));
  testing::LogCapture captured(spdlog::level::debug);
  DecodeToken token;
  EXPECT_EQ(RequestId::Current(), nullptr);
  ASSERT_TRUE(client_->GetServerInfo().ok());  // outside any
  {
    RequestId outer("step-41");
    ASSERT_NE(RequestId::Current(), nullptr);
    EXPECT_EQ(*RequestId::Current(), "step-41");
    ASSERT_TRUE(client_->GetCache(cache_).ok());
    ASSERT_TRUE(client_->ForwardTensors(token.Call(cache_, 1), token.Output()).ok());
    std::unique_ptr<StepStream> step;
    {
      RequestId inner("step-41-layer-7");
      EXPECT_EQ(*RequestId::Current(), "step-41-layer-7");
      EXPECT_EQ(client_->GetCache("in-inner").status().code(), absl::StatusCode::kNotFound);
      // Another thread has its own (none).
      std::thread([] { EXPECT_EQ(RequestId::Current(), nullptr); }).join();
      absl::StatusOr<std::unique_ptr<StepStream>> opened = client_->OpenStep();
      ASSERT_TRUE(opened.ok()) << opened.status();
      step = *std::move(opened);
    }
    EXPECT_EQ(*RequestId::Current(), "step-41");
    EXPECT_EQ(client_->GetCache("outer-again").status().code(), absl::StatusCode::kNotFound);
    // Sent under the outer id: the stream carries the one in force when it was opened.
    ASSERT_TRUE(step->Send(token.Call(cache_, 2)).ok());
    absl::StatusOr<ForwardReply> reply = step->Receive(token.Output());
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_TRUE(step->Close().ok());
  }
  EXPECT_EQ(RequestId::Current(), nullptr);
  EXPECT_EQ(client_->GetCache("after-all").status().code(), absl::StatusCode::kNotFound);
  WaitIdle();

  const std::string log = captured.str();
  auto only_line = [&](const std::string& needle) {
    const std::vector<std::string> lines = LinesWith(log, needle);
    EXPECT_EQ(lines.size(), 1u) << needle << " in:\n" << log;
    return lines.empty() ? std::string() : lines[0];
  };
  const std::string info = only_line("rpc GetServerInfo ");
  EXPECT_EQ(info.find("req="), std::string::npos) << info;
  EXPECT_NE(only_line("rpc GetCache cache=" + cache_).find(" req=step-41 ok"), std::string::npos)
      << log;
  EXPECT_NE(only_line("rpc Forward cache=" + cache_).find(" req=step-41 ok"), std::string::npos)
      << log;
  EXPECT_NE(only_line("cache=in-inner ").find(" req=step-41-layer-7 NOT_FOUND"), std::string::npos)
      << log;
  EXPECT_NE(only_line("cache=outer-again ").find(" req=step-41 NOT_FOUND"), std::string::npos)
      << log;
  EXPECT_NE(only_line("rpc Step cache=" + cache_).find(" req=step-41-layer-7 ok"),
            std::string::npos)
      << log;
  const std::string after = only_line("cache=after-all ");
  EXPECT_EQ(after.find("req="), std::string::npos) << after;
}

// An id gRPC cannot send (it would abort the process on a line end) fails each call made under
// it with INVALID_ARGUMENT, unsent; so do an empty one and one over 256 bytes.
TEST_F(HardeningTest, AClientRequestIdThatCannotBeSentFailsTheCallsUnsent) {
  testing::LogCapture captured(spdlog::level::debug);
  DecodeToken token;
  {
    RequestId bad("step-41\nforged");
    const absl::Status s = client_->GetCache(cache_).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("byte 0x0a at position 7 of 14 of the request id"),
              std::string::npos)
        << s;
    EXPECT_EQ(client_->ForwardTensors(token.Call(cache_, 1), token.Output()).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(client_->OpenStep().status().code(), absl::StatusCode::kInvalidArgument);
    RequestId empty("");
    EXPECT_EQ(client_->GetCache(cache_).status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    // 8 KiB of id reset the connection, failing other threads' calls on it too.
    RequestId too_long(std::string(RequestId::kMaxBytes + 1, 'r'));
    const absl::Status s = client_->GetCache(cache_).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("the request id is 257 bytes: at most 256"), std::string::npos) << s;
  }
  {
    RequestId longest(std::string(RequestId::kMaxBytes, 'r'));
    ASSERT_TRUE(client_->GetCache(cache_).ok());
  }
  ASSERT_TRUE(client_->GetCache(cache_).ok());
  WaitIdle();
  // Only the last two calls reached the server.
  EXPECT_EQ(LinesWith(captured.str(), "rpc ").size(), 2u) << captured.str();
}

// A metrics endpoint that trickles its answer (a byte each 100 ms, for 5 s) cannot hold
// FetchMetrics past its timeout: the timeout bounds the whole answer, not each wait.
TEST(FetchMetricsTest, ATricklingAnswerEndsAtTheTimeout) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  std::atomic<bool> done{false};
  std::thread drip([&] {
    const int conn = accept(listener, nullptr, nullptr);
    for (int i = 0; i < 50 && !done && conn >= 0; ++i) {
      if (send(conn, "H", 1, MSG_NOSIGNAL) != 1) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (conn >= 0) close(conn);
  });
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::string> r =
      FetchMetrics(absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)), absl::Milliseconds(700));
  const absl::Duration took = absl::Now() - start;
  done = true;
  drip.join();
  close(listener);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_LT(took, absl::Seconds(2)) << "the fetch waited for the trickle";
}

// Every --listen address is reported as bound (the log line names them all), and the
// metrics fetch of pagedattn-cli and the load generator reaches an IPv6 listener and says why
// when it cannot.
TEST(ListenTest, EveryListenerAndIpv6MetricsAreReachable) {
  ServerOptions o = CpuOptions();
  o.listen = "127.0.0.1:0,127.0.0.1:0";
  auto plain = PagedAttnServer::Start(o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const std::vector<std::string>& bound = (*plain)->listening();
  ASSERT_EQ(bound.size(), 2u);
  EXPECT_EQ(bound[0], absl::StrCat("127.0.0.1:", (*plain)->port()));
  EXPECT_NE(bound[1], bound[0]);
  EXPECT_NE(bound[1], "127.0.0.1:0");
  // The gRPC port speaks HTTP/2 only: a fetch there is refused as such, not hung on.
  const absl::StatusOr<std::string> grpc_port = FetchMetrics(bound[1]);
  EXPECT_EQ(grpc_port.status().code(), absl::StatusCode::kUnavailable) << grpc_port.status();
  EXPECT_NE(grpc_port.status().message().find("not HTTP"), std::string::npos) << grpc_port.status();

  o.listen = "127.0.0.1:0";
  o.metrics_listen = "[::1]:0";
  auto server = PagedAttnServer::Start(o);
  if (!server.ok()) GTEST_SKIP() << "no IPv6 loopback here: " << server.status();
  const std::string target = absl::StrCat("[::1]:", (*server)->metrics_port());
  absl::StatusOr<std::string> text = FetchMetrics(target);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("pagedattn_rpcs_total"), std::string::npos);
  const absl::StatusOr<std::string> unbracketed =
      FetchMetrics(absl::StrCat("::1:", (*server)->metrics_port()));
  EXPECT_EQ(unbracketed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unbracketed.status().message().find("[brackets]"), std::string::npos)
      << unbracketed.status();
  const int port = (*server)->metrics_port();
  server->reset();  // nothing listens there now
  const absl::StatusOr<std::string> gone = FetchMetrics(target);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(gone.status().message().find(absl::StrCat("connect to [::1]:", port)),
            std::string::npos)
      << gone.status();
}

// Connections to /metrics that send nothing (or trickle) hold only themselves: with ten of them
// open a scrape is answered at once (read one connection at a time, each held its 2 s: this
// test took 12 s there).
TEST(MetricsTest, IdleConnectionsDoNotHoldAScrape) {
  ServerOptions o = CpuOptions();
  o.metrics_listen = "127.0.0.1:0";
  auto server = *PagedAttnServer::Start(o);
  std::vector<int> idle;
  for (int i = 0; i < 10; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(server->metrics_port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(send(fd, "GET /met", 8, 0), 8);  // a request that never ends
    idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> text =
      FetchMetrics(absl::StrCat("127.0.0.1:", server->metrics_port()));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_LT(took, absl::Milliseconds(1000)) << took;
  EXPECT_NE(text->find("pagedattn_forward_latency_seconds_count 0"), std::string::npos);
  for (int fd : idle) close(fd);
}

// ---- The /metrics HTTP server ----------------------------------------------------------------

// A TCP connection to port on `to` (IPv4 or IPv6 text), from `from` when given; -1 if it fails.
// rcvbuf > 0 shrinks the receive buffer first (a client that reads nothing fills it at once).
int ConnectTcp(const std::string& to, int port, const std::string& from = "", int rcvbuf = 0) {
  const bool v6 = to.find(':') != std::string::npos;
  const int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  sockaddr_storage a = {};
  socklen_t len = 0;
  auto fill = [&](const std::string& ip, int p) {
    a = {};
    if (v6) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&a);
      a6->sin6_family = AF_INET6;
      a6->sin6_port = htons(static_cast<uint16_t>(p));
      len = sizeof(*a6);
      return inet_pton(AF_INET6, ip.c_str(), &a6->sin6_addr) == 1;
    }
    auto* a4 = reinterpret_cast<sockaddr_in*>(&a);
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<uint16_t>(p));
    len = sizeof(*a4);
    return inet_pton(AF_INET, ip.c_str(), &a4->sin_addr) == 1;
  };
  if (!from.empty() && (!fill(from, 0) || bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0)) {
    close(fd);
    return -1;
  }
  if (!fill(to, port) || connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends a GET of path on fd and reads until the server closes (or `limit` passes).
std::string Get(int fd, const std::string& path, absl::Duration limit = absl::Seconds(10)) {
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return "";
  }
  const timeval tv = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  const absl::Time end = absl::Now() + limit;
  char buf[65536];
  while (absl::Now() < end) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      break;
    }
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

std::unique_ptr<HttpServer> StartHttp(const std::string& listen, size_t body_bytes) {
  absl::StatusOr<std::unique_ptr<HttpServer>> s = HttpServer::Start(
      listen, "/metrics", "text/plain", [body_bytes] { return std::string(body_bytes, 'm'); });
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// Clients that ask for a large answer and read none of it hold only their own connections: a
// scrape beside four of them is answered whole at once. Written blocking, each such answer held
// the loop for seconds (its socket's 500 ms send timeout restarting at each partial write).
TEST(HttpServerTest, ClientsThatReadNothingDoNotHoldAScrape) {
  constexpr size_t kBody = size_t{8} << 20;
  std::unique_ptr<HttpServer> http = StartHttp("127.0.0.1:0", kBody);
  ASSERT_TRUE(http);
  std::vector<int> stuck;
  for (int i = 0; i < 4; ++i) {
    const int fd = ConnectTcp("127.0.0.1", http->port(), "", /*rcvbuf=*/1);
    ASSERT_GE(fd, 0);
    const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
    ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
    stuck.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  const int fd = ConnectTcp("127.0.0.1", http->port());
  ASSERT_GE(fd, 0);
  const std::string answer = Get(fd, "/metrics");
  const absl::Duration took = absl::Now() - start;
  close(fd);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200 OK", 0), 0u) << answer.substr(0, 100);
  EXPECT_GE(answer.size(), kBody);
  EXPECT_LT(took, absl::Milliseconds(1500)) << took;
  for (int s : stuck) close(s);
}

// When every slot is taken, the address holding the most connections gives one up: a flood of
// idle connections from 127.0.0.2 does not push out a scrape from 127.0.0.1 that connected
// before it (the oldest connection gave way, whoever held it).
TEST(HttpServerTest, OneAddressFloodingDoesNotPushOutAnother) {
  std::unique_ptr<HttpServer> http = StartHttp("127.0.0.1:0", 100);
  ASSERT_TRUE(http);
  const int probe = ConnectTcp("127.0.0.1", http->port(), "127.0.0.2");
  if (probe < 0) GTEST_SKIP() << "cannot connect from 127.0.0.2 here";
  close(probe);
  absl::SleepFor(absl::Milliseconds(50));
  const int scrape = ConnectTcp("127.0.0.1", http->port(), "127.0.0.1");
  ASSERT_GE(scrape, 0);
  absl::SleepFor(absl::Milliseconds(50));  // accepted first
  std::vector<int> flood;
  for (int i = 0; i < 80; ++i) {
    const int fd = ConnectTcp("127.0.0.1", http->port(), "127.0.0.2");
    ASSERT_GE(fd, 0);
    flood.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(200));  // all accepted (well within the 2 s request timeout)
  const std::string answer = Get(scrape, "/metrics", absl::Seconds(3));
  close(scrape);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200 OK", 0), 0u) << "[" << answer << "]";
  for (int fd : flood) close(fd);
}

// "0.0.0.0" (every interface, as the deployment files say) listens on IPv6 too where the host
// has it, as the gRPC ports do: getaddrinfo listed 0.0.0.0 first and IPv6 clients were refused.
TEST(HttpServerTest, EveryInterfaceIncludesIpv6) {
  const int v6 = socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 loop6 = {};
  loop6.sin6_family = AF_INET6;
  loop6.sin6_addr = in6addr_loopback;
  const bool has_v6 = v6 >= 0 && bind(v6, reinterpret_cast<sockaddr*>(&loop6), sizeof(loop6)) == 0;
  if (v6 >= 0) close(v6);
  if (!has_v6) GTEST_SKIP() << "no IPv6 loopback here";
  std::unique_ptr<HttpServer> http = StartHttp("0.0.0.0:0", 100);
  ASSERT_TRUE(http);
  for (const std::string to : {"::1", "127.0.0.1"}) {
    const int fd = ConnectTcp(to, http->port());
    ASSERT_GE(fd, 0) << "connect to " << to << ": " << std::strerror(errno);
    const std::string answer = Get(fd, "/metrics");
    close(fd);
    EXPECT_EQ(answer.rfind("HTTP/1.1 200 OK", 0), 0u) << to << ": " << answer;
  }
}

// An answer to HEAD carries its headers only, whatever its status (RFC 9110 9.3.2).
TEST(HttpServerTest, HeadAnswersCarryNoBody) {
  std::unique_ptr<HttpServer> http = StartHttp("127.0.0.1:0", 100);
  ASSERT_TRUE(http);
  for (const std::string path : {"/metrics", "/elsewhere"}) {
    const int fd = ConnectTcp("127.0.0.1", http->port());
    ASSERT_GE(fd, 0);
    const std::string request = absl::StrCat("HEAD ", path, " HTTP/1.1\r\n\r\n");
    ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
    std::string answer;
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) answer.append(buf, n);
    close(fd);
    EXPECT_EQ(answer.find("\r\n\r\n"), answer.size() - 4) << path << ": " << answer;
    EXPECT_NE(answer.find("Content-Length: "), std::string::npos) << answer;
  }
}

// The child of OutOfDescriptorsDoesNotSpin: exits 0 when the loop stayed idle.
[[noreturn]] void OutOfDescriptorsChild() {
  std::unique_ptr<HttpServer> http = StartHttp("127.0.0.1:0", 100);
  const int client = socket(AF_INET, SOCK_STREAM, 0);  // made while there are descriptors
  if (!http || client < 0) _exit(3);
  const rlimit tight = {64, 64};  // then every descriptor up to it taken
  if (setrlimit(RLIMIT_NOFILE, &tight) != 0) _exit(4);
  std::vector<int> hog;
  for (int fd; (fd = dup(client)) >= 0;) hog.push_back(fd);
  if (errno != EMFILE) _exit(5);
  sockaddr_in to = {};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(http->port()));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(client, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) _exit(6);
  absl::SleepFor(absl::Milliseconds(100));  // the loop sees it, fails to accept it
  timespec a = {}, b = {};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  absl::SleepFor(absl::Seconds(1));
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
  const double cpu_s = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
  fprintf(stderr, "cpu %.3f s\n", cpu_s);
  _exit(cpu_s < 0.3 ? 0 : 1);
}

// Out of descriptors, accept() fails and leaves the connection queued, the listener readable:
// the loop pauses accepting instead of spinning on it (a core at 100% for as long as it lasts).
// Run in a child process: its descriptor limit lowered, its CPU time over one second measured.
TEST(HttpServerTest, OutOfDescriptorsDoesNotSpin) {
  // A sanitizer's runtime opens descriptors of its own.
  if (kSanitized) GTEST_SKIP() << "a sanitizer's runtime needs descriptors of its own";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(OutOfDescriptorsChild(), ::testing::ExitedWithCode(0), "cpu");
}

// Throttled lines of many kinds (a kind per client connection) are capped together: a client
// opening a connection a call cannot fill the log; the next line says how many were held back.
TEST(ThrottledLogTest, ManyKindsAreCappedTogether) {
  absl::SleepFor(absl::Seconds(1.1));  // a second of its own (earlier tests' lines count too)
  testing::LogCapture captured(spdlog::level::info);
  for (int i = 0; i < 200; ++i) {
    LogThrottled(spdlog::level::info, absl::StrCat("peer-", i), absl::StrCat("line-of-", i, "."));
  }
  absl::SleepFor(absl::Seconds(1.1));  // the next second's budget
  LogThrottled(spdlog::level::info, "after", "the next line.");
  const std::string log = captured.str();
  int lines = 0;
  for (size_t at = log.find("line-of-"); at != std::string::npos;
       at = log.find("line-of-", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, kMaxThrottledLinesPerSecond) << log;
  EXPECT_NE(log.find("the next line. (180 throttled lines of all kinds held back before it)"),
            std::string::npos)
      << log;
}

// Counts no later line told are told a second on by FlushThrottledLog (the server's main calls
// it): a burst of one kind, and the lines of all kinds held back past the cap.
TEST(ThrottledLogTest, AFlushTellsTheCountsOfBurstsThatEnded) {
  absl::SleepFor(absl::Seconds(1.1));  // a second of its own (earlier tests' lines count too)
  testing::LogCapture captured(spdlog::level::info);
  for (int i = 0; i < 5; ++i) LogThrottled(spdlog::level::info, "burst", "a burst's line.");
  for (int i = 0; i < 40; ++i) {
    LogThrottled(spdlog::level::info, absl::StrCat("peer-", i), absl::StrCat("line-of-", i, "."));
  }
  FlushThrottledLog();  // too early: nothing yet
  EXPECT_EQ(captured.str().find("held back"), std::string::npos) << captured.str();
  absl::SleepFor(absl::Seconds(1.1));
  FlushThrottledLog();
  const std::string log = captured.str();
  EXPECT_NE(log.find("4 more held back in the last 1."), std::string::npos) << log;
  EXPECT_NE(log.find("s like it: a burst's line."), std::string::npos) << log;
  EXPECT_NE(log.find("] 21 throttled lines of all kinds held back"), std::string::npos) << log;
}

// A client's refusals of two kinds in one second are both logged: the throttle's kinds tell the
// errors apart by their words (out of pages, over the capacity), not only by their code.
TEST(ThrottledLogTest, RefusalsOfTwoKindsAreBothLogged) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string cache = client->CreateCache(Config(4))->cache_id();  // 64 tokens
  ASSERT_TRUE(client->Forward(Request(cache, 1, 0, 48, 1, 1)).ok());
  absl::SleepFor(absl::Seconds(1.1));  // a second of its own
  testing::LogCapture captured(spdlog::level::info);
  const absl::Status pages = client->Forward(Request(cache, 2, 0, 32, 1, 2)).status();
  const absl::Status capacity = client->Forward(Request(cache, 3, 0, 80, 1, 3)).status();
  EXPECT_EQ(pages.code(), absl::StatusCode::kResourceExhausted) << pages;
  EXPECT_EQ(capacity.code(), absl::StatusCode::kResourceExhausted) << capacity;
  const std::string log = captured.str();
  EXPECT_NE(log.find(std::string(pages.message().substr(0, 20))), std::string::npos) << log;
  EXPECT_NE(log.find(std::string(capacity.message().substr(0, 20))), std::string::npos) << log;
}

// Refusals of one kind that differ only in their numbers (this one needs 2 pages, that one 3)
// are one kind of line: the second is counted, not logged, so that a client retrying with other
// sizes cannot flood the log.
TEST(ThrottledLogTest, RefusalsThatDifferInTheirNumbersAreOneKind) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string cache = client->CreateCache(Config(4))->cache_id();  // 4 pages of 16 tokens
  ASSERT_TRUE(client->Forward(Request(cache, 1, 0, 48, 1, 1)).ok());     // 1 page left
  absl::SleepFor(absl::Seconds(1.1));                                    // a second of its own
  testing::LogCapture captured(spdlog::level::info);
  const absl::Status two = client->Forward(Request(cache, 2, 0, 32, 1, 2)).status();
  const absl::Status three = client->Forward(Request(cache, 3, 0, 48, 1, 3)).status();
  ASSERT_NE(two.message().find("needs 2 more pages"), std::string::npos) << two;
  ASSERT_NE(three.message().find("needs 3 more pages"), std::string::npos) << three;
  const std::string log = captured.str();
  int lines = 0;
  for (size_t at = log.find("out of KV pages"); at != std::string::npos;
       at = log.find("out of KV pages", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 1) << log;
}

// Shutdown says what it drains and how it ends: the calls in flight and the caches that go
// with the process, then the grace period running out and the calls it stops.
TEST(ShutdownLogTest, ShutdownSaysWhatItDrainsAndStops) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string cache = client->CreateCache(Config(512))->cache_id();
  WaitForCalls(*server, 0);
  testing::LogCapture captured(spdlog::level::info);
  std::thread slow([&] {  // seconds of CPU attention: still running when the grace runs out
    (void)client->Forward(Request(cache, 1, 0, kLongTokens, kLongTokens, 1));
  });
  WaitForCalls(*server, 1);
  server->Shutdown(absl::Milliseconds(400));
  slow.join();
  const std::string log = captured.str();
  EXPECT_NE(log.find("draining: 1 call in flight; 1 cache ("), std::string::npos) << log;
  EXPECT_NE(log.find("the grace period ran out with 1 call in flight: stopping them"),
            std::string::npos)
      << log;
}

// A CreateCache whose caller gives up while the pool is faulted in leaves no cache behind.
TEST(CreateCacheTest, CallerThatGivesUpLeavesNoCache) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto hurried = ConnectTo(*server, absl::Milliseconds(20));
  v1::CacheConfig big = Config(0);
  big.set_max_bytes(int64_t{3} << 30);  // seconds of page faults
  absl::StatusOr<v1::CacheInfo> r = hurried->CreateCache(big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  WaitForCalls(*server, 0);
  EXPECT_TRUE(server->manager().ListAll().empty());
}

// One unary call of raw bytes: its status, and the answer's bytes in *answer.
grpc::Status RawUnary(const PagedAttnServer& server, const std::string& method,
                      const std::string& bytes, std::string* answer = nullptr) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server.port()),
                                           grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  if (answer != nullptr && status.ok()) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(response.Dump(&slices).ok());
    answer->clear();
    for (const grpc::Slice& sl : slices) {
      answer->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// With --request_memory_mb equal to --max_message_mb, a request of nearly the largest size
// arrives whole: gRPC's quota holds a socket read beside the message. A quota of exactly the
// budget reset such a request's stream 4 times in 10 at 64 KiB under the limit and every time at
// 4 KiB, its client told nothing but RST_STREAM.
TEST(RequestMemoryTest, ARequestNearTheMessageLimitArrivesWithTheBudgetAtThatLimit) {
  ServerOptions o = CpuOptions();
  o.max_message_bytes = 16 << 20;
  o.request_memory_bytes = 16 << 20;
  auto server = *PagedAttnServer::Start(o);
  for (const int under : {64 << 10, 4 << 10, 64}) {
    for (int i = 0; i < 3; ++i) {
      // Field 1 (an empty cache_id), then a zero tag: no ForwardRequest, which the server can
      // say only once the bytes arrived.
      std::string bytes(static_cast<size_t>(o.max_message_bytes - under), '\0');
      bytes[0] = '\x0a';
      const grpc::Status s = RawUnary(*server, "/pagedattn.v1.AttentionService/Forward", bytes);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << under << " bytes under the limit: " << s.error_message();
      EXPECT_NE(s.error_message().find("not a pagedattn.v1.ForwardRequest"), std::string::npos)
          << s.error_message();
    }
  }
}

// n copies of a two-byte field: tag (field 15 when `unknown`, else `field`) and a zero length or
// value, or a group's start and end.
std::string TwoByteFields(int field, int wire_type, size_t n) {
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += static_cast<char>((field << 3) | wire_type);
    out += static_cast<char>(wire_type == 3 ? (field << 3) | 4 : 0);
  }
  return out;
}

size_t HeapInUse() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

// The memory a request is held to while its call runs (kParsedBytesPerRequestByte a byte) covers
// protobuf's parse of each request this server reads at its worst (entries of every repeated
// field with nothing in them, unknown fields of every kind) in half of it, and with a config's
// copy into the core (FromProto) in all of it. Measured as the heap grows (with a sanitizer's
// allocator, as protobuf counts it, plus a half for the allocator's overhead).
TEST(ControlRequestTest, ParsedRequestsTakeAtMostTheMemoryHeldForThem) {
  std::vector<const google::protobuf::Descriptor*> requests;
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "pagedattn.v1.AttentionService");
  ASSERT_NE(service, nullptr);
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string& name = service->method(i)->name();
    if (name == "Forward" || name == "Step") continue;  // read by common/wire, never parsed
    requests.push_back(service->method(i)->input_type());
  }
  requests.push_back(HealthCheckRequest::descriptor());
  requests.push_back(grpc::reflection::v1alpha::ServerReflectionRequest::descriptor());
  constexpr size_t kFields = 1 << 18;  // 512 KiB of fields
  int cases = 0;
  double worst = 0, worst_with_copy = 0;
  for (const google::protobuf::Descriptor* type : requests) {
    std::vector<std::string> wires = {TwoByteFields(15, 0, kFields), TwoByteFields(15, 2, kFields),
                                      TwoByteFields(15, 3, kFields)};
    for (int f = 0; f < type->field_count(); ++f) {
      const google::protobuf::FieldDescriptor* field = type->field(f);
      const bool message = field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE;
      if (message || field->is_repeated()) {
        // Empty messages, or a repeated scalar's values one at a time (zero, unpacked).
        wires.push_back(TwoByteFields(field->number(), message ? 2 : 0, kFields));
      }
      // A message field's entries, each holding empty entries of its own repeated fields.
      if (message) {
        for (int g = 0; g < field->message_type()->field_count(); ++g) {
          const google::protobuf::FieldDescriptor* inner = field->message_type()->field(g);
          if (!inner->is_repeated()) continue;
          const std::string entry =
              TwoByteFields(inner->number(), inner->message_type() ? 2 : 0, 8);
          std::string wire;
          for (size_t i = 0; i < kFields / 9; ++i) {
            wire += static_cast<char>((field->number() << 3) | 2);
            wire += static_cast<char>(entry.size());
            wire += entry;
          }
          wires.push_back(wire);
        }
      }
    }
    const google::protobuf::Message* prototype =
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(type);
    for (const std::string& wire : wires) {
      const size_t before = HeapInUse();
      std::unique_ptr<google::protobuf::Message> parsed(prototype->New());
      ASSERT_TRUE(parsed->ParseFromString(wire)) << type->full_name();
      const size_t used = kSanitized ? parsed->SpaceUsedLong() * 3 / 2 : HeapInUse() - before;
      const double per_byte = static_cast<double>(used) / static_cast<double>(wire.size());
      worst = std::max(worst, per_byte);
      EXPECT_LE(per_byte, kParsedBytesPerRequestByte / 2)
          << type->full_name() << ": a parse of " << wire.size() << " bytes took " << used;
      // A config goes on into the core's own struct, beside the message.
      const v1::CacheConfig* config = nullptr;
      if (auto* c = dynamic_cast<const v1::CacheConfig*>(parsed.get())) config = c;
      if (auto* c = dynamic_cast<const v1::CreateCacheRequest*>(parsed.get())) {
        config = &c->config();
      }
      if (config != nullptr && !kSanitized) {
        const CacheConfigRequest core = FromProto(*config);
        const double with_copy = static_cast<double>(HeapInUse() - before) / wire.size();
        worst_with_copy = std::max(worst_with_copy, with_copy);
        EXPECT_LE(with_copy, kParsedBytesPerRequestByte)
            << type->full_name() << ": " << core.layers.size() << " layers";
      }
      ++cases;
    }
  }
  EXPECT_GE(cases, 40);
  std::cout << "worst parse: " << worst << " bytes a byte; with a config's copy " << worst_with_copy
            << "\n";
  // Not loose by much either: the worst parse takes over half of its half.
  EXPECT_GT(worst, kParsedBytesPerRequestByte / 4.0);
}

// The memory held for a request's call: refused while other requests hold the budget (retry),
// refused for good past a quarter of it, given back when the hold ends; small requests hold
// nothing, and a request up to kAlwaysParsedRequestBytes runs alone where its hold is more than
// the budget.
TEST(ControlRequestTest, AParseWaitsForRoomAndOneTooLargeNeverRuns) {
  constexpr int64_t kMiB = 1 << 20;
  ByteBudget budget(16 * kMiB * kParsedBytesPerRequestByte);  // one request up to 4 MiB
  ASSERT_EQ(MaxParsedRequestBytes(budget), 4 * kMiB);
  std::vector<ByteBudget::Hold> held;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<ByteBudget::Hold> h = HoldForParse(budget, "GetCache", 4 * kMiB);
    ASSERT_TRUE(h.ok()) << i << ": " << h.status();
    held.push_back(*std::move(h));
  }
  absl::StatusOr<ByteBudget::Hold> busy = HoldForParse(budget, "GetCache", kMiB);
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kResourceExhausted) << busy.status();
  EXPECT_NE(busy.status().message().find("the server is busy"), std::string::npos) << busy.status();
  EXPECT_TRUE(HoldForParse(budget, "GetCache", kUnheldRequestBytes).ok());  // holds nothing
  held.pop_back();                                                          // a call is over
  EXPECT_TRUE(HoldForParse(budget, "GetCache", 4 * kMiB).ok());
  absl::StatusOr<ByteBudget::Hold> huge = HoldForParse(budget, "GetCache", 4 * kMiB + 1);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_NE(huge.status().message().find(absl::StrCat("up to ", 4 * kMiB, " bytes")),
            std::string::npos)
      << huge.status();
  held.clear();
  EXPECT_EQ(budget.used(), 0);
  // The smallest budget still parses a request of a MiB, alone.
  ByteBudget small(16 * kMiB);
  EXPECT_EQ(MaxParsedRequestBytes(small), kAlwaysParsedRequestBytes);
  absl::StatusOr<ByteBudget::Hold> alone = HoldForParse(small, "CreateCache", kMiB);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_FALSE(HoldForParse(small, "CreateCache", kUnheldRequestBytes + 1).ok());
}

// Health checks, one every 5 ms until done() (at least 10; at most two minutes): each answered
// within 500 ms (2 s under a sanitizer).
void ExpectPromptHealthChecksUntil(const PagedAttnServer& server,
                                   const std::function<bool()>& done) {
  auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", server.port()), grpc::InsecureChannelCredentials()));
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  absl::Duration worst;
  int checks = 0;
  while (!done()) {
    ASSERT_LT(absl::Now(), give_up) << "the calls did not end";
    grpc::ClientContext ctx;
    HealthCheckRequest request;
    HealthCheckResponse response;
    const absl::Time start = absl::Now();
    ASSERT_TRUE(health->Check(&ctx, request, &response).ok());
    worst = std::max(worst, absl::Now() - start);
    ++checks;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GT(checks, 10);
  EXPECT_LT(worst, absl::Milliseconds(kSanitized ? 2000 : 500)) << checks << " checks";
}

// Control calls run on threads of their own: CreateCaches filling their pools (seconds on the
// CPU backend, taking turns on one lock) leave gRPC's few callback threads to health checks and
// Forwards. On those threads, three 3 GB CreateCaches held a health check for 15 s.
TEST(ControlRequestTest, SlowControlCallsLeaveHealthChecksPrompt) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  constexpr int kCreates = 12;
  std::atomic<int> created{0}, ended{0};
  std::vector<std::thread> creates;
  for (int i = 0; i < kCreates; ++i) {
    creates.emplace_back([&] {
      auto client = ConnectTo(*server, absl::Seconds(120));
      // 256 MiB pools: each filled in a fraction of a second, one after another.
      if (client->CreateCache(Config(16384)).ok()) ++created;
      ++ended;
    });
  }
  ExpectPromptHealthChecksUntil(*server, [&] { return ended.load() == kCreates; });
  for (std::thread& t : creates) t.join();
  EXPECT_EQ(created.load(), kCreates);
}

// CPU-backend Forwards (up to seconds each) run on threads of their own, not on gRPC's few
// callback threads: Forwards of one layer taking turns on its lock left no thread to answer
// health checks there (four held one 4.4 s, on the health port too).
TEST(ControlRequestTest, SlowCpuForwardsLeaveHealthChecksPrompt) {
  ServerOptions o = CpuOptions();
  o.backend.cpu_threads = 1;  // a core left for the health checks, as on a larger host
  auto server = *PagedAttnServer::Start(o);
  // Under a sanitizer (ten times slower and more) prefills of a ninth of the work.
  constexpr int kForwards = 6, kTokens = kSanitized ? 512 : 1536;
  const std::string cache =
      ConnectTo(*server, absl::Seconds(60))->CreateCache(Config(kForwards * 96))->cache_id();
  std::atomic<int> answered{0}, ended{0};
  std::vector<std::thread> forwards;
  for (int i = 0; i < kForwards; ++i) {
    forwards.emplace_back([&, i] {
      auto client = ConnectTo(*server, absl::Seconds(300));
      // One layer: the six take turns on its lock, each a prefill of kTokens queries.
      if (client->Forward(Request(cache, i + 1, 0, kTokens, kTokens, 10 * i)).ok()) ++answered;
      ++ended;
    });
  }
  for (int i = 0; i < 2000 && server->calls_in_flight() < 2 + kForwards / 2; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  // Meanwhile a Forward of another cache runs at once: the queue on one layer's lock does not
  // hold it (on four threads shared with the Step layers, a 1-token Forward of another cache
  // waited 1.4 s).
  auto client = ConnectTo(*server, absl::Seconds(60));
  const std::string other = client->CreateCache(Config(4))->cache_id();
  const absl::Time start = absl::Now();
  EXPECT_TRUE(client->Forward(Request(other, 1, 0, 1, 1, 7)).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(kSanitized ? 2000 : 500));
  ExpectPromptHealthChecksUntil(*server, [&] { return ended.load() >= kForwards - 1; });
  for (std::thread& t : forwards) t.join();
  EXPECT_EQ(answered.load(), kForwards);
}

// Joins the threads it is given at its end: a test that fails an ASSERT with calls running ends
// once they have, not in std::terminate.
struct JoinAtEnd {
  std::vector<std::thread>& threads;
  ~JoinAtEnd() {
    for (std::thread& t : threads) {
      if (t.joinable()) t.join();
    }
  }
};

// Starts a long Forward (kLongTokens on layer 0 of cache) on a thread of threads (a failure
// counted in failed), and waits until it holds the layer (its pages reserved): calls that came
// before would run first. Waits first for the calls in flight to end (a CreateCache counts until
// its answer has gone out).
void StartLongForward(const PagedAttnServer& server, Client& client, const std::string& cache,
                      std::atomic<int>& failed, std::vector<std::thread>& threads) {
  WaitForCalls(server, 0);
  threads.emplace_back([&client, &failed, cache] {
    if (!client.Forward(Request(cache, 1, 0, kLongTokens, kLongTokens, 1)).ok()) ++failed;
  });
  WaitForCalls(server, 1);
  auto reserved = [&] {
    for (const std::shared_ptr<Cache>& c : server.manager().ListAll()) {
      if (c->id() == cache) return c->Stats().used_pages;
    }
    return int64_t{0};
  };
  for (int i = 0; i < 2000 && reserved() < kLongTokens / 16; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(reserved(), kLongTokens / 16);
}

// The executor's threads take the owners (tenants) in turn, one task each: with its one thread
// held by a's task, a's three queued tasks, b's two and c's one run a, b, c, a, b, a, where in
// the order posted c's one waited for the five before it.
TEST(ExecutorTest, OwnersTakeTurns) {
  absl::Mutex mu;
  std::vector<std::string> order;
  auto note = [&](std::string e) {
    absl::MutexLock lock(&mu);
    order.push_back(std::move(e));
  };
  {
    Executor executor(1);
    absl::Notification running, release;
    executor.Post(
        [&] {
          running.Notify();
          release.WaitForNotification();
        },
        "a");
    running.WaitForNotification();
    for (int i = 0; i < 3; ++i) executor.Post([&, i] { note(absl::StrCat("a", i)); }, "a");
    executor.Post([&] { note("b0"); }, "b");
    executor.Post([&] { note("b1"); }, "b");
    executor.Post([&] { note("c0"); }, "c");
    release.Notify();
  }  // runs what is posted, then joins
  EXPECT_EQ(order, (std::vector<std::string>{"a0", "b0", "c0", "a1", "b1", "a2"}));
}

// SerialQueues over an executor of n threads, the executor destroyed first: it runs the tasks
// posted to it, whose ends need the queues.
struct QueuesOver {
  explicit QueuesOver(int threads)
      : executor(std::make_unique<Executor>(threads)), queues(executor.get()) {}
  ~QueuesOver() { executor.reset(); }
  std::unique_ptr<Executor> executor;
  SerialQueues queues;
};

// SerialQueues: a key's tasks run one at a time in the order posted, and those waiting hold no
// thread: with two threads, one held by a key's first task, the key's ten waiting tasks leave the
// other thread to another key. here: an idle key's task runs on the calling thread.
TEST(SerialQueuesTest, AKeysTasksRunInOrderAndWaitHoldingNoThread) {
  QueuesOver over(2);
  SerialQueues& queues = over.queues;
  absl::Notification release, other_ran;
  absl::Mutex mu;
  std::vector<int> order;
  std::atomic<int> running{0}, most{0};
  queues.Run({"", "g", "a"}, [&] { release.WaitForNotification(); });
  for (int i = 0; i < 10; ++i) {
    queues.Run({"", "g", "a"}, [&, i] {
      most = std::max(most.load(), ++running);
      absl::SleepFor(absl::Milliseconds(1));
      {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      }
      --running;
    });
  }
  queues.Run({"", "g", "b"}, [&] { other_ran.Notify(); });
  EXPECT_TRUE(other_ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (int i = 0; i < 1000 && queues.busy_keys() != 1; ++i) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(queues.busy_keys(), 1u);  // "a" only: "b" is done and gone
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(order.empty());
  }
  release.Notify();
  for (int i = 0; i < 10000 && queues.busy_keys() != 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(queues.busy_keys(), 0u);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(most.load(), 1);

  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  queues.Run(
      {"", "g", "c"}, [&] { ran_on = std::this_thread::get_id(); }, /*here=*/true);
  EXPECT_EQ(ran_on, caller);
  // A whole-group task's key is busy while it runs.
  size_t busy_while_whole = 0;
  queues.Run(
      {"", "g", "*/g", /*whole_group=*/true}, [&] { busy_while_whole = queues.busy_keys(); },
      /*here=*/true);
  EXPECT_EQ(busy_while_whole, 1u);
}

// A whole-group task (a cache's release) waits for the group's running tasks, and meanwhile the
// group's other keys start nothing (their tasks wait holding no thread, as the other group's
// task shows, on the second of two threads); it runs before them, they all run after it, and
// before a whole-group task that came after them.
TEST(SerialQueuesTest, AWholeGroupTaskRunsAloneAndHoldsBackItsGroup) {
  QueuesOver over(2);
  SerialQueues& queues = over.queues;
  absl::Notification release, other_ran;
  absl::Mutex mu;
  std::vector<std::string> events;
  auto note = [&](std::string e) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(e));
  };
  std::atomic<int> running{0};
  queues.Run({"", "g", "0/g"}, [&] {
    ++running;
    release.WaitForNotification();
    note("long");
    --running;
  });
  std::atomic<int> with_whole{-1};  // g's tasks running beside the whole-group one
  queues.Run({"", "g", "*/g", /*whole_group=*/true}, [&] {
    with_whole = running++;
    note("whole");
    --running;
  });
  for (int layer = 1; layer <= 20; ++layer) {
    queues.Run({"", "g", absl::StrCat(layer, "/g")},
               [&, layer] { note(absl::StrCat("layer ", layer)); });
  }
  // A whole-group task that comes after them runs after them (they do not wait for every
  // whole-group task there is, only for those that came before them).
  queues.Run({"", "g", "*2/g", /*whole_group=*/true}, [&] { note("whole 2"); });
  queues.Run({"", "h", "0/h"}, [&] { other_ran.Notify(); });
  EXPECT_TRUE(other_ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(events.empty());  // the long task runs; the rest of g waits
  }
  release.Notify();
  for (int i = 0; i < 10000 && queues.busy_keys() != 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(queues.busy_keys(), 0u);
  absl::MutexLock lock(&mu);
  ASSERT_EQ(events.size(), 23u);
  EXPECT_EQ(events[0], "long");
  EXPECT_EQ(events[1], "whole");
  EXPECT_EQ(events[22], "whole 2");
  EXPECT_EQ(with_whole.load(), 0);
}

// A group's tasks keep the order they came in wherever they conflict: a whole-group task (a
// release) runs after a task posted before it on a busy key (a Forward queued behind another on
// its layer), and a task posted after two whole-group tasks runs after both. Before, the release
// overtook the queued Forward (which then found its sequence gone), and the task after the
// releases overtook the second.
TEST(SerialQueuesTest, AGroupsTasksKeepTheirOrderAroundWholeGroupTasks) {
  QueuesOver over(4);
  SerialQueues& queues = over.queues;
  absl::Notification release;
  absl::Mutex mu;
  std::vector<std::string> events;
  auto note = [&](std::string e) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(e));
  };
  queues.Run({"", "g", "0/g"}, [&] {
    release.WaitForNotification();
    note("long");
  });
  queues.Run({"", "g", "0/g"}, [&] { note("queued on 0"); });
  auto whole = [&](std::string name) {
    queues.Run({"", "g", "*/g", /*whole_group=*/true}, [&, name] { note(name); });
  };
  whole("release");
  whole("release 2");
  queues.Run({"", "g", "1/g"}, [&] { note("after"); });
  absl::SleepFor(absl::Milliseconds(50));
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(events.empty());  // everything waits for the long task (the same key) or after it
  }
  release.Notify();
  for (int i = 0; i < 10000 && queues.busy_keys() != 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(queues.busy_keys(), 0u);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(events,
            (std::vector<std::string>{"long", "queued on 0", "release", "release 2", "after"}));
}

// Many tasks of a few groups and keys, some whole-group, posted from two threads (some to run
// where they are posted) onto eight: each starts only once every task posted before it that it
// conflicts with has ended, and all of them run.
TEST(SerialQueuesTest, EachTaskStartsAfterTheEarlierTasksItConflictsWith) {
  constexpr int kTasks = 3000;
  struct Posted {
    int group, key;
    bool whole;
  };
  std::vector<Posted> posted(kTasks);
  std::vector<std::atomic<bool>> ended(kTasks);
  std::atomic<int> order{0}, out_of_order{0}, ran{0};
  std::vector<std::atomic<int>> seq(kTasks);  // the order each was posted in
  for (std::atomic<int>& s : seq) s = -1;
  absl::Mutex post_mu;  // posting and numbering are one step
  {
    QueuesOver over(8);
    SerialQueues& queues = over.queues;
    auto post = [&](int i, bool here) {
      absl::MutexLock lock(&post_mu);
      const Posted p = posted[i];
      seq[i] = order++;
      const std::string group = absl::StrCat("g", p.group);
      const std::string key = p.whole ? absl::StrCat("*/", group) : absl::StrCat(p.key, "/", group);
      const int mine = seq[i];
      queues.Run(
          {absl::StrCat("tenant ", p.key % 2), group, key, p.whole},
          [&, i, mine] {
            // Every task posted before this one that it conflicts with has ended.
            for (int j = 0; j < kTasks; ++j) {
              if (j == i || posted[j].group != posted[i].group) continue;
              const bool conflicts =
                  posted[j].whole || posted[i].whole || posted[j].key == posted[i].key;
              const int other = seq[j];
              if (conflicts && other >= 0 && other < mine && !ended[j]) ++out_of_order;
            }
            absl::SleepFor(absl::Microseconds((i * 7919) % 50));
            ended[i] = true;
            ++ran;
          },
          here);
    };
    for (int i = 0; i < kTasks; ++i) {
      posted[i] = {(i * 31) % 3, (i * 17) % 4, (i * 13) % 11 == 0};
    }
    std::thread second([&] {
      for (int i = 1; i < kTasks; i += 2) post(i, /*here=*/false);
    });
    for (int i = 0; i < kTasks; i += 2) post(i, /*here=*/i % 6 == 0);
    second.join();
    over.executor.reset();  // runs what is posted, then joins
  }
  EXPECT_EQ(ran.load(), kTasks);
  EXPECT_EQ(out_of_order.load(), 0);
}

// Calls waiting for a layer of a cache hold no thread: while a long Forward holds layer 0 of one
// cache, and Forwards, truncations and Step layers of that layer queue behind it (more of each
// than the server has threads), the calls of another cache run at once. Where each waiting call
// held a thread, 16 queued Forwards held another tenant's Forward 5.4 s, 16 truncations a
// GetCache 4.5 s, and four Step streams another's Step 4.9 s.
TEST(ControlRequestTest, CallsWaitingForALayerHoldNoThread) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(300));
  constexpr int kQueued = 24, kSteps = 8;
  const std::string busy = client->CreateCache(Config(kLongTokens / 16 + 2 * kQueued))->cache_id();
  const std::string other = client->CreateCache(Config(4))->cache_id();
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  const JoinAtEnd join{threads};
  ASSERT_NO_FATAL_FAILURE(StartLongForward(*server, *client, busy, failed, threads));
  // One layer-0 Step message on cache, answered.
  auto step = [&](const std::string& cache, uint64_t seq) -> absl::Status {
    absl::StatusOr<std::unique_ptr<StepStream>> stream = client->OpenStep();
    if (!stream.ok()) return stream.status();
    const v1::ForwardRequest req = Request(cache, seq, 0, 1, 1, seq);
    if (absl::Status s = (*stream)->Send(random_script::CallOf(req, cache)); !s.ok()) return s;
    std::vector<char> out(req.q().data().size());
    absl::StatusOr<ForwardReply> r = (*stream)->Receive({out.data(), out.size()});
    if (!r.ok()) return r.status();
    return (*stream)->Close();
  };
  for (int i = 0; i < kQueued; ++i) {
    threads.emplace_back([&, i] {
      if (!client->Forward(Request(busy, 100 + i, 0, 1, 1, 10 + i)).ok()) ++failed;
    });
    threads.emplace_back([&] {
      if (!client->TruncateSequences(busy, 0, {{999, 0}}).ok()) ++failed;
    });
  }
  for (int i = 0; i < kSteps; ++i) {
    threads.emplace_back([&, i] {
      if (!step(busy, 200 + i).ok()) ++failed;
    });
  }
  const int64_t waiting = 1 + 2 * kQueued + kSteps;
  WaitForCalls(*server, waiting);
  const absl::Time start = absl::Now();
  absl::Status s = client->Forward(Request(other, 1, 0, 1, 1, 7)).status();
  EXPECT_TRUE(s.ok()) << s;
  s = client->GetCache(busy).status();
  EXPECT_TRUE(s.ok()) << s;
  s = client->TruncateSequences(other, 0, {{999, 0}}).status();
  EXPECT_TRUE(s.ok()) << s;
  s = step(other, 2);
  EXPECT_TRUE(s.ok()) << s;
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Milliseconds(kSanitized ? 2000 : 500));
  // ... while the long Forward still ran, and the calls behind it still waited.
  EXPECT_GE(server->calls_in_flight(), waiting);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  // They all ran, each in its turn: the 24 Forwards' and 8 Steps' tokens are in the cache.
  absl::StatusOr<v1::CacheInfo> info = client->GetCache(busy);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->stats().live_sequences(), 1 + kQueued + kSteps);
}

// A release waits for its cache's running calls, and the calls of its other layers that come
// after it wait for it holding no thread: 31 layers of a cache queued behind a release, which
// waits for a long Forward on layer 0, leave the threads (16) to another cache's calls. Where a
// release waited on the cache's lock, each of those layers' calls held a thread on it.
TEST(ControlRequestTest, CallsBehindAReleaseHoldNoThread) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(300));
  constexpr int kLayers = 32;
  v1::CacheConfig config = Config(kLongTokens / 16 + 2 * kLayers);
  config.set_num_layers(kLayers);
  const std::string busy = client->CreateCache(config)->cache_id();
  const std::string other = client->CreateCache(Config(4))->cache_id();
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  const JoinAtEnd join{threads};
  ASSERT_NO_FATAL_FAILURE(StartLongForward(*server, *client, busy, failed, threads));
  threads.emplace_back([&] {
    if (!client->ReleaseSequences(busy, {999}).ok()) ++failed;
  });
  WaitForCalls(*server, 2);
  for (int layer = 1; layer < kLayers; ++layer) {
    threads.emplace_back([&, layer] {
      v1::ForwardRequest r = Request(busy, 100 + layer, 0, 1, 1, layer);
      r.set_layer(layer);
      const absl::Status s = client->Forward(r).status();
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) ++failed;
    });
  }
  const int64_t waiting = 1 + kLayers;
  WaitForCalls(*server, waiting);
  const absl::Time start = absl::Now();
  absl::Status s = client->Forward(Request(other, 1, 0, 1, 1, 7)).status();
  EXPECT_TRUE(s.ok()) << s;
  s = client->TruncateSequences(other, 0, {{999, 0}}).status();
  EXPECT_TRUE(s.ok()) << s;
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Milliseconds(kSanitized ? 2000 : 500));
  EXPECT_GE(server->calls_in_flight(), waiting);  // the long Forward still ran
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  absl::StatusOr<v1::CacheInfo> info = client->GetCache(busy);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->stats().live_sequences(), kLayers);
}

// A release runs after the Step messages that came (were read) before it, also those whose
// layer was still busy: a stream's new step on a sequence, queued only once the stream's earlier
// message on that layer had run, ran after a release that came after it and found its sequence
// gone (FAILED_PRECONDITION: a gap), and the release freed the sequence between the two steps.
TEST(ControlRequestTest, AReleaseRunsAfterTheStepMessagesBeforeIt) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto client = ConnectTo(*server, absl::Seconds(300));
  const std::string cache = client->CreateCache(Config(kLongTokens / 16 + 8))->cache_id();
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  const JoinAtEnd join{threads};
  ASSERT_NO_FATAL_FAILURE(StartLongForward(*server, *client, cache, failed, threads));
  std::unique_ptr<StepStream> stream = *client->OpenStep();
  // Sequence 5: a step prefilling its first token on layer 0, then a step decoding its second:
  // both behind the long Forward on layer 0.
  const v1::ForwardRequest prefill = Request(cache, 5, 0, 1, 1, 5);
  const v1::ForwardRequest decode = Request(cache, 5, 1, 1, 1, 6);
  ASSERT_TRUE(stream->Send(random_script::CallOf(prefill, cache)).ok());
  ASSERT_TRUE(stream->Send(random_script::CallOf(decode, cache)).ok());
  absl::SleepFor(absl::Milliseconds(kSanitized ? 1000 : 300));  // both read by the server
  absl::StatusOr<v1::ReleaseSequencesResponse> released;
  std::thread release([&] { released = client->ReleaseSequences(cache, {5}); });
  for (const v1::ForwardRequest* sent : {&prefill, &decode}) {
    std::vector<char> out(sent->q().data().size());
    absl::StatusOr<ForwardReply> r = stream->Receive({out.data(), out.size()});
    EXPECT_TRUE(r.ok()) << "the step at " << sent->spans(0).start() << ": " << r.status();
  }
  EXPECT_TRUE(stream->Close().ok());
  release.join();
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->released(), 1);
  EXPECT_EQ(released->freed_pages(), 1);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  absl::StatusOr<v1::CacheInfo> info = client->GetCache(cache);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->stats().live_sequences(), 1);  // the long Forward's
}

// A request of a method other than Forward and Step whose parse could take more than the whole
// request budget is refused before protobuf reads it (bytes that are no message at all get the
// same answer, not a parse error); one that fits is parsed and answered; bytes protobuf cannot
// parse are the caller's error, naming what they should have been.
TEST(ControlRequestTest, RequestsTooLargeToParseAreRefusedUnread) {
  ServerOptions o = CpuOptions();
  o.request_memory_bytes = int64_t{1} << 30;  // requests of other methods up to 2 MiB
  auto server = *PagedAttnServer::Start(o);
  const std::string validate = "/pagedattn.v1.AttentionService/ValidateCacheConfig";
  const size_t max_bytes =
      static_cast<size_t>(MaxParsedRequestBytes(ByteBudget(o.request_memory_bytes)));
  ASSERT_EQ(max_bytes, size_t{2} << 20);
  // Empty `layers` entries: over 40 times their bytes, parsed.
  const std::string layers = TwoByteFields(10, 2, max_bytes / 2 + 1);
  grpc::Status s = RawUnary(*server, validate, layers);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("larger than this server parses"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find(absl::StrCat("up to ", max_bytes, " bytes")), std::string::npos)
      << s.error_message();
  s = RawUnary(*server, validate, std::string(max_bytes + 1, '\xff'));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  // Just under the bound: parsed and validated (every entry is a violation).
  std::string answer;
  s = RawUnary(*server, validate, TwoByteFields(10, 2, max_bytes / 2), &answer);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::ValidateCacheConfigResponse validated;
  ASSERT_TRUE(validated.ParseFromString(answer));
  EXPECT_FALSE(validated.valid());
  // Not a message: the caller's error, which names the message expected.
  s = RawUnary(*server, "/pagedattn.v1.AttentionService/GetCache", std::string(64, '\xff'));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("not a valid pagedattn.v1.GetCacheRequest"), std::string::npos)
      << s.error_message();
  // Health needs no token: a request longer than a service's name is refused unparsed.
  s = RawUnary(*server, "/grpc.health.v1.Health/Check",
               TwoByteFields(15, 2, HealthServiceImpl::kMaxRequestBytes));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  HealthCheckRequest check;
  check.set_service("pagedattn.v1.AttentionService");
  s = RawUnary(*server, "/grpc.health.v1.Health/Check", check.SerializeAsString(), &answer);
  ASSERT_TRUE(s.ok()) << s.error_message();
  HealthCheckResponse health;
  ASSERT_TRUE(health.ParseFromString(answer));
  EXPECT_EQ(health.status(), HealthCheckResponse::SERVING);
}

// A compressed request is refused as its headers arrive: gRPC would inflate it before any
// handler could bound it (a 64 KiB gzip health check took 69 MiB), and health needs no token.
TEST(ControlRequestTest, CompressedRequestsAreRefusedBeforeTheyAreInflated) {
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  HealthCheckRequest request;
  HealthCheckResponse response;
  grpc::ClientContext plain;
  ASSERT_TRUE(stub->Check(&plain, request, &response).ok());
  for (grpc_compression_algorithm algorithm : {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    grpc::ClientContext ctx;
    ctx.set_compression_algorithm(algorithm);
    const grpc::Status s = stub->Check(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
  }
}

// Reflection (what grpcurl asks) is answered from the binary's descriptors: a file with the
// files it imports, an unknown symbol as NOT_FOUND inside the stream, the services; a request
// longer than any name is refused unparsed, which ends the stream.
TEST(ReflectionTest, AnswersFromTheBinarysDescriptorsAndRefusesLongRequests) {
  namespace rv = grpc::reflection::v1alpha;
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = rv::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->ServerReflectionInfo(&ctx);
  rv::ServerReflectionRequest request;
  rv::ServerReflectionResponse response;
  request.set_file_containing_symbol("pagedattn.v1.AttentionService");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> files;
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    files.push_back(file.name());
  }
  // The API's file first, then what it imports (google/rpc/status.proto, and what that imports).
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files[0], "pagedattn/v1/attention.proto");
  EXPECT_NE(std::find(files.begin(), files.end(), "google/rpc/status.proto"), files.end());
  EXPECT_EQ(response.original_request().file_containing_symbol(), "pagedattn.v1.AttentionService");
  request.set_file_containing_symbol("pagedattn.v1.NoSuchThing");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND);
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& s : response.list_services_response().service()) services.push_back(s.name());
  EXPECT_EQ(services,
            (std::vector<std::string>{"pagedattn.v1.AttentionService", "grpc.health.v1.Health",
                                      "grpc.reflection.v1alpha.ServerReflection"}));
  request.set_file_by_filename(std::string(ReflectionServiceImpl::kMaxRequestBytes, 'x'));
  ASSERT_TRUE(stream->Write(request));
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("at most"), std::string::npos) << status.error_message();
}

// Reflection needs no token: streams open at once past kMaxStreams are refused at once
// (RESOURCE_EXHAUSTED), the others stay open until their client ends them.
TEST(ReflectionTest, OpenStreamsAreBounded) {
  namespace rv = grpc::reflection::v1alpha;
  auto server = *PagedAttnServer::Start(CpuOptions());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = rv::ServerReflection::NewStub(channel);
  grpc::CompletionQueue cq;
  constexpr int kExtra = 4;
  constexpr int kStreams = static_cast<int>(ReflectionServiceImpl::kMaxStreams) + kExtra;
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<
        grpc::ClientAsyncReaderWriter<rv::ServerReflectionRequest, rv::ServerReflectionResponse>>
        rw;
    grpc::Status status;
    bool ended = false;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    auto s = std::make_unique<Stream>();
    s->rw = stub->AsyncServerReflectionInfo(&s->ctx, &cq, reinterpret_cast<void*>(int64_t{i} * 2));
    streams.push_back(std::move(s));
  }
  // Each stream: started (tag 2i), then asked for its status (2i+1), which only a refused
  // stream gives before its client ends it.
  int started = 0, refused = 0;
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(20);
  while (refused < kExtra) {
    void* tag;
    bool ok;
    ASSERT_EQ(cq.AsyncNext(&tag, &ok, deadline), grpc::CompletionQueue::GOT_EVENT)
        << started << " started, " << refused << " refused";
    const int64_t t = reinterpret_cast<int64_t>(tag);
    Stream& s = *streams[static_cast<size_t>(t / 2)];
    if (t % 2 == 0) {
      ++started;
      s.rw->Finish(&s.status, reinterpret_cast<void*>(t + 1));
    } else {
      s.ended = true;
      EXPECT_EQ(s.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s.status.error_message();
      ++refused;
    }
  }
  // No more end on their own (the open ones wait for their client); then the client ends them.
  void* tag;
  bool ok;
  auto handle = [&](bool cancelled) {
    const int64_t t = reinterpret_cast<int64_t>(tag);
    Stream& s = *streams[static_cast<size_t>(t / 2)];
    if (t % 2 == 0) {
      s.rw->Finish(&s.status, reinterpret_cast<void*>(t + 1));
      return;
    }
    EXPECT_TRUE(cancelled) << "a stream within the bound ended: " << s.status.error_message();
    s.ended = true;
  };
  const auto quiet = std::chrono::system_clock::now() + std::chrono::milliseconds(300);
  while (cq.AsyncNext(&tag, &ok, quiet) == grpc::CompletionQueue::GOT_EVENT) handle(false);
  for (auto& s : streams) {
    if (!s->ended) s->ctx.TryCancel();
  }
  auto open = [&] {
    return std::count_if(streams.begin(), streams.end(), [](const auto& s) { return !s->ended; });
  };
  while (open() > 0 && cq.Next(&tag, &ok)) handle(true);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

// Health needs no token; 100 open Watch streams from unauthenticated callers must not starve
// authenticated calls (each used to hold a server thread), and past a bound they are refused.
TEST(HealthTest, WatchStreamsDoNotStarveAuthenticatedCalls) {
  const std::string tokens = (std::filesystem::temp_directory_path() /
                              absl::StrCat("pagedattn-hardening-tokens-", getpid()))
                                 .string();
  const std::string token = "hardening-6b1d93fa0c27e548";
  std::ofstream(tokens) << token << " team\n";
  ServerOptions o = CpuOptions();
  o.auth_tokens_file = tokens;
  auto server = *PagedAttnServer::Start(o);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::CompletionQueue cq;
  constexpr int kStreams = HealthServiceImpl::kMaxWatchers + 44;
  struct Stream {
    grpc::ClientContext ctx;
    HealthCheckResponse first;
    std::unique_ptr<grpc::ClientAsyncReader<HealthCheckResponse>> reader;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  HealthCheckRequest req;
  for (int i = 0; i < kStreams; ++i) {
    auto s = std::make_unique<Stream>();
    s->reader = stub->AsyncWatch(&s->ctx, req, &cq, reinterpret_cast<void*>(int64_t{i} * 4));
    streams.push_back(std::move(s));
  }
  // Each stream i: started (tag 4i), then its first message (4i+1), or its end (4i+2) for
  // those refused.
  auto tag_of = [](int i, int step) { return reinterpret_cast<void*>(int64_t{i} * 4 + step); };
  int answered = 0, refused = 0;
  while (answered + refused < kStreams) {
    void* tag;
    bool ok;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    const int64_t t = reinterpret_cast<int64_t>(tag);
    const int i = static_cast<int>(t / 4);
    Stream& s = *streams[i];
    if (t % 4 == 0 && ok) {
      s.reader->Read(&s.first, tag_of(i, 1));
    } else if (t % 4 == 1 && ok) {
      EXPECT_EQ(s.first.status(), HealthCheckResponse::SERVING);
      ++answered;
    } else if (t % 4 != 2) {  // no message: the stream ended; its status says why
      s.reader->Finish(&s.status, tag_of(i, 2));
    } else {
      EXPECT_EQ(s.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s.status.error_message();
      s.reader.reset();
      ++refused;
    }
  }
  EXPECT_EQ(answered, static_cast<int>(HealthServiceImpl::kMaxWatchers));
  EXPECT_EQ(refused, kStreams - static_cast<int>(HealthServiceImpl::kMaxWatchers));
  // With every watcher slot held, authenticated calls still answer promptly.
  auto client = ConnectTo(*server, absl::Seconds(2), token);
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::vector<v1::CacheInfo>> r = client->ListCaches();
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
  }
  int open = 0;
  for (int i = 0; i < kStreams; ++i) {
    if (streams[i]->reader == nullptr) continue;
    streams[i]->ctx.TryCancel();
    streams[i]->reader->Finish(&streams[i]->status, tag_of(i, 3));
    ++open;
  }
  for (int n = 0; n < open; ++n) {
    void* tag;
    bool ok;
    ASSERT_TRUE(cq.Next(&tag, &ok));
  }
  server->Shutdown(absl::Seconds(1));
  server->Wait();
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  std::filesystem::remove(tokens);
}

}  // namespace
}  // namespace pagedattn
