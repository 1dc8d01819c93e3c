// Handlers: translate, call the core, translate back; Unary() holds what every unary call
// but Forward shares.
#include "server/service/attention_service.h"

#include <bit>
#include <chrono>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/core/backend_factory.h"
#include "server/core/error_info.h"
#include "server/service/convert.h"
#include "server/service/log_text.h"
#include "server/service/request_parse.h"
#include "server/service/status.h"
#include "server/service/throttled_log.h"
#include "spdlog/spdlog.h"

namespace pagedattn {
namespace {

// The most bytes of one ListCaches answer: gRPC's default receive limit.
constexpr int64_t kListPageBytes = int64_t{4} << 20;

// What kind of error a message tells, for throttling: its words before the first digit (at most
// 40 bytes), so that "out of KV pages: needs 5" and "... needs 7" are one kind and a capacity
// error another, each with its own count of lines held back.
absl::string_view MessageKind(absl::string_view message) {
  size_t end = 0;
  while (end < message.size() && end < 40 && !absl::ascii_isdigit(message[end])) ++end;
  return message.substr(0, end);
}

StopToken StopFor(grpc::ServerContextBase* ctx, const RpcGate* gate) {
  const auto deadline = ctx->deadline();
  return StopToken([ctx] { return ctx->IsCancelled(); },
                   deadline == std::chrono::system_clock::time_point::max()
                       ? absl::InfiniteFuture()
                       : absl::FromChrono(deadline),
                   [gate] { return gate->stopping(); });
}

}  // namespace

Rpc::Rpc(const char* method, grpc::ServerContextBase* ctx, const RpcGate* gate)
    : Rpc(method, ctx, gate, ctx->peer()) {}

Rpc::Rpc(const char* method, grpc::ServerContextBase* ctx, const RpcGate* gate, std::string peer)
    : method_(method),
      ctx_(ctx),
      peer_(std::move(peer)),
      stop_(StopFor(ctx, gate)),
      start_(std::chrono::steady_clock::now()) {}

void Rpc::set_cache(absl::string_view cache_id) { cache_ = ForLog(cache_id, LogText::kField); }

std::string Rpc::Caller() const {
  std::string out = tenant_.empty() ? "" : absl::StrCat("tenant=", tenant_, " ");
  absl::StrAppend(&out, "peer=", ForLog(peer_));
  const auto& metadata = ctx_->client_metadata();
  if (const auto id = metadata.find(kRequestIdKey); id != metadata.end()) {
    absl::StrAppend(
        &out,
        " req=", ForLog(absl::string_view(id->second.data(), id->second.size()), LogText::kField));
  }
  return out;
}

double Rpc::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

namespace {
// The group of a tenant's cache, length-prefixed: no tenant's cache shares another's group (the
// texts are the callers').
std::string QueueGroup(absl::string_view tenant, absl::string_view cache_id) {
  return absl::StrCat(tenant.size(), ":", tenant, cache_id);
}
}  // namespace

QueueSlot LayerQueue(absl::string_view tenant, absl::string_view cache_id, int32_t layer) {
  std::string group = QueueGroup(tenant, cache_id);
  std::string key = absl::StrCat(layer, "/", group);
  return {std::string(tenant), std::move(group), std::move(key), false};
}

QueueSlot CacheQueue(absl::string_view tenant, absl::string_view cache_id) {
  std::string group = QueueGroup(tenant, cache_id);
  std::string key = absl::StrCat("*/", group);
  return {std::string(tenant), std::move(group), std::move(key), true};
}

absl::Status AttentionServiceImpl::Authenticate(Rpc& rpc, const grpc::ServerContextBase& ctx) {
  if (auth_ == nullptr) return absl::OkStatus();
  absl::StatusOr<std::string> tenant = auth_->Authenticate(ctx);
  if (!tenant.ok()) return tenant.status();
  rpc.set_tenant(*std::move(tenant));
  return absl::OkStatus();
}

// A unary call's reactor: in the gate until its answer has gone out (OnDone), not only until
// the handler returns, so that shutdown's wait for idle covers sending an answer of megabytes.
class AttentionServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit UnaryReactor(RpcGate* gate) : gate_(gate), entered_(gate->Enter()) {}
  bool entered() const { return entered_; }
  void OnDone() override {
    if (entered_) gate_->Leave();
    delete this;
  }

 private:
  RpcGate* const gate_;
  const bool entered_;  // false while draining: the call is refused
};

