// pagedattn-loadgen: a model-shaped workload against a pagedattn server (prefill, then decode
// steps of every layer), in each transport mode, beside a bare gRPC echo of the same bytes that
// it serves itself (the transport floor), all in one process and run. One JSON row per (mode,
// shape); progress on stderr.
//
//   pagedattn-loadgen --target=127.0.0.1:50051 --uds_target=unix:/tmp/pa.sock
//       --cases=64x4096,16x4096,1x4096 --layers=8 --steps=20 --json=loadgen.json
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/sharded.h"
#if PAGEDATTN_WITH_CUDA
#include "client/device_region.h"
#endif
#include "common/cmdline.h"
#include "common/transport.h"
#include "pagedattn/v1/attention.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "the server, host:port (TCP modes)");
ABSL_FLAG(std::string, uds_target, "",
          "the server's Unix socket, unix:/path (the UDS modes; empty: left out)");
ABSL_FLAG(std::string, modes, "unary_tcp,unary_uds,stream_tcp,echo_tcp,echo_uds,echo_proto_default",
          "comma list of: unary_tcp, unary_uds (Forward, zero-copy client), unary_proto_tcp "
          "(Forward with protobuf messages), stream_tcp, stream_uds (the Step stream, "
          "--inflight layers ahead), sharded_tcp (unary Forwards on a cache split over "
          "--shard_targets), echo_tcp, echo_uds (a bare gRPC echo of the same request and "
          "response bytes, tuned transport), echo_proto_default (an echo that parses and "
          "serializes protobuf messages over gRPC's default transport), ipc_tcp, ipc_uds "
          "(Forward with device tensors: q/k/v/out in this process's GPU memory, registered "
          "with the server over CUDA IPC; the client synchronizes before each call), "
          "ipc_events_tcp, ipc_events_uds (the same ordered by CUDA events instead), "
          "ipc_stream_uds (a Step stream with events, a step's layers sent at once; same node, "
          "CUDA server, builds with CUDA only)");
ABSL_FLAG(std::string, cases, "64x4096,16x4096,1x4096", "decode shapes: batch x context");
ABSL_FLAG(int, echo_mib, 4,
          "also echo messages of this many MiB each way, tuned and default transport (0: no)");
ABSL_FLAG(int, layers, 8, "layers per decode step (each a Forward)");
ABSL_FLAG(int, steps, 20, "decode steps measured per mode and shape");
ABSL_FLAG(int, warmup, 3, "decode steps run first and not measured");
ABSL_FLAG(int, inflight, 2, "stream modes: layers sent ahead of the answers");
ABSL_FLAG(int, q_heads, 32, "query heads");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, head_dim, 128, "head dim");
ABSL_FLAG(int, page_size, 16, "tokens per page");
ABSL_FLAG(std::string, dtype, "BFLOAT16",
          "q/k/v/out and cache dtype: BFLOAT16 or FLOAT16 (any case)");
ABSL_FLAG(std::string, json, "", "write the rows here as a JSON list");
ABSL_FLAG(std::string, token, "", "bearer token (or PAGEDATTN_TOKEN)");
ABSL_FLAG(std::string, shard_targets, "",
          "mode sharded_tcp: the servers (host:port, comma-separated) of a cache split by KV "
          "head, one shard each; its prefill and decode steps go through ShardedClient");
ABSL_FLAG(std::string, metrics_target, "",
          "the server's metrics endpoint, host:port (--metrics_listen): each server mode's row "
          "then has phases_us, the server's mean time per Forward in each phase over that mode's "
          "measured steps (read after the warm-up)");

namespace pagedattn {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

// ---- The echo servers: the same bytes back and forth, nothing else ---------------------------

constexpr char kEchoRaw[] = "/pagedattn.loadgen.Echo/Raw";
constexpr char kEchoProto[] = "/pagedattn.loadgen.Echo/Proto";
constexpr char kResponseBytesKey[] = "x-response-bytes";

// Answers each call with as many bytes as the client's x-response-bytes asks: Raw from a
// buffer it keeps (no copy), Proto by parsing the request into a ForwardRequest and
// serializing a ForwardResponse of that size (the copies protobuf makes).
class EchoService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new Call(this, ctx);
  }

 private:
  class Call final : public grpc::ServerGenericBidiReactor {
   public:
    Call(EchoService* service, grpc::GenericCallbackServerContext* ctx)
        : service_(service), ctx_(ctx) {
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      size_t n = 0;
      auto it = ctx_->client_metadata().find(kResponseBytesKey);
      if (it != ctx_->client_metadata().end()) {
        (void)absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &n);
      }
      if (ctx_->method() == kEchoProto) {
        std::string bytes;
        (void)request_.Dump(&slices_);
        for (const grpc::Slice& s : slices_)
          bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
        v1::ForwardRequest parsed;
        parsed.ParseFromString(bytes);
        v1::ForwardResponse response;
        response.mutable_out()->set_dtype(parsed.q().dtype());
        response.mutable_out()->set_data(std::string(n, '\0'));
        grpc::Slice slice(response.SerializeAsString());
        response_ = grpc::ByteBuffer(&slice, 1);
      } else {
        grpc::Slice slice(service_->Bytes(n).data(), n, grpc::Slice::STATIC_SLICE);
        response_ = grpc::ByteBuffer(&slice, 1);
      }
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    EchoService* service_;
    grpc::GenericCallbackServerContext* ctx_;
    grpc::ByteBuffer request_, response_;
    std::vector<grpc::Slice> slices_;
  };

  const std::string& Bytes(size_t n) {
    absl::MutexLock lock(&mu_);
    std::string& b = buffers_[n];
    if (b.size() != n) b.assign(n, '\0');
    return b;
  }

  absl::Mutex mu_;
  std::map<size_t, std::string> buffers_;
};

struct EchoServer {
  EchoService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string socket;
};

