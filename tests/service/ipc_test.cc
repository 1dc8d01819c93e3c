// Device tensors over CUDA IPC, end to end with two processes on one GPU: this test allocates
// and exports memory, a pagedattn-server it starts (PAGEDATTN_SERVER_BIN) imports it. The data
// plane's script of Forwards (tests/service/forward_script.h) runs on two caches of that server,
// one through bytes and one through device tensors; the answers must be bit-identical, and
// every refused request must leave the output memory and the cache untouched. Then: the Step
// stream, regions that are out of bounds, misaligned, unregistered, of another cache or another
// tenant; a client that exits without unregistering (its region goes after the lease); a server
// restart (a clear error, no crash). The CPU backend's refusal runs everywhere; the rest skips
// without a GPU.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "server/service/server.h"
#include "tests/service/child_process.h"
#include "tests/service/forward_script.h"
#include "tests/service/random_script.h"
#if PAGEDATTN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "client/device_region.h"
#endif

namespace pagedattn {
namespace {

using forward_script::CallOf;
using forward_script::Case;
using forward_script::kHeadDim;
using forward_script::kHeads;
using forward_script::kKvHeads;
using forward_script::kLayers;
using forward_script::MakeTensors;
using forward_script::Script;
using forward_script::Tensors;

v1::CacheConfig Config() {
  v1::CacheConfig c;
  c.set_num_layers(kLayers);
  c.set_num_q_heads(kHeads);
  c.set_num_kv_heads(kKvHeads);
  c.set_head_dim(kHeadDim);
  c.set_page_size(7);
  c.set_kv_dtype(v1::BFLOAT16);
  c.set_num_pages(64);
  return c;
}

// A request naming device buffers, for the backends that have none.
v1::ForwardRequest DeviceRequest(const std::string& cache_id) {
  v1::ForwardRequest r;
  r.set_cache_id(cache_id);
  v1::Span* s = r.add_spans();
  s->set_seq_id(1);
  s->set_num_new_tokens(1);
  s->set_num_queries(1);
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_out()}) {
    t->set_dtype(v1::BFLOAT16);
    for (int64_t d : {1, kHeads, kHeadDim}) t->add_shape(d);
    t->mutable_device_buffer()->set_region_id("00000000000000000000000000000000");
  }
  for (v1::Tensor* t : {r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(v1::BFLOAT16);
    for (int64_t d : {1, kKvHeads, kHeadDim}) t->add_shape(d);
    t->mutable_device_buffer()->set_region_id("00000000000000000000000000000000");
  }
  return r;
}

TEST(IpcCpuTest, CpuBackendRefusesDeviceTensorsWithFailedPrecondition) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.backend = {.backend = BackendChoice::kCpu, .cpu_threads = 2};
  std::unique_ptr<PagedAttnServer> server = *PagedAttnServer::Start(o);
  ClientOptions c;
  c.target = absl::StrCat("127.0.0.1:", server->port());
  std::unique_ptr<Client> client = *Client::Connect(c);
  EXPECT_FALSE(client->GetServerInfo()->capabilities().supports_device_tensors());
  const std::string cache = client->CreateCache(Config())->cache_id();
  absl::StatusOr<v1::MemoryRegion> r = client->RegisterMemory(cache, std::string(64, '\1'), 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("CUDA backend"), std::string::npos) << r.status();
  // Said before the arguments: a size, lease or device a CUDA server would refuse is not what
  // keeps this one from registering (they were INVALID_ARGUMENT, "lives on GPU 0").
  for (auto [size, device, lease] : {std::tuple{0, 0, 0}, {4096, 5, 0}, {4096, 0, -1}}) {
    r = client->RegisterMemory(cache, std::string(64, '\1'), size, device, lease);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_NE(r.status().message().find("CUDA backend"), std::string::npos) << r.status();
  }
  absl::StatusOr<v1::ForwardResponse> f = client->Forward(DeviceRequest(cache));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_NE(f.status().message().find("send the tensors' data"), std::string::npos) << f.status();
  EXPECT_EQ(client->GetCache(cache)->stats().live_sequences(), 0);
}

#if PAGEDATTN_WITH_CUDA

constexpr char kTokenA[] = "ipc-test-token-tenant-a-0123456789";
constexpr char kTokenB[] = "ipc-test-token-tenant-b-0123456789";