template <typename Request, typename Response>
grpc::ServerUnaryReactor* AttentionServiceImpl::Unary(
    const char* method, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
    grpc::ByteBuffer* resp,
    absl::Status (AttentionServiceImpl::*body)(Rpc&, const Request&, Response*),
    QueueSlot (*queue)(const Request&, const std::string& tenant)) {
  UnaryReactor* reactor = new UnaryReactor(gate_);
  if (!reactor->entered()) {
    Rpc call(method, ctx, gate_);
    reactor->Finish(Finish(
        call, absl::UnavailableError("the server is shutting down; retry (on another replica)")));
    return reactor;
  }
  // The caller as the call arrived, not after its wait in the queue (its peer may be gone), and
  // its tenant, whose turn on the threads it takes.
  Rpc arrived(method, ctx, gate_);
  if (absl::Status s = Authenticate(arrived, *ctx); !s.ok()) {
    reactor->Finish(Finish(arrived, s));
    return reactor;
  }
  const std::string tenant = arrived.tenant();
  // A release or truncate (the queued calls) is on its way to its cache from here: no idle sweep
  // takes the cache while it waits for a thread and its turn.
  if (queue != nullptr) arrived.set_arrival(manager_->Arrive());
  // Not on gRPC's callback threads, which are few (two on a two-core host) and answer health
  // checks and Forwards: a CreateCache fills its pool for seconds on the CPU backend, and three
  // at once held a health check for 15 s. ctx, req and resp live until Finish.
  auto run = [this, call = std::move(arrived), method, ctx, req, resp, reactor, body,
              queue]() mutable {
    // The request, parsed under its hold of the budget (held until the answer is serialized).
    struct Parsed {
      std::optional<ByteBudget::Hold> hold;
      Request request;
    };
    auto parsed = std::make_shared<Parsed>();
    absl::Status s = [&]() -> absl::Status {
      if (absl::Status s = CheckRequestArrived(*req); !s.ok()) return s;
      // Authenticated: a caller without a token gets no parse at all.
      if (budget_ != nullptr) {
        absl::StatusOr<ByteBudget::Hold> held = HoldForParse(*budget_, method, req->Length());
        if (!held.ok()) return held.status();
        parsed->hold = *std::move(held);
      }
      if (absl::Status s = ParseRequest(*req, method, &parsed->request); !s.ok()) return s;
      // Parsed: what the call holds while it waits for its turn is the message's own memory.
      if (parsed->hold.has_value()) parsed->hold->ShrinkTo(parsed->request.SpaceUsedLong());
      return absl::OkStatus();
    }();
    if (!s.ok()) {
      reactor->Finish(Finish(call, s));
      return;
    }
    // The body, the answer's bytes, Finish.
    auto answer = [this, resp, reactor, body, parsed](Rpc& rpc, bool queued) {
      reactor->Finish(Finish(rpc, [&]() -> absl::Status {
        // Cancelled, past its deadline or stopped by a drain while it waited: not run.
        if (queued) {
          if (absl::Status s = rpc.stop().Check(); !s.ok()) return s;
        }
        Response response;
        if (absl::Status s = (this->*body)(rpc, parsed->request, &response); !s.ok()) return s;
        absl::StatusOr<grpc::ByteBuffer> bytes = SerializeResponse(response);
        if (!bytes.ok()) return bytes.status();
        *resp = *std::move(bytes);
        return absl::OkStatus();
      }()));
    };
    if (queue == nullptr) {
      answer(call, /*queued=*/false);
    } else {
      // Its turn among the calls on the same layer (or cache): waiting, it holds no thread.
      layer_queues_->Run(queue(parsed->request, call.tenant()),
                         [call, answer]() mutable { answer(call, /*queued=*/true); });
    }
  };
  if (queue != nullptr) {
    // A release or truncate takes its place among its cache's calls as it arrives: parsed here
    // (a short message), queued, it runs after every call on its cache (a release) or layer (a
    // truncate) that came before it. The rest wait for a control thread.
    run();
  } else {
    control_executor_->Post(std::move(run), tenant);
  }
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                              const grpc::ByteBuffer* req,
                                                              grpc::ByteBuffer* resp) {
  return Unary("GetServerInfo", ctx, req, resp, &AttentionServiceImpl::RunGetServerInfo);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ValidateCacheConfig(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) {
  return Unary("ValidateCacheConfig", ctx, req, resp,
               &AttentionServiceImpl::RunValidateCacheConfig);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CreateCache(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* req,
                                                            grpc::ByteBuffer* resp) {
  return Unary("CreateCache", ctx, req, resp, &AttentionServiceImpl::RunCreateCache);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetCache(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* req,
                                                         grpc::ByteBuffer* resp) {
  return Unary("GetCache", ctx, req, resp, &AttentionServiceImpl::RunGetCache);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListCaches(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* req,
                                                           grpc::ByteBuffer* resp) {
  return Unary("ListCaches", ctx, req, resp, &AttentionServiceImpl::RunListCaches);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DeleteCache(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* req,
                                                            grpc::ByteBuffer* resp) {
  return Unary("DeleteCache", ctx, req, resp, &AttentionServiceImpl::RunDeleteCache);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ReleaseSequences(grpc::CallbackServerContext* ctx,
                                                                 const grpc::ByteBuffer* req,
                                                                 grpc::ByteBuffer* resp) {
  // A release needs the cache's layers quiet: a whole-cache turn, which waits for their running
  // calls while their later ones wait for it (one thread held, not one a layer).
  return Unary(
      "ReleaseSequences", ctx, req, resp, &AttentionServiceImpl::RunReleaseSequences,
      +[](const v1::ReleaseSequencesRequest& r, const std::string& tenant) {
        return CacheQueue(tenant, r.cache_id());
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::TruncateSequences(grpc::CallbackServerContext* ctx,
                                                                  const grpc::ByteBuffer* req,
                                                                  grpc::ByteBuffer* resp) {
  return Unary(
      "TruncateSequences", ctx, req, resp, &AttentionServiceImpl::RunTruncateSequences,
      +[](const v1::TruncateSequencesRequest& r, const std::string& tenant) {
        return LayerQueue(tenant, r.cache_id(), r.layer());
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::RegisterMemory(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* req,
                                                               grpc::ByteBuffer* resp) {
  return Unary("RegisterMemory", ctx, req, resp, &AttentionServiceImpl::RunRegisterMemory);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnregisterMemory(grpc::CallbackServerContext* ctx,
                                                                 const grpc::ByteBuffer* req,
                                                                 grpc::ByteBuffer* resp) {
  return Unary("UnregisterMemory", ctx, req, resp, &AttentionServiceImpl::RunUnregisterMemory);
}

// Counts the call in the metrics and logs one line: debug for success and the caller's
// mistakes, info for limits and authentication (RESOURCE_EXHAUSTED, UNAUTHENTICATED,
// PERMISSION_DENIED: what an operator may have to act on; at most one a second for each client
// connection, method and code), error for the server's own failures (e.g. a CUDA error). Of the
// request's metadata only x-request-id is logged (Rpc::Caller), so tokens stay out of logs.
grpc::Status AttentionServiceImpl::Finish(const Rpc& rpc, const absl::Status& s) {
  if (metrics_ != nullptr) metrics_->RecordRpc(rpc.method(), s.code());
  const bool server_error = s.code() == absl::StatusCode::kInternal ||
                            s.code() == absl::StatusCode::kUnknown ||
                            s.code() == absl::StatusCode::kDataLoss;
  const bool limit = s.code() == absl::StatusCode::kResourceExhausted ||
                     s.code() == absl::StatusCode::kUnauthenticated ||
                     s.code() == absl::StatusCode::kPermissionDenied;
  const spdlog::level::level_enum level = server_error ? spdlog::level::err
                                          : limit      ? spdlog::level::info
                                                       : spdlog::level::debug;
  // Nothing of the line is built unless it is logged: a Forward's answer is waiting.
  if (!spdlog::should_log(level)) return ToGrpcStatus(s);
  const double ms = rpc.seconds() * 1e3;
  const std::string who = absl::StrCat("cache=", rpc.cache(), " ", rpc.Caller());
  if (s.ok()) {
    spdlog::debug("rpc {} {} ok {:.3f} ms", rpc.method(), who, ms);
  } else if (server_error) {
    // Throttled too: a device stuck in an error fails every call, and each would be a line.
    LogThrottled(spdlog::level::err,
                 absl::StrCat("server error ", rpc.method(), " ",
                              absl::StatusCodeToString(s.code()), " ", MessageKind(s.message())),
                 absl::StrFormat("rpc %s %s %s %.3f ms: %s", rpc.method(), who,
                                 absl::StatusCodeToString(s.code()), ms, ForLog(s.message())));
  } else if (limit) {
    LogThrottled(
        spdlog::level::info,
        absl::StrCat(rpc.peer(), " ", rpc.method(), " ", absl::StatusCodeToString(s.code()), " ",
                     MessageKind(s.message())),
        absl::StrCat("rpc ", rpc.method(), " ", who, " ", absl::StatusCodeToString(s.code()), ": ",
                     EscapeControl(s.message())));
  } else {
    spdlog::debug("rpc {} {} {} {:.3f} ms: {}", rpc.method(), who,
                  absl::StatusCodeToString(s.code()), ms, EscapeControl(s.message()));
  }
  return ToGrpcStatus(s);
}

void FillCapabilities(BackendKind backend, v1::Capabilities* out) {
  for (int d : backend == BackendKind::kCuda
                   ? std::vector<int>(kCudaHeadDims.begin(), kCudaHeadDims.end())
                   : std::vector<int>(kCpuHeadDims.begin(), kCpuHeadDims.end())) {
    out->add_head_dims(d);
  }
  out->set_min_page_size(kMinPageSize);
  out->set_max_page_size(kMaxPageSize);
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    if (IsSupportedKvDType(backend, t)) out->add_kv_dtypes(static_cast<v1::DType>(t));
    if (IsSupportedIoDType(t)) out->add_io_dtypes(static_cast<v1::DType>(t));
  }
  out->set_max_gqa_ratio(kMaxGqaRatio);
  out->set_max_num_layers(kMaxNumLayers);
  out->set_max_num_heads(kMaxNumHeads);
  out->set_supports_causal(true);
  out->set_supports_non_causal(true);
  out->set_supports_lse(true);
  out->set_supports_custom_sm_scale(true);
  out->set_supports_device_tensors(SupportsDeviceTensors(backend));
  out->set_supports_sliding_window(SupportsSlidingWindow(backend));
  out->set_supports_logit_softcap(SupportsLogitSoftcap(backend));
  out->set_supports_sinks(SupportsSinks(backend));
}

absl::Status AttentionServiceImpl::RunGetServerInfo(Rpc&, const v1::GetServerInfoRequest&,
                                                    v1::ServerInfo* resp) {
  Backend& b = manager_->backend();
  resp->set_version(PAGEDATTN_VERSION);
  resp->set_backend(b.name());
  resp->set_device_name(b.device_name());
  resp->set_device_count(b.device_count());
  if (absl::StatusOr<MemoryInfo> mem = b.memory(0); mem.ok()) {
    resp->set_device_memory_bytes(mem->total_bytes);
    resp->set_device_free_bytes(mem->free_bytes);
  }
  for (int d = 0; d < b.device_count(); ++d) {
    if (std::string cc = b.compute_capability(d); !cc.empty()) {
      resp->add_compute_capabilities(cc);
    }
  }
  for (const std::string& arch : BuiltCudaArchitectures()) resp->add_cuda_architectures(arch);
  FillCapabilities(b.kind(), resp->mutable_capabilities());
  if (regions_ != nullptr && !regions_->enabled()) {  // --max_memory_regions=0
    resp->mutable_capabilities()->set_supports_device_tensors(false);
  }
  const CacheManagerLimits& limits = manager_->limits();
  v1::ServerLimits* out = resp->mutable_limits();
  out->set_max_forward_tokens(limits.forward.max_tokens);
  out->set_max_forward_spans(limits.forward.max_spans);
  out->set_max_message_bytes(limits.forward.max_response_bytes);
  out->set_max_caches_per_tenant(limits.max_caches_per_tenant);
  out->set_max_total_pool_bytes(limits.max_total_pool_bytes);
  out->set_pool_free_bytes(manager_->PoolBytesFree(0));
  out->set_cache_idle_timeout_s(  // rounded up: a timeout under a second is not "none"
      absl::ToInt64Seconds(absl::Ceil(limits.cache_idle_timeout, absl::Seconds(1))));
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunValidateCacheConfig(Rpc&, const v1::CacheConfig& req,
                                                          v1::ValidateCacheConfigResponse* resp) {
  ToProto(manager_->Validate(FromProto(req)), resp);
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunCreateCache(Rpc& rpc, const v1::CreateCacheRequest& req,
                                                  v1::CacheInfo* resp) {
  if (!req.has_config()) {
    ValidationResult missing;
    missing.violations.push_back(
        {"config",
         "config is required: the cache's CacheConfig (ValidateCacheConfig checks one "
         "without allocating)"});
    return ValidationStatus(missing);
  }
  absl::StatusOr<std::shared_ptr<Cache>> cache =
      manager_->Create(FromProto(req.config()), req.name(), rpc.tenant(), rpc.stop());
  if (!cache.ok()) return cache.status();
  rpc.set_cache((*cache)->id());
  ToProto(**cache, resp);
  const CacheGeometry& g = (*cache)->geometry();
  spdlog::info(
      "created cache {} '{}' {}: {} layer{}, {}/{} heads x {}, {}{}, {} pages x {} tokens, "
      "{} bytes",
      (*cache)->id(), ForLog((*cache)->name(), LogText::kQuoted), rpc.Caller(), g.num_layers,
      g.num_layers == 1 ? "" : "s", g.num_q_heads, g.num_kv_heads, g.head_dim,
      DTypeName(g.kv_dtype), g.layers.empty() ? "" : " with layer variants", resp->num_pages(),
      resp->config().page_size(), resp->bytes());
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunGetCache(Rpc& rpc, const v1::GetCacheRequest& req,
                                               v1::CacheInfo* resp) {
  rpc.set_cache(req.cache_id());
  absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req.cache_id(), rpc.tenant());
  if (!cache.ok()) return cache.status();
  ToProto(**cache, resp);
  resp->mutable_stats()->set_memory_regions(regions_->CountFor((*cache)->id()));
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunListCaches(Rpc& rpc, const v1::ListCachesRequest& req,
                                                 v1::ListCachesResponse* resp) {
  if (req.page_size() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size must be >= 0 (0: as many as fit a message; got ", req.page_size(), ")"));
  }
  absl::StatusOr<std::vector<std::shared_ptr<Cache>>> caches =
      manager_->ListAfter(rpc.tenant(), req.page_token());
  if (!caches.ok()) return caches.status();
  // A page ends at page_size caches or where the next would take the answer past 4 MiB,
  // gRPC's default receive limit, which a client that never raised it keeps (a config with many
  // sinks is large; the server's own --max_message_mb may be smaller); it holds at least one.
  const int64_t limit = manager_->limits().forward.max_response_bytes;
  const int64_t max_bytes =
      std::min<int64_t>(limit > 0 ? limit : kListPageBytes, kListPageBytes) - 1024;
  int64_t bytes = 0;
  for (size_t i = 0; i < caches->size(); ++i) {
    const Cache& cache = *(*caches)[i];
    v1::CacheInfo info;
    ToProto(cache, &info);
    info.mutable_stats()->set_memory_regions(regions_->CountFor(cache.id()));
    const int64_t size = static_cast<int64_t>(info.ByteSizeLong()) + 8;
    const bool full = (req.page_size() > 0 && i == static_cast<size_t>(req.page_size())) ||
                      (i > 0 && bytes + size > max_bytes);
    if (full) {
      resp->set_next_page_token(manager_->ListToken(*(*caches)[i - 1]));
      break;
    }
    bytes += size;
    *resp->add_caches() = std::move(info);
  }
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunDeleteCache(Rpc& rpc, const v1::DeleteCacheRequest& req,
                                                  v1::DeleteCacheResponse* resp) {
  rpc.set_cache(req.cache_id());
  absl::StatusOr<int64_t> freed = manager_->Delete(req.cache_id(), rpc.tenant());
  if (!freed.ok()) return freed.status();
  regions_->ReleaseCache(req.cache_id());
  resp->set_freed_bytes(*freed);
  spdlog::info("deleted cache {} {} ({} bytes)", rpc.cache(), rpc.Caller(), *freed);
  return absl::OkStatus();
}

absl::StatusOr<ForwardAnswer> AttentionServiceImpl::RunForward(
    Rpc& rpc, const std::string& cache_id, const wire::ForwardRequestRef& request,
    size_t request_bytes) {
  rpc.set_cache(cache_id);
  absl::StatusOr<std::shared_ptr<Cache>> cache =
      manager_->GetToUse(cache_id, rpc.tenant(), std::move(rpc.arrival()));
  if (!cache.ok()) return cache.status();
  const CacheGeometry& g = (*cache)->geometry();
  // Checked before anything is allocated for it: a request's sizes are the caller's word.
  ForwardArgs args = ToForwardArgs(request, nullptr);
  if (args.device_tensors) return RunDeviceForward(rpc, **cache, request, std::move(args));
  if (request.out.present || request.lse.present || request.sync.present) {
    return absl::InvalidArgumentError(
        "out, lse and sync are set in a request only when q, k and v are device tensors "
        "(Tensor.device_buffer); otherwise the answer carries out and lse");
  }
  if (absl::Status s = (*cache)->Check(args); !s.ok()) return s;
  const ForwardOutputBytes output = ForwardOutputSizes(g, args);
  const size_t out_bytes = static_cast<size_t>(output.out);
  const size_t lse_bytes = static_cast<size_t>(output.lse);
  // What the call holds against the server's budget for data in flight: the request's bytes
  // and the buffers (q, k and v staged, out and lse), until the answer has gone out. The
  // answer's bytes are the buffers' (EncodeResponse), which stay as long as gRPC holds them:
  // an answer a client does not read keeps its bytes in the budget, and the server refuses
  // others (RESOURCE_EXHAUSTED) instead of growing past it.
  const int64_t held = static_cast<int64_t>(request_bytes + QBytes(request) + 2 * KvBytes(request) +
                                            out_bytes + lse_bytes);
  std::optional<ByteBudget::Hold> hold =
      budget_ != nullptr ? budget_->TryHold(held) : std::make_optional<ByteBudget::Hold>();
  if (!hold.has_value()) {
    return WithErrorInfo(
        absl::ResourceExhaustedError(absl::StrCat(
            "the server is busy: ", budget_->used(),
            " bytes of request memory are in use (Forward ",
            "data and requests being parsed), this call needs ", held, " more and the budget is ",
            budget_->limit(),
            " (--request_memory_mb; an answer's bytes count until it is sent); retry shortly")),
        {"SERVER_BUSY",
         {{"bytes_in_flight", budget_->used()},
          {"bytes_needed", held},
          {"budget_bytes", budget_->limit()}}});
  }
  ForwardAnswer answer;
  const absl::Time stage_start = absl::Now();
  absl::StatusOr<std::unique_ptr<ForwardBuffers>> buffers =
      manager_->backend().AcquireForwardBuffers(g.device, QBytes(request), KvBytes(request),
                                                out_bytes, lse_bytes);
  if (!buffers.ok()) return buffers.status();
  // The hold goes with the buffers (after them: members are destroyed in reverse order).
  struct HeldBuffers {
    ByteBudget::Hold hold;
    std::unique_ptr<ForwardBuffers> buffers;
  };
  auto held_buffers =
      std::make_shared<HeldBuffers>(HeldBuffers{*std::move(hold), *std::move(buffers)});
  answer.buffers = std::shared_ptr<ForwardBuffers>(held_buffers, held_buffers->buffers.get());
  args = ToForwardArgs(request, answer.buffers.get());
  answer.stage_in_us = absl::ToDoubleMicroseconds(absl::Now() - stage_start);
  absl::StatusOr<ForwardResult> result = (*cache)->Forward(args, rpc.stop(), &answer.timings);
  if (!result.ok()) return result.status();
  answer.result = *std::move(result);
  RecordForward(rpc, args);
  return answer;
}

void AttentionServiceImpl::RecordForward(const Rpc& rpc, const ForwardArgs& args) {
  if (metrics_ == nullptr) return;
  int64_t appended = 0, queries = 0;
  for (const SpanRequest& s : args.spans) {
    appended += s.num_new_tokens;
    queries += s.num_queries;
  }
  metrics_->RecordForward(rpc.seconds(), appended, queries);
}

absl::StatusOr<ForwardAnswer> AttentionServiceImpl::RunDeviceForward(
    Rpc& rpc, Cache& cache, const wire::ForwardRequestRef& request, ForwardArgs args) {
  if (!SupportsDeviceTensors(manager_->backend().kind())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device tensors (Tensor.device_buffer) need the CUDA backend; this server runs the ",
        manager_->backend().name(), " backend: send the tensors' data instead"));
  }
  struct Named {
    const char* name;
    const wire::TensorRef& ref;
    TensorView& view;
  };
  const Named tensors[] = {{"q", request.q, args.q},
                           {"k", request.k, args.k},
                           {"v", request.v, args.v},
                           {"out", request.out, args.out},
                           {"lse", request.lse, args.lse}};
  for (const Named& t : tensors) {
    if (t.ref.present && !t.ref.on_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "q, k, v, out and lse are all device tensors (Tensor.device_buffer) or none is; ", t.name,
          " carries data"));
    }
  }
  if (absl::Status s = cache.Check(args); !s.ok()) return s;
  // Every address checked before anything runs; the pins keep the mappings until it is done.
  std::vector<MemoryRegistry::Pin> pins;
  for (const Named& t : tensors) {
    if (!t.ref.present) continue;
    absl::StatusOr<char*> address =
        regions_->Resolve(t.ref.region_id, t.ref.offset, static_cast<int64_t>(t.view.size_bytes),
                          cache.id(), rpc.tenant(), t.name, &pins);
    if (!address.ok()) return address.status();
    t.view.data = *address;
  }
  const wire::DeviceSyncRef& sync = request.sync;
  for (const auto& [name, index, event] :
       {std::tuple{"wait_event", sync.wait_event, &args.wait_event},
        {"done_event", sync.done_event, &args.done_event}}) {
    if (index == 0) continue;
    absl::StatusOr<void*> handle =
        regions_->ResolveEvent(sync.region_id, index, cache.id(), rpc.tenant(), name, &pins);
    if (!handle.ok()) return handle.status();
    *event = *handle;
  }
  ForwardAnswer answer;
  answer.device_tensors = true;
  absl::StatusOr<ForwardResult> result = cache.Forward(args, rpc.stop(), &answer.timings);
  if (!result.ok()) return result.status();
  answer.result = *std::move(result);
  RecordForward(rpc, args);
  return answer;
}

namespace {

int64_t Micros(double us) { return static_cast<int64_t>(us + 0.5); }

// A message of an open step (one that sets no spans) carries a layer and its tensors; the cache
// and the options are the opening message's. One that names another cache or other options
// would run with the step's silently, so it is refused (the same ones are harmless).
// default_scale: the step's cache's scale when none is set; unknown (the cache is gone), a
// layer's scale is not checked: the layer fails for its cache.
absl::Status CheckStepLayer(const wire::ForwardRequestRef& r, const std::string& step_cache_id,
                            const wire::ForwardOptionsRef& step,
                            std::optional<float> default_scale) {
  const wire::ForwardOptionsRef& o = r.options;
  const bool other_cache = !r.cache_id.empty() && r.cache_id != step_cache_id;
  // What the options mean, not how they were sent: causal unset is causal, a scale unset is
  // 1/sqrt(head_dim), and a scale repeated bit for bit is the same (a NaN too: the layer then
  // fails for its scale, as the step's did).
  const std::optional<float> step_scale = step.sm_scale ? step.sm_scale : default_scale;
  const bool same_scale =
      !o.sm_scale.has_value() || !step_scale.has_value() ||
      std::bit_cast<uint32_t>(*o.sm_scale) == std::bit_cast<uint32_t>(*step_scale);
  const bool other_options = (o.causal.has_value() && *o.causal != step.causal.value_or(true)) ||
                             !same_scale || (o.return_lse && !step.return_lse);
  if (!other_cache && !other_options) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      other_cache ? "cache_id" : "options", " of a Step message that sets no spans ",
      other_cache ? "differs" : "differ",
      " from "
      "the open step's: such a message carries only a layer and its q/k/v, and runs with the "
      "cache and options of the message that opened the step; set spans to open a new step"));
}

}  // namespace

// A unary Forward from its arrival to its answer. ctx, req and resp live until the reactor's
// Finish.
struct AttentionServiceImpl::UnaryForward {
  Rpc rpc;  // started as the call arrived
  grpc::CallbackServerContext* ctx;
  const grpc::ByteBuffer* req;
  grpc::ByteBuffer* resp;
  grpc::ServerUnaryReactor* reactor;
  ReceivedForward received;
  double parse_us = 0;
  // Its wait for its layer's turn and a thread; -1: it ran on the thread it arrived on,
  // at once.
  double queue_us = -1;
};

grpc::ServerUnaryReactor* AttentionServiceImpl::Forward(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* req,
                                                        grpc::ByteBuffer* resp) {
  UnaryReactor* reactor = new UnaryReactor(gate_);
  if (!reactor->entered()) {
    Rpc call("Forward", ctx, gate_);
    reactor->Finish(Finish(
        call, absl::UnavailableError("the server is shutting down; retry (on another replica)")));
    return reactor;
  }
  auto call = std::make_shared<UnaryForward>(
      UnaryForward{Rpc("Forward", ctx, gate_), ctx, req, resp, reactor, {}});
  if (absl::Status s = Authenticate(call->rpc, *ctx); !s.ok()) {
    reactor->Finish(Finish(call->rpc, s));
    return reactor;
  }
  // On its way to its cache from here (its parse, its layer's turn, its wait for a thread): no
  // idle sweep takes the cache meanwhile.
  call->rpc.set_arrival(manager_->Arrive());
  // Parsed here (where its bytes lie, not copied) and queued for its layer as it arrives: it
  // runs after every call on that layer, or a release of its cache, that came before it.
  StartForwardCall(std::move(call));
  return reactor;
}

void AttentionServiceImpl::StartForwardCall(std::shared_ptr<UnaryForward> call) {
  UnaryForward& f = *call;
  const double start_us = f.rpc.seconds() * 1e6;  // from its arrival to its parse
  absl::Status s = [&]() -> absl::Status {
    // (Authenticated.) Cancelled, past its deadline or stopped by a drain already: nothing of it
    // is parsed or held.
    if (absl::Status s = f.rpc.stop().Check(); !s.ok()) return s;
    // The message's bytes go with a ByteBuffer of the call's: the call may end (and UnaryForward
    // go) on a thread that is not gRPC's (ReceivedForward::buffer).
    f.received.buffer = *f.req;
    return ParseForward(f.received.buffer, manager_->limits().forward.max_spans, &f.received);
  }();
  if (!s.ok()) {
    f.received = ReceivedForward();
    f.reactor->Finish(Finish(f.rpc, s));
    return;
  }
  f.parse_us = f.rpc.seconds() * 1e6 - start_us;
  const wire::ForwardRequestRef& r = f.received.request;
  // Its turn on its layer: waiting (behind a Forward, a Step's layer or a truncation of that
  // layer of that cache) it holds no thread.
  const double queued_us = f.rpc.seconds() * 1e6;
  const std::thread::id arrived_on = std::this_thread::get_id();
  layer_queues_->Run(
      LayerQueue(f.rpc.tenant(), r.cache_id, r.layer),
      [this, call, start_us, queued_us, arrived_on] {
        UnaryForward& f = *call;
        if (!forward_here_ || std::this_thread::get_id() != arrived_on) {
          f.queue_us = start_us + (f.rpc.seconds() * 1e6 - queued_us);
        }
        RunForwardCall(f);
      },
      /*here=*/forward_here_);
}

void AttentionServiceImpl::RunForwardCall(UnaryForward& f) {
  const absl::Status status = [&]() -> absl::Status {
    Rpc& rpc = f.rpc;
    // Stopped while it waited for its layer: not run.
    if (absl::Status s = rpc.stop().Check(); !s.ok()) return s;
    const wire::ForwardRequestRef& request = f.received.request;
    absl::StatusOr<ForwardAnswer> answer =
        RunForward(rpc, request.cache_id, request, f.received.bytes);
    if (!answer.ok()) return answer.status();
    const double before_encode_us = rpc.seconds() * 1e6;
    *f.resp = answer->device_tensors
                  ? EncodeDeviceResponse(answer->result, request, /*step=*/false, 0, 0, 0)
                  : EncodeResponse(answer->result, answer->buffers, /*step=*/false, 0, 0, 0);
    const double server_us = rpc.seconds() * 1e6;
    f.ctx->AddTrailingMetadata("pagedattn-server-us", std::to_string(Micros(server_us)));
    f.ctx->AddTrailingMetadata("pagedattn-kernel-us",
                               std::to_string(Micros(answer->timings.kernel_us)));
    if (metrics_ != nullptr) {
      metrics_->RecordForwardPhases(f.parse_us, answer->stage_in_us, answer->timings,
                                    server_us - before_encode_us, f.queue_us);
    }
    return absl::OkStatus();
  }();
  // The request's pieces go before the answer does (the call's ByteBuffer keeps the bytes until
  // gRPC lets go of it): nothing is freed on this thread once the answer may be on its way.
  f.received = ReceivedForward();
  f.reactor->Finish(Finish(f.rpc, status));
}

// One Step stream. Messages are read up to kStepMessagesAhead ahead of the answers written,
// each queued for its layer as it is read and run on the executor when its turn comes (messages
// for the same layer in order); answers are written in the order the requests came. All state is
// under mu_; the reactor finishes once reading is over (or the stream is cancelled), nothing runs
// and everything is written.
class AttentionServiceImpl::StepReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StepReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx), stream_("Step", ctx, service->gate_) {
    if (!service_->gate_->Enter()) {
      Rpc rpc("Step", ctx_, service_->gate_, stream_.peer());
      {
        // A cancellation that comes after (the client's, or the drain's end) must not Finish
        // the stream again: gRPC aborts the process on a second Finish.
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      Finish(service_->Finish(
          rpc, absl::UnavailableError("the server is shutting down; retry (on another replica)")));
      return;
    }
    entered_ = true;
    if (service_->auth_ != nullptr) {
      absl::StatusOr<std::string> tenant = service_->auth_->Authenticate(*ctx);
      if (!tenant.ok()) {
        Rpc rpc("Step", ctx_, service_->gate_, stream_.peer());
        {
          absl::MutexLock lock(&mu_);
          finished_ = true;
        }
        Finish(service_->Finish(rpc, tenant.status()));
        return;
      }
      tenant_ = *std::move(tenant);
      stream_.set_tenant(tenant_);
    }
    absl::MutexLock lock(&mu_);
    ReadLocked();
    NoteWaitingLocked();
  }

  void OnReadDone(bool ok) override {
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (!ok) {
        reads_done_ = true;
        done = DoneLocked();
      } else {
        auto job = std::make_shared<Job>();
        job->seq = next_seq_++;
        job->arrival = service_->manager_->Arrive();
        Accept(*job);
        // Not on a stream cancelled (or finished: a read can complete after Finish, before
        // OnDone deletes the reactor, which a queued job would then outlive): never run.
        if (!job->done && !cancelled_ && !finished_) StartLocked(job);
        jobs_.push_back(std::move(job));
        WriteLocked();  // a message answered with an error at once may be next in line
        ReadLocked();
      }
      NoteWaitingLocked();
    }
    if (done) Finish(*done);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> done;
    std::shared_ptr<Job> written;  // released after mu_ (its bytes may be the last reference)
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      written = std::move(jobs_.front());
      jobs_.pop_front();
      if (ok) ++written_;
      if (!ok) cancelled_ = true;  // the stream is broken: stop reading and running
      WriteLocked();
      ReadLocked();
      done = DoneLocked();
      NoteWaitingLocked();
    }
    if (done) Finish(*done);
  }

  void OnCancel() override {
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      done = DoneLocked();
      NoteWaitingLocked();
    }
    if (done) Finish(*done);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&mu_);
      if (waiting_) service_->gate_->SetWaiting(false);
      if (end_) LogEndLocked(*end_);  // the streams refused at the start were logged then
    }
    if (entered_) service_->gate_->Leave();
    delete this;
  }

 private:
  struct Job {
    int64_t seq = 0;
    int32_t layer = 0;
    ReceivedForward received;
    double parse_us = 0;
    absl::Time accepted;  // parsed: from here it waits for its turn (the queue phase)
    std::string cache_id;
    bool running = false;
    bool done = false;
    grpc::ByteBuffer answer;
    std::shared_ptr<Cache> pinned;  // a cache Accept looked up: its last reference may go here
    CacheManager::Arrival arrival;  // on its way to its cache from its read to Run's lookup
  };

  // Parses the message just read into job: a layer of the open step, or a new step; a message
  // that cannot run is answered with its error right away.
  void Accept(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time parse_start = absl::Now();
    job.received.buffer.Swap(&incoming_);  // the job owns the message (ReceivedForward::buffer)
    absl::Status s = ParseForward(job.received.buffer,
                                  service_->manager_->limits().forward.max_spans, &job.received);
    job.accepted = absl::Now();
    job.parse_us = absl::ToDoubleMicroseconds(job.accepted - parse_start);
    wire::ForwardRequestRef& r = job.received.request;
    job.layer = r.layer;
    if (!s.ok()) {
      // Whether the message was to open a step (and on which cache) is unknown: the open step
      // ends, so that the layers after it cannot run with the old step's spans, positions and
      // cache. They are refused until a message sets spans again (and names the cache).
      opened_ = false;
      spans_.clear();
      cache_id_.clear();
      closed_by_garbled_ = true;
    } else if (!r.spans.empty() && service_->gate_->draining()) {
      // A step opened before the drain runs to its end (its layers still come); a new one
      // would start work the drain then has to wait for or cut: the stream ends here, as a
      // new call would be refused.
      s = absl::UnavailableError(
          "the server is shutting down: no new step opens on this stream; open it on another "
          "replica");
      closing_ = true;
    } else if (!r.spans.empty()) {  // opens a step
      if (!r.cache_id.empty()) cache_id_ = r.cache_id;
      spans_ = r.spans;
      options_ = r.options;
      default_scale_.reset();
      opened_ = true;
      closed_by_garbled_ = false;
    } else if (opened_) {
      if (r.options.sm_scale && !options_.sm_scale && !default_scale_) {
        // The step's scale is its cache's default: looked up once a step. A cache gone since
        // leaves it unknown and the layer's scale unchecked (the layer fails NOT_FOUND).
        absl::StatusOr<std::shared_ptr<Cache>> cache =
            service_->manager_->GetToUse(cache_id_, tenant_);
        if (cache.ok()) {
          default_scale_ = (*cache)->geometry().default_sm_scale();
          job.pinned = *std::move(cache);  // released with the job, outside mu_
        }
      }
      s = CheckStepLayer(r, cache_id_, options_, default_scale_);
    }
    if (s.ok()) {
      if (!opened_ && closed_by_garbled_) {
        s = absl::InvalidArgumentError(
            "no step is open: an earlier message of this stream could not be parsed (or broke a "
            "parse limit), so the step it may have opened is unknown; send a message that sets "
            "spans (and cache_id) to open one");
      } else if (!opened_) {
        s = absl::InvalidArgumentError(
            "the first message of a Step stream must set spans (and cache_id): it opens the step");
      } else if (cache_id_.empty()) {
        s = absl::InvalidArgumentError("cache_id is required (in the message that opens a step)");
      }
    }
    if (!s.ok()) {
      Rpc rpc("Step", ctx_, service_->gate_, stream_.peer());
      job.answer = EncodeStepError(job.layer, service_->Finish(rpc, s));
      job.done = true;
      job.arrival.End();
      return;
    }
    r.spans = spans_;
    r.options = options_;
    job.cache_id = cache_id_;
  }

  void ReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Read (and so queued) at most kStepMessagesAhead messages ahead of the answers written.
    if (reading_ || reads_done_ || cancelled_ || finished_ || closing_ ||
        jobs_.size() >= static_cast<size_t>(kStepMessagesAhead)) {
      return;
    }
    reading_ = true;
    StartRead(&incoming_);
  }

  // A message takes its place among the calls on its layer of the cache as it is read: after
  // the stream's earlier messages for that layer and every call on the cache that came before
  // it (a release included), before those after it. Waiting, it holds no thread (never run
  // here: under mu_, which Run takes). A cancelled stream's job still passes through its turn
  // (Run answers it with the stream's status, not running it).
  void StartLocked(const std::shared_ptr<Job>& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    job->running = true;
    ++running_;
    service_->layer_queues_->Run(LayerQueue(tenant_, job->cache_id, job->layer),
                                 [this, job] { Run(job); });
  }

  void Run(const std::shared_ptr<Job>& job) {
    const double queue_us = absl::ToDoubleMicroseconds(absl::Now() - job->accepted);
    Rpc rpc("Step", ctx_, service_->gate_, stream_.peer());
    rpc.set_tenant(tenant_);
    rpc.set_arrival(std::move(job->arrival));
    grpc::ByteBuffer answer;
    absl::StatusOr<ForwardAnswer> result = [&]() -> absl::StatusOr<ForwardAnswer> {
      // Cancelled, past its deadline or stopped by a drain while it waited for its turn: not run.
      if (absl::Status s = rpc.stop().Check(); !s.ok()) return s;
      return service_->RunForward(rpc, job->cache_id, job->received.request, job->received.bytes);
    }();
    const grpc::Status status =
        service_->Finish(rpc, result.ok() ? absl::OkStatus() : result.status());
    if (result.ok()) {
      const double before_encode_us = rpc.seconds() * 1e6;
      answer = result->device_tensors
                   ? EncodeDeviceResponse(result->result, job->received.request, /*step=*/true,
                                          job->layer, Micros(before_encode_us),
                                          Micros(result->timings.kernel_us))
                   : EncodeResponse(result->result, result->buffers, /*step=*/true, job->layer,
                                    Micros(before_encode_us), Micros(result->timings.kernel_us));
      if (service_->metrics_ != nullptr) {
        service_->metrics_->RecordForwardPhases(job->parse_us, result->stage_in_us, result->timings,
                                                rpc.seconds() * 1e6 - before_encode_us, queue_us);
      }
    } else {
      answer = EncodeStepError(job->layer, status);
    }
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      job->answer = std::move(answer);
      job->done = true;
      job->running = false;
      --running_;
      WriteLocked();
      ReadLocked();
      done = DoneLocked();
      NoteWaitingLocked();
    }
    // After mu_ and as the last use of this reactor: this thread is not one of gRPC's reactions,
    // so gRPC may run OnDone, which deletes the reactor, as soon as Finish is called (a Finish
    // under the lock unlocked a deleted mutex: a client cancelling streams aborted the server).
    if (done) Finish(*done);
  }

  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || cancelled_ || finished_ || jobs_.empty() || !jobs_.front()->done) return;
    writing_ = true;
    StartWrite(&jobs_.front()->answer);
  }

  // Counts the stream in the gate's waiting streams while it waits for a message: nothing of
  // its own queued, running or being written.
  void NoteWaitingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool waiting = entered_ && !finished_ && !cancelled_ && jobs_.empty() && running_ == 0;
    if (waiting == waiting_) return;
    waiting_ = waiting;
    service_->gate_->SetWaiting(waiting);
  }

  // Whether the stream is done, with the status to Finish it with (finished_ then set, the end
  // logged): the caller calls Finish once it has released mu_, as its last use of the reactor.
  std::optional<grpc::Status> DoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::optional<grpc::Status> done = EndLocked();
    if (done) end_ = *done;
    return done;
  }

  // The stream's end (OnDone), one line: debug when its client closed it, info when it was
  // cancelled (by its client, its deadline or a broken connection) or ended by a drain, with
  // what it left unanswered (each message's own line says how it ended). At most one a second
  // for each connection and code (LogThrottled): the line an operator needs when an
  // orchestrator's steps time out or its connections drop.
  void LogEndLocked(grpc::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A client's cancel can end the reads before OnCancel comes: the stream then finished as if
    // closed, but it was cancelled (final once OnDone runs).
    if (s.ok() && ctx_->IsCancelled()) s = grpc::Status(grpc::StatusCode::CANCELLED, "");
    const spdlog::level::level_enum level = s.ok() ? spdlog::level::debug : spdlog::level::info;
    if (!spdlog::should_log(level)) return;
    if (!cache_id_.empty()) stream_.set_cache(cache_id_);
    const std::string line = absl::StrFormat(
        "step stream cache=%s %s %s after %.3f ms: %d messages read, %d answered, %d unanswered",
        stream_.cache(), stream_.Caller(),
        s.ok() ? "ended" : absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())),
        stream_.seconds() * 1e3, next_seq_, written_, next_seq_ - written_);
    if (s.ok()) {
      spdlog::debug("{}", line);
    } else {
      LogThrottled(level, absl::StrCat(stream_.peer(), " step stream ", s.error_code()), line);
    }
  }

  std::optional<grpc::Status> EndLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A cancelled stream finishes with its read still pending (gRPC then completes the read
    // with ok=false): a read started as the cancellation arrives is not always completed
    // otherwise, and the call would never end (a server shutdown would wait for it forever).
    if (finished_ || running_ > 0 || writing_ || (reading_ && !cancelled_)) return std::nullopt;
    if (cancelled_) {
      finished_ = true;
      return grpc::Status(grpc::StatusCode::CANCELLED, "the Step stream was cancelled");
    }
    if ((reads_done_ || closing_) && jobs_.empty()) {
      finished_ = true;
      return closing_ ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                     "the server is shutting down; the Step stream ended before a "
                                     "new step (open it on another replica)")
                      : grpc::Status::OK;
    }
    return std::nullopt;
  }

  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  bool entered_ = false;
  std::string tenant_;
  absl::Mutex mu_;
  grpc::ByteBuffer incoming_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);  // in the order they came
  int64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;  // answers sent
  Rpc stream_;                                // the stream as a whole, for its last line
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);  // what it finished with (DoneLocked)
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // a new step refused in a drain: no more reads
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;  // counted in the gate's (NoteWaitingLocked)
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // The open step: what messages without spans run with.
  bool opened_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_by_garbled_ ABSL_GUARDED_BY(mu_) = false;  // the last step ended by bad bytes
  // The open step's cache's default sm_scale, once a layer needed it (CheckStepLayer).
  std::optional<float> default_scale_ ABSL_GUARDED_BY(mu_);
  std::string cache_id_ ABSL_GUARDED_BY(mu_);
  std::vector<wire::SpanRef> spans_ ABSL_GUARDED_BY(mu_);
  wire::ForwardOptionsRef options_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::Step(
    grpc::CallbackServerContext* ctx) {
  return new StepReactor(this, ctx);
}