std::unique_ptr<EchoServer> StartEcho(bool tuned) {
  auto echo = std::make_unique<EchoServer>();
  echo->socket =
      absl::StrCat("/tmp/pagedattn-loadgen-echo-", getpid(), tuned ? "" : "-default", ".sock");
  unlink(echo->socket.c_str());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo->port);
  builder.AddListeningPort("unix:" + echo->socket, grpc::InsecureServerCredentials());
  if (tuned) {
    for (const auto& [name, value] : kTransportArgs) builder.AddChannelArgument(name, value);
  }
  builder.SetMaxReceiveMessageSize(kDefaultMaxMessageBytes);
  builder.SetMaxSendMessageSize(kDefaultMaxMessageBytes);
  builder.RegisterCallbackGenericService(&echo->service);
  echo->server = builder.BuildAndStart();
  return echo;
}

std::shared_ptr<grpc::Channel> EchoChannel(const std::string& target, bool tuned) {
  grpc::ChannelArguments args;
  if (tuned) {
    for (const auto& [name, value] : kTransportArgs) args.SetInt(name, value);
  }
  args.SetMaxReceiveMessageSize(kDefaultMaxMessageBytes);
  args.SetMaxSendMessageSize(kDefaultMaxMessageBytes);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// ---- The workload --------------------------------------------------------------------------

struct Shape {
  int batch = 0;
  int context = 0;
};

struct Workload {
  Shape shape;
  int layers, q_heads, kv_heads, head_dim;
  v1::DType dtype = v1::BFLOAT16;
  int64_t elem_bytes = 2;
  // One decode step's tensors (the same random bytes every step; their values do not matter).
  std::string q, k, v;
  int64_t out_bytes = 0;
  // Called once the warm-up steps are sent, before the first measured one (the server's phase
  // metrics are read then, so that their means leave the warm-up out).
  std::function<void()> measuring = [] {};
};

// --dtype, in any case: BFLOAT16 or FLOAT16.
std::optional<v1::DType> ParseDType(absl::string_view name) {
  v1::DType d;
  if (!v1::DType_Parse(absl::AsciiStrToUpper(name), &d) ||
      (d != v1::BFLOAT16 && d != v1::FLOAT16)) {
    return std::nullopt;
  }
  return d;
}

// The flags' values that no run could use: each a line, before anything runs (a value refused
// after a prefill would have cost it).
std::vector<std::string> FlagProblems() {
  std::vector<std::string> out;
  if (!ParseDType(absl::GetFlag(FLAGS_dtype))) {
    out.push_back(absl::StrCat("--dtype must be BFLOAT16 or FLOAT16 (got '",
                               absl::GetFlag(FLAGS_dtype), "')"));
  }
  auto at_least = [&](const char* name, int64_t value, int64_t least) {
    if (value < least)
      out.push_back(absl::StrCat("--", name, " must be >= ", least, " (got ", value, ")"));
  };
  at_least("layers", absl::GetFlag(FLAGS_layers), 1);
  at_least("steps", absl::GetFlag(FLAGS_steps), 1);
  at_least("warmup", absl::GetFlag(FLAGS_warmup), 0);
  at_least("inflight", absl::GetFlag(FLAGS_inflight), 1);
  at_least("q_heads", absl::GetFlag(FLAGS_q_heads), 1);
  at_least("kv_heads", absl::GetFlag(FLAGS_kv_heads), 1);
  at_least("head_dim", absl::GetFlag(FLAGS_head_dim), 1);
  at_least("page_size", absl::GetFlag(FLAGS_page_size), 1);
  at_least("echo_mib", absl::GetFlag(FLAGS_echo_mib), 0);
  const std::string uds = absl::GetFlag(FLAGS_uds_target);
  if (!uds.empty() && !absl::StartsWith(uds, "unix:")) {
    out.push_back(absl::StrCat("--uds_target must be unix:/path (got '", uds, "')"));
  }
  // Checked without making the file: a run that fails leaves none behind.
  const std::string json = absl::GetFlag(FLAGS_json);
  if (!json.empty()) {
    const std::filesystem::path path(json);
    const std::string dir = path.has_parent_path() ? path.parent_path().string() : ".";
    const bool writable = std::filesystem::exists(path) ? access(json.c_str(), W_OK) == 0
                                                        : access(dir.c_str(), W_OK | X_OK) == 0;
    if (!writable) {
      out.push_back(absl::StrCat("--json: cannot write '", json, "': ", std::strerror(errno)));
    }
  }
  return out;
}

Workload MakeWorkload(Shape shape) {
  Workload w;
  w.shape = shape;
  w.layers = absl::GetFlag(FLAGS_layers);
  w.q_heads = absl::GetFlag(FLAGS_q_heads);
  w.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  w.head_dim = absl::GetFlag(FLAGS_head_dim);
  w.dtype = *ParseDType(absl::GetFlag(FLAGS_dtype));  // checked by Main
  std::mt19937 rng(1);
  auto random = [&](int64_t n) {
    std::string s(static_cast<size_t>(n), '\0');
    for (size_t i = 0; i + 1 < s.size(); i += 2) s[i + 1] = static_cast<char>(0x3c + rng() % 3);
    return s;  // small finite 16-bit values
  };
  w.q = random(int64_t{shape.batch} * w.q_heads * w.head_dim * w.elem_bytes);
  w.k = random(int64_t{shape.batch} * w.kv_heads * w.head_dim * w.elem_bytes);
  w.v = random(int64_t{shape.batch} * w.kv_heads * w.head_dim * w.elem_bytes);
  w.out_bytes = static_cast<int64_t>(w.q.size());
  return w;
}

// One decode step's Forward of a layer: every sequence gets one new token at `position`.
ForwardCall DecodeCall(const Workload& w, const std::string& cache, int layer, int64_t position) {
  ForwardCall c;
  c.cache_id = cache;
  c.layer = layer;
  for (int s = 0; s < w.shape.batch; ++s)
    c.spans.push_back({static_cast<uint64_t>(s), position, 1, 1});
  c.q = TensorArg::Host(w.dtype, {w.shape.batch, w.q_heads, w.head_dim}, w.q.data(), w.q.size());
  c.k = TensorArg::Host(w.dtype, {w.shape.batch, w.kv_heads, w.head_dim}, w.k.data(), w.k.size());
  c.v = TensorArg::Host(w.dtype, {w.shape.batch, w.kv_heads, w.head_dim}, w.v.data(), w.v.size());
  return c;
}

// Fills every sequence of every layer up to `context` tokens (appends only, no attention), in
// messages of at most ~64 MiB.
using ForwardFn =
    std::function<absl::StatusOr<ForwardReply>(const ForwardCall&, const ForwardOutput&)>;

ForwardFn Unary(Client& client) {
  return [&client](const ForwardCall& c, const ForwardOutput& o) {
    return client.ForwardTensors(c, o);
  };
}

absl::Status Prefill(const ForwardFn& forward, const Workload& w, const std::string& cache) {
  const int64_t token_bytes = int64_t{w.kv_heads} * w.head_dim * w.elem_bytes;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{64} << 20) / (2 * token_bytes));
  std::string kv(static_cast<size_t>(std::min<int64_t>(chunk, w.shape.context) * token_bytes),
                 '\0');
  for (int layer = 0; layer < w.layers; ++layer) {
    for (int s = 0; s < w.shape.batch; ++s) {
      for (int64_t at = 0; at < w.shape.context; at += chunk) {
        const int64_t n = std::min<int64_t>(chunk, w.shape.context - at);
        ForwardCall c;
        c.cache_id = cache;
        c.layer = layer;
        c.spans = {{static_cast<uint64_t>(s), at, static_cast<int32_t>(n), 0}};
        c.k = TensorArg::Host(w.dtype, {n, w.kv_heads, w.head_dim}, kv.data(),
                              static_cast<size_t>(n * token_bytes));
        c.v = c.k;
        absl::StatusOr<ForwardReply> r = forward(c, {});
        if (!r.ok()) return r.status();
      }
    }
  }
  return absl::OkStatus();
}