// A pagedattn-server in a process of its own, on a Unix socket, with two tenants.
class ServerProcess {
 public:
  ServerProcess(std::string socket, std::string tokens_file)
      : socket_(std::move(socket)), tokens_file_(std::move(tokens_file)) {}
  ~ServerProcess() { Stop(); }

  absl::Status Start(const std::vector<std::string>& extra = {}) {
    const char* bin = std::getenv("PAGEDATTN_SERVER_BIN");
    if (bin == nullptr) return absl::FailedPreconditionError("PAGEDATTN_SERVER_BIN is not set");
    std::vector<std::string> args = {bin, "--backend=cuda", absl::StrCat("--listen=unix:", socket_),
                                     absl::StrCat("--auth_tokens_file=", tokens_file_),
                                     "--log_level=warn"};
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = SpawnProcess(std::move(args));
    for (int i = 0; i < 600; ++i) {  // up to a minute for CUDA to start
      absl::StatusOr<std::unique_ptr<Client>> c = Connect(kTokenA);
      if (c.ok() && (*c)->GetServerInfo().ok()) return absl::OkStatus();
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::InternalError(absl::StrCat("the server exited with status ", status));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::DeadlineExceededError("the server did not answer within a minute");
  }

  void Stop() { StopProcess(pid_, SIGTERM); }

  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& token) const {
    ClientOptions c;
    c.target = "unix:" + socket_;
    c.bearer_token = token;
    c.timeout = absl::Seconds(60);
    return Client::Connect(c);
  }

 private:
  std::string socket_, tokens_file_;
  pid_t pid_ = -1;
};

size_t Align(size_t n) { return (n + 255) / 256 * 256; }

// Where one case's tensors lie in the region: q, k, v and out at offsets that are multiples of
// 16 but not of 256 (the least alignment the server accepts), then lse.
struct Placement {
  size_t q, k, v, out, lse, end;
};
Placement Place(const Tensors& t) {
  Placement p;
  p.q = 16;
  p.k = p.q + Align(t.q.size()) + 48;
  p.v = p.k + Align(t.k.size()) + 16;
  p.out = p.v + Align(t.v.size()) + 32;
  p.lse = p.out + Align(t.q.size()) + 16;
  p.end = p.lse + Align(static_cast<size_t>(t.q_shape[0]) * kHeads * 4);
  return p;
}

ForwardCall DeviceCall(const ForwardCall& host, const Tensors& t, const Placement& p,
                       const std::string& region) {
  ForwardCall c = host;
  c.q = TensorArg::Device(v1::BFLOAT16, t.q_shape, region, static_cast<int64_t>(p.q));
  if (host.k.dtype != v1::DTYPE_UNSPECIFIED) {
    c.k = TensorArg::Device(v1::BFLOAT16, t.kv_shape, region, static_cast<int64_t>(p.k));
    c.v = TensorArg::Device(v1::BFLOAT16, t.kv_shape, region, static_cast<int64_t>(p.v));
  }
  c.out = TensorArg::Device(v1::BFLOAT16, {t.q_shape[0], kHeads, kHeadDim}, region,
                            static_cast<int64_t>(p.out));
  c.lse =
      TensorArg::Device(v1::FLOAT32, {t.q_shape[0], kHeads}, region, static_cast<int64_t>(p.lse));
  return c;
}

constexpr size_t kRegionBytes = 8 << 20;

class IpcTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      skip_ = "no CUDA GPU visible";
      return;
    }
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("pagedattn-ipc-", getpid());
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "tokens") << kTokenA << " tenant-a\n" << kTokenB << " tenant-b\n";
    server_ = new ServerProcess((dir_ / "s.sock").string(), (dir_ / "tokens").string());
    if (absl::Status s = server_->Start({"--memory_lease_seconds=300"}); !s.ok()) {
      skip_ = absl::StrCat("cannot start the server: ", s.ToString());
    }
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    std::filesystem::remove_all(dir_);
  }

  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
    client_ = *server_->Connect(kTokenA);
    region_ = *DeviceRegion::Allocate(0, kRegionBytes);
  }

  std::string NewCache() { return client_->CreateCache(Config())->cache_id(); }

  std::string Register(const std::string& cache, Client* client = nullptr) {
    absl::StatusOr<v1::MemoryRegion> r =
        (client ? client : client_.get())
            ->RegisterMemory(cache, region_->ipc_handle(), kRegionBytes);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->region_id() : "";
  }

  // Writes a case's inputs into the region and poisons out and lse (0xff: NaN in both dtypes).
  void Stage(const Tensors& t, const Placement& p) {
    ASSERT_TRUE(region_->Write(p.q, t.q.data(), t.q.size()).ok());
    ASSERT_TRUE(region_->Write(p.k, t.k.data(), t.k.size()).ok());
    ASSERT_TRUE(region_->Write(p.v, t.v.data(), t.v.size()).ok());
    ASSERT_TRUE(region_->Fill(p.out, 0xff, p.end - p.out).ok());
  }
  std::string ReadBack(size_t at, size_t n) { return ReadBack(*region_, at, n); }
  static std::string ReadBack(const DeviceRegion& region, size_t at, size_t n) {
    std::string s(n, '\0');
    EXPECT_TRUE(region.Read(at, s.data(), n).ok());
    return s;
  }
  // Still poisoned: nothing was written to out or lse.
  bool Untouched(const Placement& p) {
    const std::string s = ReadBack(p.out, p.end - p.out);
    return s == std::string(s.size(), '\xff');
  }

  // The bytes path's answer to one case.
  struct Answer {
    absl::StatusCode code;
    std::string out, lse;
  };
  Answer BytesForward(const std::string& cache, const Case& c, const Tensors& t) {
    std::string out(static_cast<size_t>(t.q_shape[0]) * kHeads * kHeadDim * 2, '\0');
    std::string lse(static_cast<size_t>(t.q_shape[0]) * kHeads * 4, '\0');
    absl::StatusOr<ForwardReply> r = client_->ForwardTensors(
        CallOf(cache, c, t),
        {out.data(), out.size(), reinterpret_cast<float*>(lse.data()), lse.size()});
    return {r.status().code(), r.ok() ? out : "", r.ok() ? lse : ""};
  }

  static inline ServerProcess* server_ = nullptr;
  static inline std::filesystem::path dir_;
  static inline std::string skip_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<DeviceRegion> region_;
};

TEST_F(IpcTest, UnaryAnswersAreBitIdenticalToTheBytePath) {
  const std::string bytes_cache = NewCache(), ipc_cache = NewCache();
  const std::string region = Register(ipc_cache);
  const std::vector<Case> script = Script();
  for (size_t i = 0; i < script.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    const Tensors t = MakeTensors(script[i], i);
    const Answer want = BytesForward(bytes_cache, script[i], t);
    EXPECT_EQ(want.code, script[i].want);
    const Placement p = Place(t);
    Stage(t, p);
    absl::StatusOr<ForwardReply> r =
        client_->ForwardTensors(DeviceCall(CallOf(ipc_cache, script[i], t), t, p, region), {});
    ASSERT_EQ(r.status().code(), want.code) << r.status();
    if (!r.ok()) {
      EXPECT_TRUE(Untouched(p)) << "a refused Forward wrote its output";
      continue;
    }
    EXPECT_EQ(r->out_shape, (std::vector<int64_t>{t.q_shape[0], kHeads, kHeadDim}));
    EXPECT_EQ(ReadBack(p.out, want.out.size()), want.out) << "out differs from the byte path";
    EXPECT_EQ(ReadBack(p.lse, want.lse.size()), want.lse) << "lse differs from the byte path";
  }
  EXPECT_EQ(client_->GetCache(ipc_cache)->stats().free_pages(),
            client_->GetCache(bytes_cache)->stats().free_pages());
  EXPECT_EQ(client_->GetCache(ipc_cache)->stats().memory_regions(), 1);
}

TEST_F(IpcTest, StepStreamAnswersAreBitIdenticalToTheBytePath) {
  const std::string bytes_cache = NewCache(), ipc_cache = NewCache();
  const std::string region = Register(ipc_cache);
  std::vector<Case> script = Script();
  script.erase(std::remove_if(script.begin(), script.end(),
                              [](const Case& c) { return c.want != absl::StatusCode::kOk; }),
               script.end());
  absl::StatusOr<std::unique_ptr<StepStream>> stream = client_->OpenStep();
  ASSERT_TRUE(stream.ok());
  for (size_t i = 0; i < script.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    const Tensors t = MakeTensors(script[i], i);
    const Answer want = BytesForward(bytes_cache, script[i], t);
    const Placement p = Place(t);
    Stage(t, p);
    ASSERT_TRUE((*stream)->Send(DeviceCall(CallOf(ipc_cache, script[i], t), t, p, region)).ok());
    absl::StatusOr<ForwardReply> r = (*stream)->Receive({});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->layer, script[i].layer);
    EXPECT_EQ(ReadBack(p.out, want.out.size()), want.out);
    EXPECT_EQ(ReadBack(p.lse, want.lse.size()), want.lse);
  }
  EXPECT_TRUE((*stream)->Close().ok());
}