absl::Status AttentionServiceImpl::RunReleaseSequences(Rpc& rpc,
                                                       const v1::ReleaseSequencesRequest& req,
                                                       v1::ReleaseSequencesResponse* resp) {
  rpc.set_cache(req.cache_id());
  absl::StatusOr<std::shared_ptr<Cache>> cache =
      manager_->GetToUse(req.cache_id(), rpc.tenant(), std::move(rpc.arrival()));
  if (!cache.ok()) return cache.status();
  ReleaseResult r = (*cache)->Release(
      absl::MakeConstSpan(req.seq_ids().data(), static_cast<size_t>(req.seq_ids_size())));
  resp->set_released(r.released);
  resp->set_freed_pages(r.freed_pages);
  for (uint64_t id : r.unknown_seq_ids) resp->add_unknown_seq_ids(id);
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunTruncateSequences(Rpc& rpc,
                                                        const v1::TruncateSequencesRequest& req,
                                                        v1::TruncateSequencesResponse* resp) {
  rpc.set_cache(req.cache_id());
  absl::StatusOr<std::shared_ptr<Cache>> cache =
      manager_->GetToUse(req.cache_id(), rpc.tenant(), std::move(rpc.arrival()));
  if (!cache.ok()) return cache.status();
  std::vector<std::pair<uint64_t, int64_t>> lengths;
  lengths.reserve(static_cast<size_t>(req.lengths_size()));
  for (const v1::SequenceLength& l : req.lengths()) lengths.emplace_back(l.seq_id(), l.length());
  absl::StatusOr<TruncateResult> r = (*cache)->Truncate(req.layer(), lengths);
  if (!r.ok()) return r.status();
  resp->set_truncated(r->truncated);
  resp->set_freed_pages(r->freed_pages);
  for (uint64_t id : r->unknown_seq_ids) resp->add_unknown_seq_ids(id);
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunRegisterMemory(Rpc& rpc, const v1::RegisterMemoryRequest& req,
                                                     v1::MemoryRegion* resp) {
  rpc.set_cache(req.cache_id());
  if (absl::Status s = regions_->CheckAvailable(); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req.cache_id(), rpc.tenant());
  if (!cache.ok()) return cache.status();
  const int32_t device = (*cache)->geometry().device;
  if (req.device() != device) {
    return absl::InvalidArgumentError(absl::StrCat("device is ", req.device(), " but cache ",
                                                   (*cache)->id(), " lives on GPU ", device,
                                                   ": register memory on the cache's GPU"));
  }
  absl::StatusOr<RegionInfo> region = regions_->Register(
      {.owner = rpc.tenant(),
       .cache_id = (*cache)->id(),
       .device = device,
       .handle = req.cuda_ipc_handle(),
       .size_bytes = req.size_bytes(),
       .lease = absl::Seconds(req.lease_seconds()),
       .event_handles = {req.cuda_ipc_events().begin(), req.cuda_ipc_events().end()}});
  if (!region.ok()) return region.status();
  resp->set_region_id(region->id);
  resp->set_cache_id(region->cache_id);
  resp->set_size_bytes(region->size_bytes);
  resp->set_device(region->device);
  resp->set_lease_seconds(static_cast<int32_t>(absl::ToInt64Seconds(region->lease)));
  resp->set_num_events(region->num_events);
  spdlog::info("registered memory region {} for cache {} {}: {} bytes on GPU {}, lease {} s",
               region->id, region->cache_id, rpc.Caller(), region->size_bytes, region->device,
               resp->lease_seconds());
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::RunUnregisterMemory(Rpc& rpc,
                                                       const v1::UnregisterMemoryRequest& req,
                                                       v1::UnregisterMemoryResponse*) {
  return regions_->Unregister(req.region_id(), rpc.tenant());
}

}  // namespace pagedattn