struct Samples {
  std::vector<double> latency_us;  // per layer (unary: per call; stream: answer gaps)
  std::vector<double> server_us, kernel_us;
  double wall_us = 0;  // all measured steps
  int layers_done = 0;
};

// Unary Forwards, one layer after another, steps x layers of them; through protobuf messages
// when `protobuf` is set, else `forward`.
absl::StatusOr<Samples> RunUnary(const ForwardFn& forward, const Workload& w,
                                 const std::string& cache, Client* protobuf) {
  Samples out;
  std::string result(static_cast<size_t>(w.out_bytes), '\0');
  const int steps = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
  Clock::time_point measured_start;
  for (int step = -warmup; step < steps; ++step) {
    if (step == 0) {
      w.measuring();
      measured_start = Clock::now();
    }
    for (int layer = 0; layer < w.layers; ++layer) {
      const ForwardCall call = DecodeCall(w, cache, layer, w.shape.context + std::max(step, 0));
      const Clock::time_point t = Clock::now();
      if (protobuf != nullptr) {
        v1::ForwardRequest req;
        req.set_cache_id(call.cache_id);
        req.set_layer(call.layer);
        for (const wire::SpanRef& s : call.spans) {
          v1::Span* p = req.add_spans();
          p->set_seq_id(s.seq_id);
          p->set_start(s.start);
          p->set_num_new_tokens(1);
          p->set_num_queries(1);
        }
        for (const auto& [src, dst] : {std::pair{&call.q, req.mutable_q()},
                                       {&call.k, req.mutable_k()},
                                       {&call.v, req.mutable_v()}}) {
          dst->set_dtype(src->dtype);
          for (int64_t d : src->shape) dst->add_shape(d);
          dst->set_data(std::string(static_cast<const char*>(src->data), src->bytes));
        }
        absl::StatusOr<v1::ForwardResponse> r = protobuf->Forward(req);
        if (!r.ok()) return r.status();
      } else {
        absl::StatusOr<ForwardReply> r = forward(call, {result.data(), result.size()});
        if (!r.ok()) return r.status();
        if (step >= 0) {
          out.server_us.push_back(static_cast<double>(r->server_micros));
          out.kernel_us.push_back(static_cast<double>(r->kernel_micros));
        }
      }
      if (step >= 0) out.latency_us.push_back(Since(t));
    }
  }
  out.wall_us = Since(measured_start);
  out.layers_done = steps * w.layers;
  return out;
}