// Random configs of the capability table and random scripts on them (random_script.h, as
// config_fuzz_test runs them), through device tensors in a region of their own: every Forward of
// an accepted config answered as the byte path answers it, bit for bit, in the script's wire
// dtypes (q, k, v and out each float32, float16 or bfloat16), and the two caches left holding the
// same pages. PAGEDATTN_FUZZ_SEED and PAGEDATTN_FUZZ_CONFIGS widen a run.
TEST_F(IpcTest, RandomConfigsAnswerAsTheBytePath) {
  using random_script::EnvInt;
  constexpr size_t kFuzzRegionBytes = size_t{64} << 20;
  absl::StatusOr<std::unique_ptr<DeviceRegion>> memory =
      DeviceRegion::Allocate(0, kFuzzRegionBytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  DeviceRegion& mem = **memory;
  random_script::ScriptLimits limits;
  limits.max_new = 200;  // k and v of a Forward within the region: 3 spans x 200 x 4096 floats
  limits.max_step_queries = 64;
  const uint32_t base = static_cast<uint32_t>(EnvInt("PAGEDATTN_FUZZ_SEED", 20261206));
  const int configs = EnvInt("PAGEDATTN_FUZZ_CONFIGS", 24);
  int accepted = 0, forwards = 0;
  for (int n = 0; n < configs && !HasFatalFailure(); ++n) {
    const uint32_t seed = base + static_cast<uint32_t>(n);
    std::mt19937 rng(seed);
    const v1::CacheConfig config = random_script::RandomConfig(rng, limits);
    const std::string what = absl::StrCat("seed ", seed, ": ", random_script::Describe(config));
    absl::StatusOr<v1::CacheInfo> bytes_cache = client_->CreateCache(config);
    std::printf("%s %s\n", bytes_cache.ok() ? "accepted" : "refused ", what.c_str());
    if (!bytes_cache.ok()) {
      EXPECT_EQ(bytes_cache.status().code(), absl::StatusCode::kInvalidArgument) << what;
      continue;
    }
    ++accepted;
    absl::StatusOr<v1::CacheInfo> ipc_cache = client_->CreateCache(config);
    ASSERT_TRUE(ipc_cache.ok()) << what << ": " << ipc_cache.status();
    absl::StatusOr<v1::MemoryRegion> region = client_->RegisterMemory(
        ipc_cache->cache_id(), mem.ipc_handle(), static_cast<int64_t>(kFuzzRegionBytes));
    ASSERT_TRUE(region.ok()) << what << ": " << region.status();

    std::mt19937 script_rng(seed ^ 0x9e3779b9u);
    random_script::ScriptWriter script(config, limits, script_rng);
    for (int step = 0; step < limits.steps; ++step) {
      if (step > 0 && random_script::Percent(script_rng, 15)) {
        const uint64_t seq = static_cast<uint64_t>(script.RandomSequence());
        for (const v1::CacheInfo* c : {&*bytes_cache, &*ipc_cache}) {
          EXPECT_TRUE(client_->ReleaseSequences(c->cache_id(), {seq}).ok()) << what;
        }
        script.Release(static_cast<int>(seq));
      }
      v1::ForwardRequest req = script.Next();
      const std::string at = absl::StrCat(what, "; step ", step, " ", random_script::SpansOf(req));
      req.set_cache_id(bytes_cache->cache_id());
      absl::StatusOr<v1::ForwardResponse> want = client_->Forward(req);
      ASSERT_TRUE(want.ok()) << at << ": bytes: " << want.status();

      // q, k, v, out, lse one after another, each at a multiple of 16 (not of 256).
      size_t end = 16;
      auto place = [&](size_t bytes) {
        const size_t at = end;
        end = Align(end + bytes) + 16;
        return at;
      };
      const v1::Tensor& q = req.q();
      const size_t q_at = place(q.data().size()), k_at = place(req.k().data().size()),
                   v_at = place(req.v().data().size()), out_at = place(q.data().size()),
                   lse_at = place(static_cast<size_t>(q.shape(0) * q.shape(1)) * sizeof(float));
      ASSERT_LE(end, kFuzzRegionBytes) << at;
      ASSERT_TRUE(mem.Write(q_at, q.data().data(), q.data().size()).ok());
      ASSERT_TRUE(mem.Write(k_at, req.k().data().data(), req.k().data().size()).ok());
      ASSERT_TRUE(mem.Write(v_at, req.v().data().data(), req.v().data().size()).ok());
      ASSERT_TRUE(mem.Fill(out_at, 0xff, end - out_at).ok());  // NaN in every dtype

      ForwardCall call = random_script::CallOf(req, ipc_cache->cache_id());
      auto device = [&](const v1::Tensor& t, size_t offset) {
        return TensorArg::Device(t.dtype(), {t.shape().begin(), t.shape().end()},
                                 region->region_id(), static_cast<int64_t>(offset));
      };
      call.q = device(q, q_at);
      if (req.has_k()) {
        call.k = device(req.k(), k_at);
        call.v = device(req.v(), v_at);
      }
      call.out = device(q, out_at);  // out: q's dtype and shape
      if (req.options().return_lse()) {
        call.lse = TensorArg::Device(v1::FLOAT32, {q.shape(0), q.shape(1)}, region->region_id(),
                                     static_cast<int64_t>(lse_at));
      }
      absl::StatusOr<ForwardReply> got = client_->ForwardTensors(call, {});
      ASSERT_TRUE(got.ok()) << at << ": device tensors: " << got.status();
      ++forwards;
      EXPECT_EQ(got->out_dtype, q.dtype()) << at;
      EXPECT_TRUE(ReadBack(mem, out_at, want->out().data().size()) == want->out().data())
          << at << ": out differs from the byte path's";
      EXPECT_TRUE(ReadBack(mem, lse_at, want->lse().data().size()) == want->lse().data())
          << at << ": lse differs from the byte path's";
    }
    for (const v1::CacheInfo* c : {&*bytes_cache, &*ipc_cache}) {
      absl::StatusOr<v1::CacheInfo> info = client_->GetCache(c->cache_id());
      ASSERT_TRUE(info.ok()) << what << ": " << info.status();
      EXPECT_EQ(info->stats().used_pages(), script.PagesHeld()) << what;
    }
    EXPECT_TRUE(client_->UnregisterMemory(region->region_id()).ok()) << what;
    EXPECT_TRUE(client_->DeleteCache(ipc_cache->cache_id()).ok()) << what;
    EXPECT_TRUE(client_->DeleteCache(bytes_cache->cache_id()).ok()) << what;
  }
  std::printf("%d of %d configs accepted, %d Forwards through device tensors\n", accepted, configs,
              forwards);
  EXPECT_GT(accepted, configs / 2);  // a run that accepts none tests nothing
}

// Keeps the client's stream busy for a while (memsets of a scratch buffer), so that what is
// queued after it lands late: a server that did not wait for the caller's event would read
// q/k/v before they are written.
void DelayStream(cudaStream_t stream) {
  static void* scratch = [] {
    void* p = nullptr;
    cudaMalloc(&p, size_t{1} << 30);
    return p;
  }();
  for (int i = 0; i < 8; ++i) cudaMemsetAsync(scratch, i, size_t{1} << 30, stream);
}

// With DeviceSync events the caller does not synchronize: it queues its writes, records an
// event, sends the call; the server's work waits for the event on the GPU, the answer comes
// once queued, and out is ready when the server's event is.
TEST_F(IpcTest, EventsOrderTheWorkWithoutHostSynchronization) {
  const std::string bytes_cache = NewCache(), ipc_cache = NewCache();
  std::unique_ptr<IpcEvent> ready = *IpcEvent::Create(0), done = *IpcEvent::Create(0);
  absl::StatusOr<v1::MemoryRegion> reg =
      client_->RegisterMemory(ipc_cache, region_->ipc_handle(), kRegionBytes, 0, 0,
                              {ready->ipc_handle(), done->ipc_handle()});
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->num_events(), 2);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const std::vector<Case> script = Script();
  for (size_t i = 0; i < script.size(); ++i) {
    if (script[i].want != absl::StatusCode::kOk) continue;
    SCOPED_TRACE(absl::StrCat("case ", i));
    const Tensors t = MakeTensors(script[i], i);
    const Answer want = BytesForward(bytes_cache, script[i], t);
    const Placement p = Place(t);
    ASSERT_TRUE(region_->Fill(p.q, 0, p.out - p.q).ok());  // stale inputs: zeros
    ASSERT_TRUE(region_->Fill(p.out, 0xff, p.end - p.out).ok());
    DelayStream(stream);
    for (const auto& [at, src] : {std::pair{p.q, &t.q}, {p.k, &t.k}, {p.v, &t.v}}) {
      ASSERT_EQ(cudaMemcpyAsync(region_->data() + at, src->data(), src->size(),
                                cudaMemcpyHostToDevice, stream),
                cudaSuccess);
    }
    ASSERT_TRUE(ready->Record(stream).ok());
    ForwardCall call = DeviceCall(CallOf(ipc_cache, script[i], t), t, p, reg->region_id());
    call.sync = {.present = true, .region_id = reg->region_id(), .wait_event = 1, .done_event = 2};
    absl::StatusOr<ForwardReply> r = client_->ForwardTensors(call, {});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(done->Synchronize().ok());
    EXPECT_EQ(ReadBack(p.out, want.out.size()), want.out) << "out differs from the byte path";
    EXPECT_EQ(ReadBack(p.lse, want.lse.size()), want.lse);
  }
  cudaStreamDestroy(stream);
  // An event index the region does not have is refused before anything runs.
  const Case c = Script()[0];
  const Tensors t = MakeTensors(c, 0);
  const Placement p = Place(t);
  Stage(t, p);
  ForwardCall call = DeviceCall(CallOf(NewCache(), c, t), t, p, reg->region_id());
  call.sync = {.present = true, .region_id = reg->region_id(), .wait_event = 3};
  EXPECT_EQ(client_->ForwardTensors(call, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// A Step stream of the whole script with events, nothing waited for until the end: the server
// answers each layer once queued and takes the next at once, so Forwards of one layer run on
// different streams back to back; their order on the GPU must still be the cache's.
TEST_F(IpcTest, QueuedLayersKeepTheirOrderOnTheGpu) {
  const std::string bytes_cache = NewCache(), ipc_cache = NewCache();
  std::vector<Case> script = Script();
  script.erase(std::remove_if(script.begin(), script.end(),
                              [](const Case& c) { return c.want != absl::StatusCode::kOk; }),
               script.end());
  std::vector<std::unique_ptr<IpcEvent>> done;
  std::vector<std::string> handles;
  std::unique_ptr<IpcEvent> ready = *IpcEvent::Create(0);
  handles.push_back(ready->ipc_handle());
  for (size_t i = 0; i < script.size(); ++i) {
    done.push_back(*IpcEvent::Create(0));
    handles.push_back(done.back()->ipc_handle());
  }
  absl::StatusOr<v1::MemoryRegion> reg =
      client_->RegisterMemory(ipc_cache, region_->ipc_handle(), kRegionBytes, 0, 0, handles);
  ASSERT_TRUE(reg.ok()) << reg.status();
  constexpr size_t kSlot = 512 << 10;  // each case's tensors in a slot of their own
  ASSERT_LE(script.size() * kSlot, kRegionBytes);
  std::vector<Tensors> tensors;
  std::vector<Answer> want;
  std::vector<ForwardCall> calls;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DelayStream(stream);
  for (size_t i = 0; i < script.size(); ++i) {
    tensors.push_back(MakeTensors(script[i], i));
  }
  for (size_t i = 0; i < script.size(); ++i) {
    const Tensors& t = tensors[i];
    want.push_back(BytesForward(bytes_cache, script[i], t));
    Placement p = Place(t);
    for (size_t* at : {&p.q, &p.k, &p.v, &p.out, &p.lse, &p.end}) *at += i * kSlot;
    ASSERT_LE(p.end, (i + 1) * kSlot);
    ASSERT_TRUE(region_->Fill(p.out, 0xff, p.end - p.out).ok());
    for (const auto& [at, src] : {std::pair{p.q, &t.q}, {p.k, &t.k}, {p.v, &t.v}}) {
      ASSERT_EQ(cudaMemcpyAsync(region_->data() + at, src->data(), src->size(),
                                cudaMemcpyHostToDevice, stream),
                cudaSuccess);
    }
    ForwardCall call =
        DeviceCall(CallOf(ipc_cache, script[i], tensors[i]), tensors[i], p, reg->region_id());
    call.sync = {.present = true,
                 .region_id = reg->region_id(),
                 .wait_event = 1,
                 .done_event = static_cast<int32_t>(2 + i)};
    calls.push_back(std::move(call));
  }
  ASSERT_TRUE(ready->Record(stream).ok());
  absl::StatusOr<std::unique_ptr<StepStream>> steps = client_->OpenStep();
  ASSERT_TRUE(steps.ok());
  for (const ForwardCall& call : calls) ASSERT_TRUE((*steps)->Send(call).ok());
  for (size_t i = 0; i < calls.size(); ++i) {
    absl::StatusOr<ForwardReply> r = (*steps)->Receive({});
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_TRUE((*steps)->Close().ok());
  for (size_t i = 0; i < calls.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    ASSERT_TRUE(done[i]->Synchronize().ok());
    const size_t out_at = static_cast<size_t>(calls[i].out.offset);
    const size_t lse_at = static_cast<size_t>(calls[i].lse.offset);
    EXPECT_EQ(ReadBack(out_at, want[i].out.size()), want[i].out);
    EXPECT_EQ(ReadBack(lse_at, want[i].lse.size()), want[i].lse);
  }
  cudaStreamDestroy(stream);
}

TEST_F(IpcTest, BadRegionsAreRefusedAndNothingIsWritten) {
  const std::string cache = NewCache(), other_cache = NewCache(), bytes_cache = NewCache();
  const std::string region = Register(cache);
  const std::string other_region = Register(other_cache);
  const Case c = Script()[0];
  const Tensors t = MakeTensors(c, 0);
  const Placement p = Place(t);
  Stage(t, p);
  const ForwardCall good = DeviceCall(CallOf(cache, c, t), t, p, region);
  struct Bad {
    const char* what;
    ForwardCall call;
    absl::StatusCode want;
  };
  std::vector<Bad> bad;
  auto with = [&](const char* what, absl::StatusCode want, auto edit) {
    ForwardCall call = good;
    edit(call);
    bad.push_back({what, std::move(call), want});
  };
  using C = absl::StatusCode;
  with("q past the region's end", C::kInvalidArgument,
       [](ForwardCall& f) { f.q.offset = kRegionBytes - 256; });
  with("out past the region's end", C::kInvalidArgument,
       [](ForwardCall& f) { f.out.offset = kRegionBytes; });
  with("a negative offset", C::kInvalidArgument, [](ForwardCall& f) { f.k.offset = -16; });
  with("a misaligned offset", C::kInvalidArgument, [](ForwardCall& f) { f.v.offset += 8; });
  with("an unregistered region", C::kNotFound,
       [](ForwardCall& f) { f.out.region_id = "0123456789abcdef0123456789abcdef"; });
  with("another cache's region", C::kInvalidArgument,
       [&](ForwardCall& f) { f.q.region_id = other_region; });
  with("out missing", C::kInvalidArgument, [](ForwardCall& f) { f.out = {}; });
  with("lse missing with return_lse", C::kInvalidArgument, [](ForwardCall& f) { f.lse = {}; });
  with("out in the wrong dtype", C::kInvalidArgument,
       [](ForwardCall& f) { f.out.dtype = v1::FLOAT16; });
  with("q carrying data beside device tensors", C::kInvalidArgument, [&](ForwardCall& f) {
    f.q = TensorArg::Host(v1::BFLOAT16, t.q_shape, t.q.data(), t.q.size());
  });
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    absl::StatusOr<ForwardReply> r = client_->ForwardTensors(b.call, {});
    EXPECT_EQ(r.status().code(), b.want) << r.status();
    EXPECT_TRUE(Untouched(p)) << "a refused Forward wrote its output";
    EXPECT_EQ(client_->GetCache(cache)->stats().live_sequences(), 0) << "it changed the cache";
  }
  // Another tenant cannot use (or see) the region, even naming it on its own cache.
  std::unique_ptr<Client> b = *server_->Connect(kTokenB);
  const std::string b_cache = b->CreateCache(Config())->cache_id();
  ForwardCall stolen = good;
  stolen.cache_id = b_cache;
  EXPECT_EQ(b->ForwardTensors(stolen, {}).status().code(), C::kNotFound);
  EXPECT_EQ(b->UnregisterMemory(region).code(), C::kNotFound);
  EXPECT_EQ(b->RegisterMemory(cache, region_->ipc_handle(), 4096).status().code(), C::kNotFound)
      << "registered memory for another tenant's cache";
  EXPECT_TRUE(Untouched(p));
  // Registration's own checks.
  EXPECT_EQ(client_->RegisterMemory(cache, region_->ipc_handle(), kRegionBytes + 1).status().code(),
            C::kInvalidArgument)
      << "a size past the allocation";
  EXPECT_EQ(client_->RegisterMemory(cache, "short", 4096).status().code(), C::kInvalidArgument);
  EXPECT_EQ(client_->RegisterMemory(cache, std::string(64, '\0'), 4096).status().code(),
            C::kInvalidArgument)
      << "a handle of nothing";
  EXPECT_EQ(
      client_->RegisterMemory(cache, region_->ipc_handle(), 4096, /*device=*/1).status().code(),
      C::kInvalidArgument)
      << "another device than the cache's";
  // And after all that, the good call gives the byte path's answer.
  const Answer want = BytesForward(bytes_cache, c, t);
  ASSERT_TRUE(client_->ForwardTensors(good, {}).ok());
  EXPECT_EQ(ReadBack(p.out, want.out.size()), want.out);
}

TEST_F(IpcTest, UnregisterAndDeleteCacheReleaseRegions) {
  const std::string cache = NewCache();
  const std::string region = Register(cache);
  const Case c = Script()[0];
  const Tensors t = MakeTensors(c, 0);
  const Placement p = Place(t);
  Stage(t, p);
  ASSERT_TRUE(client_->UnregisterMemory(region).ok());
  absl::StatusOr<ForwardReply> r =
      client_->ForwardTensors(DeviceCall(CallOf(cache, c, t), t, p, region), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("register the memory again"), std::string::npos);
  EXPECT_EQ(client_->UnregisterMemory(region).code(), absl::StatusCode::kNotFound);
  const std::string second = Register(cache);
  EXPECT_EQ(client_->GetCache(cache)->stats().memory_regions(), 1);
  ASSERT_TRUE(client_->DeleteCache(cache).ok());
  EXPECT_EQ(client_->UnregisterMemory(second).code(), absl::StatusCode::kNotFound)
      << "deleting the cache left its region";
}

// A child process (this binary, --register_and_exit) registers memory with a 1 s lease and
// exits without unregistering; the server releases the region once the lease is over.
TEST_F(IpcTest, RegionOfAClientThatExitedIsReleasedAfterTheLease) {
  const std::string cache = NewCache();
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    execl(self.c_str(), self.c_str(), "--register_and_exit", (dir_ / "s.sock").string().c_str(),
          cache.c_str(), nullptr);
    _exit(127);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_EQ(client_->GetCache(cache)->stats().memory_regions(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (client_->GetCache(cache)->stats().memory_regions() != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(client_->GetCache(cache)->stats().memory_regions(), 0)
      << "the dead client's region outlived its lease";
}

// The server restarts under a client that holds a region id: a clear NOT_FOUND, no crash, and
// registering again works. Runs last: it restarts the suite's server.
TEST_F(IpcTest, ZzServerRestartGivesAClearErrorAndRegisteringAgainWorks) {
  const std::string cache = NewCache();
  const std::string region = Register(cache);
  server_->Stop();
  ASSERT_TRUE(server_->Start().ok());
  client_ = *server_->Connect(kTokenA);
  const std::string new_cache = NewCache();
  const Case c = Script()[0];
  const Tensors t = MakeTensors(c, 0);
  const Placement p = Place(t);
  Stage(t, p);
  absl::StatusOr<ForwardReply> r =
      client_->ForwardTensors(DeviceCall(CallOf(new_cache, c, t), t, p, region), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("the server restarted"), std::string::npos) << r.status();
  EXPECT_TRUE(Untouched(p));
  const std::string again = Register(new_cache);
  EXPECT_TRUE(client_->ForwardTensors(DeviceCall(CallOf(new_cache, c, t), t, p, again), {}).ok());
  EXPECT_FALSE(Untouched(p));
}

#endif  // PAGEDATTN_WITH_CUDA

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) {
#if PAGEDATTN_WITH_CUDA
  // The child of RegionOfAClientThatExitedIsReleasedAfterTheLease: register, then exit.
  if (argc == 4 && std::string(argv[1]) == "--register_and_exit") {
    pagedattn::ClientOptions c;
    c.target = absl::StrCat("unix:", argv[2]);
    c.bearer_token = pagedattn::kTokenA;
    std::unique_ptr<pagedattn::Client> client = *pagedattn::Client::Connect(c);
    auto region = pagedattn::DeviceRegion::Allocate(0, 1 << 20);
    if (!region.ok()) return 3;
    auto r = client->RegisterMemory(argv[3], (*region)->ipc_handle(), 1 << 20, 0,
                                    /*lease_seconds=*/1);
    return r.ok() ? 0 : 4;  // exits holding the registration
  }
#endif
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