#if PAGEDATTN_WITH_CUDA
// Forwards with device tensors: q, k and v in a region of this process's GPU memory that the
// server reads in place, and out written there (RegisterMemory, CUDA IPC).
//   ipc_*: unary; before each call the client synchronizes its device (as a caller whose
//     kernels just wrote q/k/v must), and the answer comes once out is written.
//   ipc_events_*: unary with DeviceSync events: the server's work waits on the GPU for the
//     client's event, the answer comes once the work is queued, and a layer is done when the
//     client's wait on the server's event returns.
//   ipc_stream_*: a Step stream with events, every layer of a step sent at once; layer i's
//     input event is recorded on the client's stream after it waited for layer i-1's output
//     event, as a model's dense layer in between would. Per layer: the step's time / layers.
absl::StatusOr<Samples> RunIpc(Client& client, const Workload& w, const std::string& cache,
                               bool events, bool stream) {
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t q_at = 0, k_at = align(w.q.size()), v_at = k_at + align(w.k.size()),
               out_at = v_at + align(w.v.size()), bytes = out_at + align(w.out_bytes);
  absl::StatusOr<std::unique_ptr<DeviceRegion>> region = DeviceRegion::Allocate(0, bytes);
  if (!region.ok()) return region.status();
  for (const auto& [at, src] : {std::pair{q_at, &w.q}, {k_at, &w.k}, {v_at, &w.v}}) {
    if (absl::Status s = (*region)->Write(at, src->data(), src->size()); !s.ok()) return s;
  }
  // Events 1..layers: layer i's input is ready; layers+1..2*layers: layer i's output is.
  std::vector<std::unique_ptr<IpcEvent>> ev;
  std::vector<std::string> handles;
  for (int i = 0; events && i < 2 * w.layers; ++i) {
    absl::StatusOr<std::unique_ptr<IpcEvent>> e = IpcEvent::Create(0);
    if (!e.ok()) return e.status();
    handles.push_back((*e)->ipc_handle());
    ev.push_back(*std::move(e));
  }
  absl::StatusOr<v1::MemoryRegion> registered = client.RegisterMemory(
      cache, (*region)->ipc_handle(), static_cast<int64_t>(bytes), 0, 0, handles);
  if (!registered.ok()) return registered.status();
  const std::string id = registered->region_id();
  auto device_call = [&](const ForwardCall& host) {
    ForwardCall c = host;
    c.q = TensorArg::Device(w.dtype, host.q.shape, id, q_at);
    c.k = TensorArg::Device(w.dtype, host.k.shape, id, k_at);
    c.v = TensorArg::Device(w.dtype, host.v.shape, id, v_at);
    c.out = TensorArg::Device(w.dtype, host.q.shape, id, out_at);
    if (events) {
      c.sync = {.present = true,
                .region_id = id,
                .wait_event = 1 + host.layer,
                .done_event = 1 + w.layers + host.layer};
    }
    return c;
  };
  absl::StatusOr<Samples> samples;
  if (!stream) {
    const ForwardFn forward = [&](const ForwardCall& host,
                                  const ForwardOutput&) -> absl::StatusOr<ForwardReply> {
      if (!events) {
        if (absl::Status s = (*region)->Synchronize(); !s.ok()) return s;
        return client.ForwardTensors(device_call(host), {});
      }
      if (absl::Status s = ev[host.layer]->Record(); !s.ok()) return s;
      absl::StatusOr<ForwardReply> r = client.ForwardTensors(device_call(host), {});
      if (!r.ok()) return r;
      if (absl::Status s = ev[w.layers + host.layer]->Synchronize(); !s.ok()) return s;
      return r;
    };
    samples = RunUnary(forward, w, cache, nullptr);
  } else {
    samples = [&]() -> absl::StatusOr<Samples> {
      Samples out;
      absl::StatusOr<std::unique_ptr<StepStream>> steps = client.OpenStep();
      if (!steps.ok()) return steps.status();
      const int n = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
      // One receiver for the whole run (as a caller would keep one), counting answers; a step
      // ends once its layers are answered and its last output event has completed.
      absl::Mutex mu;
      int64_t answered = 0;
      absl::Status received;
      std::vector<double> server_us;
      std::thread receiver([&] {
        for (int64_t i = 0; i < int64_t{n + warmup} * w.layers; ++i) {
          absl::StatusOr<ForwardReply> r = (*steps)->Receive({});
          absl::MutexLock lock(&mu);
          if (!r.ok()) {
            received = r.status();
            answered = std::numeric_limits<int64_t>::max();
            return;
          }
          if (i >= int64_t{warmup} * w.layers) server_us.push_back(r->server_micros);
          ++answered;
        }
      });
      Clock::time_point measured_start;
      absl::Status sent;
      for (int step = -warmup; step < n && sent.ok(); ++step) {
        if (step == 0) {
          w.measuring();
          measured_start = Clock::now();
        }
        const Clock::time_point t = Clock::now();
        for (int layer = 0; layer < w.layers && sent.ok(); ++layer) {
          if (layer > 0) {  // the "dense layer" waits for the previous attention's output
            sent = ev[w.layers + layer - 1]->StreamWait();
          }
          if (sent.ok()) sent = ev[layer]->Record();
          ForwardCall call =
              device_call(DecodeCall(w, cache, layer, w.shape.context + std::max(step, 0)));
          if (layer > 0) {
            call.cache_id.clear();
            call.spans.clear();
          }
          if (sent.ok()) sent = (*steps)->Send(call);
        }
        if (!sent.ok()) break;
        {
          const int64_t want = int64_t{step + warmup + 1} * w.layers;
          absl::MutexLock lock(&mu);
          const auto all_answered = [&] { return answered >= want; };
          mu.Await(absl::Condition(&all_answered));
          if (!received.ok()) break;
        }
        if (absl::Status s = ev[2 * w.layers - 1]->Synchronize(); !s.ok()) {
          sent = s;
          break;
        }
        if (step >= 0) {
          const double per_layer = Since(t) / w.layers;
          for (int layer = 0; layer < w.layers; ++layer) out.latency_us.push_back(per_layer);
        }
      }
      if (!sent.ok()) (*steps)->Cancel();
      receiver.join();
      if (!received.ok()) return received;  // an ended stream's own status, where a Send has none
      if (!sent.ok()) return sent;
      out.wall_us = Since(measured_start);
      out.layers_done = n * w.layers;
      out.server_us = std::move(server_us);
      if (absl::Status s = (*steps)->Close(); !s.ok()) return s;
      return out;
    }();
  }
  (void)client.UnregisterMemory(id);
  return samples;
}
#endif

// One Step stream for the run: each step's first message opens it (spans), the others carry a
// layer; `inflight` layers are sent ahead of the answers.
absl::StatusOr<Samples> RunStream(Client& client, const Workload& w, const std::string& cache) {
  Samples out;
  std::string result(static_cast<size_t>(w.out_bytes), '\0');
  const int steps = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
  const int inflight = std::max(1, absl::GetFlag(FLAGS_inflight));
  absl::StatusOr<std::unique_ptr<StepStream>> stream = client.OpenStep();
  if (!stream.ok()) return stream.status();
  Clock::time_point measured_start;
  for (int step = -warmup; step < steps; ++step) {
    if (step == 0) {
      w.measuring();
      measured_start = Clock::now();
    }
    std::vector<Clock::time_point> sent(w.layers);
    int next = 0;
    auto send = [&]() -> absl::Status {
      ForwardCall call = DecodeCall(w, cache, next, w.shape.context + std::max(step, 0));
      if (next > 0) {  // the step is open: a layer only
        call.cache_id.clear();
        call.spans.clear();
      }
      sent[next] = Clock::now();
      ++next;
      absl::Status s = (*stream)->Send(call);
      if (s.ok()) return s;
      const absl::Status ended = (*stream)->Close();  // why the stream ended, where it did
      return ended.ok() ? s : ended;
    };
    for (int i = 0; i < std::min(inflight, w.layers); ++i) {
      if (absl::Status s = send(); !s.ok()) return s;
    }
    Clock::time_point last = Clock::now();
    for (int layer = 0; layer < w.layers; ++layer) {
      absl::StatusOr<ForwardReply> r = (*stream)->Receive({result.data(), result.size()});
      if (!r.ok()) return r.status();
      if (step >= 0) {
        out.latency_us.push_back(Since(last));  // the gap between answers: per-layer cost
        out.server_us.push_back(static_cast<double>(r->server_micros));
        out.kernel_us.push_back(static_cast<double>(r->kernel_micros));
      }
      last = Clock::now();
      if (next < w.layers) {
        if (absl::Status s = send(); !s.ok()) return s;
      }
    }
  }
  out.wall_us = Since(measured_start);
  out.layers_done = steps * w.layers;
  if (absl::Status s = (*stream)->Close(); !s.ok()) return s;
  return out;
}

// The echo: the same request bytes a Forward sends, the same number of bytes back.
absl::StatusOr<Samples> RunEcho(const std::shared_ptr<grpc::Channel>& channel, const Workload& w,
                                const std::string& cache, bool proto) {
  Samples out;
  const ForwardCall call = DecodeCall(w, cache, 0, w.shape.context);
  // The answer's size as the server would send it: out's bytes plus its framing.
  const size_t response_bytes = static_cast<size_t>(w.out_bytes) + 32;
  const grpc::internal::RpcMethod method(proto ? kEchoProto : kEchoRaw,
                                         grpc::internal::RpcMethod::NORMAL_RPC, channel);
  const int calls = (absl::GetFlag(FLAGS_steps) + absl::GetFlag(FLAGS_warmup)) * w.layers;
  const int warm = absl::GetFlag(FLAGS_warmup) * w.layers;
  Clock::time_point measured_start;
  for (int i = 0; i < calls; ++i) {
    if (i == warm) measured_start = Clock::now();
    const Clock::time_point t = Clock::now();
    grpc::ByteBuffer request;
    if (proto) {
      v1::ForwardRequest req;
      req.set_cache_id(call.cache_id);
      for (const auto& [src, dst] : {std::pair{&call.q, req.mutable_q()},
                                     {&call.k, req.mutable_k()},
                                     {&call.v, req.mutable_v()}}) {
        dst->set_dtype(src->dtype);
        for (int64_t d : src->shape) dst->add_shape(d);
        dst->set_data(std::string(static_cast<const char*>(src->data), src->bytes));
      }
      grpc::Slice slice(req.SerializeAsString());
      request = grpc::ByteBuffer(&slice, 1);
    } else {
      std::vector<grpc::Slice> slices;
      slices.emplace_back(wire::ForwardRequestHead(call.cache_id, call.layer, call.spans, {}));
      for (const TensorArg* a : {&call.q, &call.k, &call.v}) {
        slices.emplace_back(wire::TensorFieldPrefix(wire::kRequestQ, a->dtype, a->shape, a->bytes));
        slices.emplace_back(a->data, a->bytes, grpc::Slice::STATIC_SLICE);
      }
      request = grpc::ByteBuffer(slices.data(), slices.size());
    }
    grpc::ClientContext ctx;
    ctx.AddMetadata(kResponseBytesKey, std::to_string(response_bytes));
    grpc::ByteBuffer response;
    grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(), method, &ctx, request, &response);
    if (!s.ok()) return FromGrpcStatus(s);
    if (proto) {
      std::string bytes;
      std::vector<grpc::Slice> slices;
      (void)response.Dump(&slices);
      for (const grpc::Slice& sl : slices)
        bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
      v1::ForwardResponse parsed;
      parsed.ParseFromString(bytes);
    } else {
      std::vector<grpc::Slice> slices;
      (void)response.Dump(&slices);
      std::string copy(response_bytes, '\0');  // as the client copies out's bytes
      size_t at = 0;
      for (const grpc::Slice& sl : slices) {
        const size_t n = std::min(sl.size(), copy.size() - at);
        std::memcpy(copy.data() + at, sl.begin(), n);
        at += n;
      }
    }
    if (i >= warm) out.latency_us.push_back(Since(t));
  }
  out.wall_us = Since(measured_start);
  out.layers_done = calls - warm;
  return out;
}

// Echoes of `mib` MiB each way: the transport alone, tuned (raw bytes) or default (protobuf).
absl::StatusOr<Samples> RunEchoMessages(const std::shared_ptr<grpc::Channel>& channel, int mib,
                                        bool proto, int calls) {
  Samples out;
  const size_t bytes = static_cast<size_t>(mib) << 20;
  const std::string payload(bytes, '\x01');
  const grpc::internal::RpcMethod method(proto ? kEchoProto : kEchoRaw,
                                         grpc::internal::RpcMethod::NORMAL_RPC, channel);
  Clock::time_point measured_start = Clock::now();
  for (int i = -2; i < calls; ++i) {
    if (i == 0) measured_start = Clock::now();
    const Clock::time_point t = Clock::now();
    grpc::ByteBuffer request;
    if (proto) {
      v1::ForwardRequest req;
      req.mutable_q()->set_data(payload);
      grpc::Slice slice(req.SerializeAsString());
      request = grpc::ByteBuffer(&slice, 1);
    } else {
      grpc::Slice slice(payload.data(), payload.size(), grpc::Slice::STATIC_SLICE);
      request = grpc::ByteBuffer(&slice, 1);
    }
    grpc::ClientContext ctx;
    ctx.AddMetadata(kResponseBytesKey, std::to_string(bytes));
    grpc::ByteBuffer response;
    grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(), method, &ctx, request, &response);
    if (!s.ok()) return FromGrpcStatus(s);
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
    std::string copy;
    copy.reserve(bytes + 64);
    for (const grpc::Slice& sl : slices)
      copy.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    if (proto) {
      v1::ForwardResponse parsed;
      parsed.ParseFromString(copy);
    }
    if (i >= 0) out.latency_us.push_back(Since(t));
  }
  out.wall_us = Since(measured_start);
  out.layers_done = calls;
  return out;
}

// The same decode steps on a cache split by KV head over --shard_targets (its own prefill).
// options: --target's (the token, the timeout), for each shard.
absl::StatusOr<Samples> RunSharded(const Workload& w, const v1::CacheConfig& config,
                                   const ClientOptions& options) {
  std::vector<std::string> targets =
      absl::StrSplit(absl::GetFlag(FLAGS_shard_targets), ',', absl::SkipEmpty());
  absl::StatusOr<std::unique_ptr<ShardedClient>> sharded = ShardedClient::Connect(targets, options);
  if (!sharded.ok()) return sharded.status();
  absl::StatusOr<ShardedCache> cache = (*sharded)->CreateCache(config, "pagedattn-loadgen");
  if (!cache.ok()) return cache.status();
  const ForwardFn forward = [&](const ForwardCall& c, const ForwardOutput& o) {
    return (*sharded)->Forward(*cache, c, o);
  };
  if (absl::Status p = Prefill(forward, w, ""); !p.ok()) {
    (void)(*sharded)->DeleteCache(*cache);
    return p;
  }
  absl::StatusOr<Samples> s = RunUnary(forward, w, "", nullptr);
  (void)(*sharded)->DeleteCache(*cache);
  return s;
}

// The server's phase histograms (pagedattn_forward_phase_seconds): phase -> {sum s, count}.
using Phases = std::map<std::string, std::pair<double, double>>;

absl::StatusOr<Phases> ScrapePhases(const std::string& target) {
  absl::StatusOr<std::string> body = FetchMetrics(target);
  if (!body.ok()) return body.status();
  Phases phases;
  for (absl::string_view line : absl::StrSplit(*body, '\n')) {
    for (const auto& [suffix, second] :
         {std::pair{"_sum{phase=\"", false}, {"_count{phase=\"", true}}) {
      const std::string prefix = absl::StrCat("pagedattn_forward_phase_seconds", suffix);
      if (!absl::StartsWith(line, prefix)) continue;
      line.remove_prefix(prefix.size());
      const size_t end = line.find('"');
      double value = 0;
      if (end == absl::string_view::npos ||
          !absl::SimpleAtod(absl::StripAsciiWhitespace(line.substr(line.find('}') + 1)), &value)) {
        continue;
      }
      auto& entry = phases[std::string(line.substr(0, end))];
      (second ? entry.second : entry.first) = value;
    }
  }
  if (phases.empty()) return absl::NotFoundError(absl::StrCat(target, " has no phase metrics"));
  return phases;
}

// Each phase's mean microseconds per Forward between two scrapes, as a JSON object.
std::string PhaseMeans(const Phases& before, const Phases& after) {
  std::vector<std::string> parts;
  for (const auto& [phase, sum_count] : after) {
    auto it = before.find(phase);
    const double sum = sum_count.first - (it != before.end() ? it->second.first : 0);
    const double count = sum_count.second - (it != before.end() ? it->second.second : 0);
    parts.push_back(absl::StrFormat("\"%s\": %.1f", phase, count > 0 ? 1e6 * sum / count : 0.0));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

// kernel_p50: the kernel time to compare p50 with when the mode's answers carry none (events
// modes answer before the kernel ran): another mode's in the same run, named in the row.
std::string Row(const std::string& mode, const Workload& w, const Samples& s, double echo_p50,
                int64_t request_bytes, const std::string& phases = "", double kernel_p50 = 0,
                const std::string& kernel_from = "") {
  const double own_kernel = Percentile(s.kernel_us, 0.5);
  const bool borrowed = own_kernel <= 0 && kernel_p50 > 0;
  if (!borrowed) kernel_p50 = own_kernel;
  const double per_layer = s.wall_us / std::max(1, s.layers_done);
  std::vector<double> overhead;
  for (size_t i = 0; i < s.server_us.size() && i < s.kernel_us.size(); ++i) {
    overhead.push_back(s.server_us[i] - s.kernel_us[i]);
  }
  return absl::StrFormat(
      "{\"suite\": \"loadgen\", \"mode\": \"%s\", \"batch\": %d, \"ctx\": %d, \"layers\": %d, "
      "\"q_heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"dtype\": \"%s\", "
      "\"request_bytes\": %d, \"response_bytes\": %d, \"p50_us\": %.1f, \"p99_us\": %.1f, "
      "\"mean_layer_us\": %.1f, \"layers_per_s\": %.1f, \"tokens_per_s\": %.1f, "
      "\"server_p50_us\": %.1f, \"kernel_p50_us\": %.1f, \"overhead_p50_us\": %.1f, "
      "\"echo_p50_us\": %.1f, \"p50_over_echo\": %.3f, \"p50_over_kernel\": %.3f%s}",
      mode, w.shape.batch, w.shape.context, w.layers, w.q_heads, w.kv_heads, w.head_dim,
      v1::DType_Name(w.dtype), request_bytes, w.out_bytes, Percentile(s.latency_us, 0.5),
      Percentile(s.latency_us, 0.99), per_layer, 1e6 / per_layer,
      1e6 / per_layer / w.layers * w.shape.batch, Percentile(s.server_us, 0.5), kernel_p50,
      Percentile(overhead, 0.5), echo_p50,
      echo_p50 > 0 ? Percentile(s.latency_us, 0.5) / echo_p50 : 0.0,
      kernel_p50 > 0 ? Percentile(s.latency_us, 0.5) / kernel_p50 : 0.0,
      absl::StrCat(phases.empty() ? "" : absl::StrCat(", \"phases_us\": ", phases),
                   borrowed ? absl::StrCat(", \"kernel_from\": \"", kernel_from, "\"") : ""));
}

int Main() {
  std::vector<Shape> shapes;
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_cases), ',', absl::SkipEmpty())) {
    std::vector<std::string> bc = absl::StrSplit(c, 'x');
    Shape s;
    if (bc.size() != 2 || !absl::SimpleAtoi(bc[0], &s.batch) ||
        !absl::SimpleAtoi(bc[1], &s.context) || s.batch < 1 || s.context < 1) {
      std::cerr << "pagedattn-loadgen: --cases entries are BATCHxCONTEXT, each at least 1 (got '"
                << c << "')\n";
      return 2;
    }
    shapes.push_back(s);
  }
  if (shapes.empty()) {
    std::cerr << "pagedattn-loadgen: --cases names no shape\n";
    return 2;
  }
  if (const std::vector<std::string> problems = FlagProblems(); !problems.empty()) {
    for (const std::string& p : problems) std::cerr << "pagedattn-loadgen: " << p << "\n";
    return 2;
  }
  std::vector<std::string> modes =
      absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty());
  // Checked before anything runs: a mode refused halfway would have cost a prefill.
  static const absl::flat_hash_set<std::string> kModes = {
      "unary_tcp",   "unary_uds",      "unary_proto_tcp", "stream_tcp",         "stream_uds",
      "sharded_tcp", "echo_tcp",       "echo_uds",        "echo_proto_default", "ipc_tcp",
      "ipc_uds",     "ipc_events_tcp", "ipc_events_uds",  "ipc_stream_uds"};
  for (const std::string& mode : modes) {
    if (!kModes.contains(mode)) {
      std::cerr << "pagedattn-loadgen: unknown mode '" << mode << "' in --modes (see --help)\n";
      return 2;
    }
    if (mode == "sharded_tcp" && absl::GetFlag(FLAGS_shard_targets).empty()) {
      std::cerr << "pagedattn-loadgen: mode sharded_tcp needs --shard_targets\n";
      return 2;
    }
  }
  const std::string uds = absl::GetFlag(FLAGS_uds_target);
  // The server's UDS modes are left out without --uds_target, saying so; with nothing else to
  // run, that is an error, not an empty result.
  std::vector<std::string> left_out;
  for (const std::string& mode : modes) {
    if (uds.empty() && mode.find("uds") != std::string::npos && mode.rfind("echo", 0) != 0) {
      left_out.push_back(mode);
    }
  }
  if (!left_out.empty()) {
    if (left_out.size() == modes.size()) {
      std::cerr << "pagedattn-loadgen: modes " << absl::StrJoin(left_out, ", ")
                << " need --uds_target=unix:/path (the server's Unix socket)\n";
      return 2;
    }
    std::cerr << "pagedattn-loadgen: no --uds_target: " << absl::StrJoin(left_out, ", ")
              << " left out\n";
  }
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::Seconds(600);
  options.bearer_token = absl::GetFlag(FLAGS_token);
  if (options.bearer_token.empty() && std::getenv("PAGEDATTN_TOKEN") != nullptr) {
    options.bearer_token = std::getenv("PAGEDATTN_TOKEN");
  }
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
  if (!connected.ok()) {
    std::cerr << "pagedattn-loadgen: --target: " << connected.status() << "\n";
    return 2;
  }
  std::unique_ptr<Client> tcp = *std::move(connected);
  std::unique_ptr<Client> unix_client;
  if (!uds.empty()) {
    ClientOptions u = options;
    u.target = uds;
    connected = Client::Connect(u);
    if (!connected.ok()) {
      std::cerr << "pagedattn-loadgen: --uds_target: " << connected.status() << "\n";
      return 2;
    }
    unix_client = *std::move(connected);
  }
  std::unique_ptr<EchoServer> echo = StartEcho(/*tuned=*/true);
  std::unique_ptr<EchoServer> echo_default = StartEcho(/*tuned=*/false);
  auto echo_tcp = EchoChannel(absl::StrCat("127.0.0.1:", echo->port), true);
  auto echo_uds = EchoChannel("unix:" + echo->socket, true);
  auto echo_default_tcp = EchoChannel(absl::StrCat("127.0.0.1:", echo_default->port), false);

  std::vector<std::string> rows;
  for (const Shape& shape : shapes) {
    Workload w = MakeWorkload(shape);
    v1::CacheConfig config;
    config.set_num_layers(w.layers);
    config.set_num_q_heads(w.q_heads);
    config.set_num_kv_heads(w.kv_heads);
    config.set_head_dim(w.head_dim);
    config.set_page_size(absl::GetFlag(FLAGS_page_size));
    config.set_kv_dtype(w.dtype);
    const int64_t tokens = int64_t{shape.batch} * (shape.context + absl::GetFlag(FLAGS_steps) + 1);
    config.set_num_pages(tokens / config.page_size() + 2 * shape.batch + 1);
    absl::StatusOr<v1::CacheInfo> cache = tcp->CreateCache(config, "pagedattn-loadgen");
    if (!cache.ok()) {
      std::cerr << "pagedattn-loadgen: CreateCache: " << cache.status() << "\n";
      return 1;
    }
    // However this shape's run ends (a mode that fails returns at once), its pool is freed.
    absl::Cleanup delete_cache = [&] { (void)tcp->DeleteCache(cache->cache_id()); };
    std::cerr << absl::StrFormat("[%dx%d] prefill %d layers...\n", shape.batch, shape.context,
                                 w.layers);
    if (absl::Status s = Prefill(Unary(*tcp), w, cache->cache_id()); !s.ok()) {
      std::cerr << "pagedattn-loadgen: prefill: " << s << "\n";
      return 1;
    }
    const ForwardCall probe = DecodeCall(w, cache->cache_id(), 0, shape.context);
    int64_t request_bytes =
        static_cast<int64_t>(wire::ForwardRequestHead(probe.cache_id, 0, probe.spans, {}).size());
    for (const TensorArg* a : {&probe.q, &probe.k, &probe.v}) request_bytes += a->bytes + 16;
    // The echoes first: each mode's row names the echo of its transport.
    std::map<std::string, double> echo_p50;
    for (const auto& [name, channel, proto] : {std::tuple{"echo_tcp", echo_tcp, false},
                                               {"echo_uds", echo_uds, false},
                                               {"echo_proto_default", echo_default_tcp, true}}) {
      if (std::find(modes.begin(), modes.end(), name) == modes.end()) continue;
      std::cerr << absl::StrFormat("[%dx%d] %s...\n", shape.batch, shape.context, name);
      absl::StatusOr<Samples> s = RunEcho(channel, w, cache->cache_id(), proto);
      if (!s.ok()) {
        std::cerr << "pagedattn-loadgen: " << name << ": " << s.status() << "\n";
        return 1;
      }
      echo_p50[name] = Percentile(s->latency_us, 0.5);
      rows.push_back(Row(name, w, *s, 0, request_bytes));
      std::cerr << rows.back() << "\n";
    }
    double kernel_p50 = 0;  // from the last ipc mode that reported kernel times
    std::string kernel_from;
    for (const std::string& mode : modes) {
      if (mode.rfind("echo", 0) == 0) continue;
      const bool over_uds = mode.find("uds") != std::string::npos;
      Client* client = over_uds ? unix_client.get() : tcp.get();
      if (client == nullptr) continue;  // no --uds_target
      std::cerr << absl::StrFormat("[%dx%d] %s...\n", shape.batch, shape.context, mode);
      const std::string metrics = absl::GetFlag(FLAGS_metrics_target);
      absl::StatusOr<Phases> phases_before = absl::NotFoundError("not read");
      w.measuring = [&] {  // the server's phase metrics, read once the warm-up is sent
        if (!metrics.empty()) phases_before = ScrapePhases(metrics);
      };
      absl::StatusOr<Samples> s;
      if (mode.rfind("stream", 0) == 0) {
        s = RunStream(*client, w, cache->cache_id());
      } else if (mode == "unary_proto_tcp") {
        s = RunUnary(Unary(*client), w, cache->cache_id(), client);
      } else if (mode == "unary_tcp" || mode == "unary_uds") {
        s = RunUnary(Unary(*client), w, cache->cache_id(), nullptr);
      } else if (mode == "sharded_tcp") {
        s = RunSharded(w, config, options);
      } else if (mode.rfind("ipc_", 0) == 0) {
#if PAGEDATTN_WITH_CUDA
        const bool stream = mode.find("stream") != std::string::npos;  // always with events
        s = RunIpc(*client, w, cache->cache_id(),
                   stream || mode.find("events") != std::string::npos, stream);
#else
        s = absl::FailedPreconditionError("this pagedattn-loadgen was built without CUDA");
#endif
      } else {
        s = absl::InternalError(absl::StrCat("mode '", mode, "' has no runner"));
      }
      if (!s.ok()) {
        std::cerr << "pagedattn-loadgen: " << mode << ": " << s.status() << "\n";
        return 1;
      }
      w.measuring = [] {};
      if (!metrics.empty() && !phases_before.ok()) {
        std::cerr << "pagedattn-loadgen: --metrics_target: " << phases_before.status() << "\n";
        return 1;
      }
      const double floor = echo_p50[over_uds ? "echo_uds" : "echo_tcp"];
      std::string phases;
      if (phases_before.ok()) {
        absl::StatusOr<Phases> after = ScrapePhases(metrics);
        if (after.ok()) phases = PhaseMeans(*phases_before, *after);
      }
      rows.push_back(Row(mode, w, *s, floor, request_bytes, phases, kernel_p50, kernel_from));
      std::cerr << rows.back() << "\n";
      if (Percentile(s->kernel_us, 0.5) > 0 && mode.rfind("ipc", 0) == 0) {
        kernel_p50 = Percentile(s->kernel_us, 0.5);  // same kernels, same device tensors
        kernel_from = mode;
      }
    }
  }
  if (const int mib = absl::GetFlag(FLAGS_echo_mib); mib > 0) {
    for (const auto& [name, channel, proto] : {std::tuple{"echo_tcp", echo_tcp, false},
                                               {"echo_proto_default", echo_default_tcp, true}}) {
      std::cerr << absl::StrFormat("[%d MiB] %s...\n", mib, name);
      absl::StatusOr<Samples> s = RunEchoMessages(channel, mib, proto, 30);
      if (!s.ok()) {
        std::cerr << "pagedattn-loadgen: " << name << ": " << s.status() << "\n";
        return 1;
      }
      const double p50 = Percentile(s->latency_us, 0.5);
      rows.push_back(absl::StrFormat(
          "{\"suite\": \"loadgen\", \"mode\": \"%s\", \"message_mib\": %d, \"p50_us\": %.1f, "
          "\"p99_us\": %.1f, \"gb_per_s\": %.3f}",
          name, mib, p50, Percentile(s->latency_us, 0.99), 2.0 * (mib << 20) / p50 / 1e3));
      std::cerr << rows.back() << "\n";
    }
  }
  const std::string json = "[\n" + absl::StrJoin(rows, ",\n") + "\n]\n";
  if (!absl::GetFlag(FLAGS_json).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_json));
    out << json;
    if (!out.flush()) {
      std::cerr << "pagedattn-loadgen: --json: could not write " << absl::GetFlag(FLAGS_json)
                << ": " << std::strerror(errno) << "; the rows:\n"
                << json;
      return 1;
    }
  } else {
    std::cout << json;
  }
  echo->server->Shutdown();
  echo_default->server->Shutdown();
  unlink(echo->socket.c_str());
  unlink(echo_default->socket.c_str());
  return 0;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) {
  constexpr char kUsage[] =
      "model-shaped load against a pagedattn server, beside a bare gRPC echo of the same bytes.\n"
      "  pagedattn-loadgen --target=HOST:PORT [--uds_target=unix:/path] [--cases=64x4096,...]\n"
      "The rows, one per (mode, shape), go to stderr as they are measured and at the end as one\n"
      "JSON list to stdout (or --json).\n";
  // Answered here: absl's own --help lists only the flags of a file named like the program
  // (loadgen.cc is not), and exits 1.
  switch (pagedattn::FindInfoFlag(argc, argv)) {
    case pagedattn::InfoFlag::kHelp: {
      std::cout << "pagedattn-loadgen: " << kUsage << "\nflags:\n";
      std::map<std::string, absl::CommandLineFlag*> flags;
      for (const auto& [name, flag] : absl::GetAllFlags()) {
        if (absl::StrContains(flag->Filename(), "client/loadgen.cc")) {
          flags[std::string(name)] = flag;
        }
      }
      pagedattn::PrintFlagsHelp(std::cout, flags);
      return 0;
    }
    case pagedattn::InfoFlag::kVersion:
      std::cout << "pagedattn-loadgen " << PAGEDATTN_VERSION << "\n";
      return 0;
    case pagedattn::InfoFlag::kNone:
      break;
  }
  absl::SetProgramUsageMessage(kUsage);
  // A name that is no flag or a value that does not parse: usage errors, each named (absl's
  // parser exits 1 on the first).
  if (!pagedattn::NoUnparsableFlags(
          "pagedattn-loadgen", argc, argv,
          pagedattn::ProgramFlags(absl::GetAllFlags(), "client/loadgen.cc"),
          [](absl::string_view name) { return absl::FindCommandLineFlag(name) != nullptr; })) {
    return 2;
  }
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::cerr << "pagedattn-loadgen: unexpected argument '" << positional[1]
              << "' (every setting is a --flag; see --help)\n";
    return 2;
  }
  if (!pagedattn::NoRepeatedFlags("pagedattn-loadgen", argc, argv,
                                  pagedattn::FlagKinds(absl::GetAllFlags(), "client/loadgen.cc"),
                                  {"token"})) {
    return 2;
  }
  return pagedattn::Main();
}
