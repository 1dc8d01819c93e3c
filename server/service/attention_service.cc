// Handlers: translate, call the core, translate back; Handle() holds what every call shares.
#include "server/service/attention_service.h"

#include <chrono>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/service/convert.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace pagedattn {
namespace {

// The request's text for a log line: escaped (a newline cannot forge a line) and cut.
std::string ForLog(absl::string_view s) {
  constexpr size_t kShown = 64;
  std::string out = absl::CHexEscape(s.substr(0, kShown));
  if (s.size() > kShown) absl::StrAppend(&out, "...(", s.size(), " bytes)");
  return out;
}

StopToken StopFor(grpc::ServerContext* ctx, const RpcGate* gate) {
  const auto deadline = ctx->deadline();
  return StopToken([ctx, gate] { return gate->stopping() || ctx->IsCancelled(); },
                   deadline == std::chrono::system_clock::time_point::max()
                       ? absl::InfiniteFuture()
                       : absl::FromChrono(deadline));
}

}  // namespace

Rpc::Rpc(const char* method, grpc::ServerContext* ctx, const RpcGate* gate)
    : method_(method),
      ctx_(ctx),
      stop_(StopFor(ctx, gate)),
      start_(std::chrono::steady_clock::now()) {}

void Rpc::set_cache(absl::string_view cache_id) { cache_ = ForLog(cache_id); }

double Rpc::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

template <typename Body>
grpc::Status AttentionServiceImpl::Handle(const char* method, grpc::ServerContext* ctx,
                                          Body&& body) {
  Rpc rpc(method, ctx, gate_);
  if (!gate_->Enter()) {
    return Finish(
        rpc, absl::UnavailableError("the server is shutting down; retry (on another replica)"));
  }
  absl::Cleanup leave = [this] { gate_->Leave(); };
  if (auth_ != nullptr) {
    absl::StatusOr<std::string> tenant = auth_->Authenticate(*ctx);
    if (!tenant.ok()) return Finish(rpc, tenant.status());
    rpc.set_tenant(*std::move(tenant));
  }
  return Finish(rpc, body(rpc));
}

// Counts the call in the metrics and logs one line: debug for success and the caller's errors,
// error for the server's own failures (e.g. a CUDA error). Never logs request metadata, so
// tokens stay out of logs.
grpc::Status AttentionServiceImpl::Finish(const Rpc& rpc, const absl::Status& s) {
  if (metrics_ != nullptr) metrics_->RecordRpc(rpc.method(), s.code());
  const double ms = rpc.seconds() * 1e3;
  const std::string peer = ForLog(rpc.context()->peer());
  if (s.ok()) {
    spdlog::debug("rpc {} cache={} peer={} ok {:.3f} ms", rpc.method(), rpc.cache(), peer, ms);
  } else if (s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kUnknown ||
             s.code() == absl::StatusCode::kDataLoss) {
    spdlog::error("rpc {} cache={} peer={} {} {:.3f} ms: {}", rpc.method(), rpc.cache(), peer,
                  absl::StatusCodeToString(s.code()), ms, ForLog(s.message()));
  } else {
    spdlog::debug("rpc {} cache={} peer={} {} {:.3f} ms: {}", rpc.method(), rpc.cache(), peer,
                  absl::StatusCodeToString(s.code()), ms, absl::CHexEscape(s.message()));
  }
  return ToGrpcStatus(s);
}

void FillCapabilities(BackendKind backend, v1::Capabilities* out) {
  for (int d : kSupportedHeadDims) out->add_head_dims(d);
  out->set_min_page_size(kMinPageSize);
  out->set_max_page_size(kMaxPageSize);
  for (DType t : kIoDTypes) {
    if (IsSupportedKvDType(backend, t)) out->add_kv_dtypes(static_cast<v1::DType>(t));
    out->add_io_dtypes(static_cast<v1::DType>(t));
  }
  out->set_max_gqa_ratio(kMaxGqaRatio);
  out->set_max_num_layers(kMaxNumLayers);
  out->set_max_num_heads(kMaxNumHeads);
  out->set_supports_causal(true);
  out->set_supports_non_causal(true);
  out->set_supports_lse(true);
  out->set_supports_custom_sm_scale(true);
}

grpc::Status AttentionServiceImpl::GetServerInfo(grpc::ServerContext* ctx,
                                                 const v1::GetServerInfoRequest*,
                                                 v1::ServerInfo* resp) {
  return Handle("GetServerInfo", ctx, [&](Rpc&) {
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
    for (const std::string& arch : b.compiled_architectures()) resp->add_cuda_architectures(arch);
    FillCapabilities(b.kind(), resp->mutable_capabilities());
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::ValidateCacheConfig(grpc::ServerContext* ctx,
                                                       const v1::CacheConfig* req,
                                                       v1::ValidateCacheConfigResponse* resp) {
  return Handle("ValidateCacheConfig", ctx, [&](Rpc&) {
    ToProto(manager_->Validate(FromProto(*req)), resp);
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::CreateCache(grpc::ServerContext* ctx,
                                               const v1::CreateCacheRequest* req,
                                               v1::CacheInfo* resp) {
  return Handle("CreateCache", ctx, [&](Rpc& rpc) -> absl::Status {
    absl::StatusOr<std::shared_ptr<Cache>> cache =
        manager_->Create(FromProto(req->config()), req->name(), rpc.tenant(), rpc.stop());
    if (!cache.ok()) return cache.status();
    rpc.set_cache((*cache)->id());
    ToProto(**cache, resp);
    spdlog::info("created cache {} '{}': {} pages x {} tokens, {} bytes", (*cache)->id(),
                 (*cache)->name(), resp->num_pages(), resp->config().page_size(), resp->bytes());
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::GetCache(grpc::ServerContext* ctx,
                                            const v1::GetCacheRequest* req, v1::CacheInfo* resp) {
  return Handle("GetCache", ctx, [&](Rpc& rpc) -> absl::Status {
    rpc.set_cache(req->cache_id());
    absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req->cache_id(), rpc.tenant());
    if (!cache.ok()) return cache.status();
    ToProto(**cache, resp);
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::ListCaches(grpc::ServerContext* ctx,
                                              const v1::ListCachesRequest*,
                                              v1::ListCachesResponse* resp) {
  return Handle("ListCaches", ctx, [&](Rpc& rpc) {
    for (const std::shared_ptr<Cache>& cache : manager_->List(rpc.tenant())) {
      ToProto(*cache, resp->add_caches());
    }
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::DeleteCache(grpc::ServerContext* ctx,
                                               const v1::DeleteCacheRequest* req,
                                               v1::DeleteCacheResponse* resp) {
  return Handle("DeleteCache", ctx, [&](Rpc& rpc) -> absl::Status {
    rpc.set_cache(req->cache_id());
    absl::StatusOr<int64_t> freed = manager_->Delete(req->cache_id(), rpc.tenant());
    if (!freed.ok()) return freed.status();
    resp->set_freed_bytes(*freed);
    spdlog::info("deleted cache {} ({} bytes)", rpc.cache(), *freed);
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::Forward(grpc::ServerContext* ctx, const v1::ForwardRequest* req,
                                           v1::ForwardResponse* resp) {
  return Handle("Forward", ctx, [&](Rpc& rpc) -> absl::Status {
    rpc.set_cache(req->cache_id());
    absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req->cache_id(), rpc.tenant());
    if (!cache.ok()) return cache.status();
    ForwardArgs args = FromProto(*req);
    // The request's bytes and the answer's, held until the answer is sent, against the
    // server's budget for data in flight.
    const int64_t held = static_cast<int64_t>(req->ByteSizeLong()) +
                         ForwardResponseBytes((*cache)->geometry(), args);
    if (budget_ != nullptr && !budget_->TryAcquire(held)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the server is busy: ", budget_->used(), " bytes of Forward data are in flight, this ",
          "call needs ", held, " more and the budget is ", budget_->limit(),
          " (--request_memory_mb); retry shortly"));
    }
    absl::Cleanup release = [&] {
      if (budget_ != nullptr) budget_->Release(held);
    };
    absl::StatusOr<ForwardResult> result = (*cache)->Forward(args, rpc.stop());
    if (!result.ok()) return result.status();
    MoveToProto(*std::move(result), resp);
    if (metrics_ != nullptr) {
      int64_t appended = 0, queries = 0;
      for (const SpanRequest& s : args.spans) {
        appended += s.num_new_tokens;
        queries += s.num_queries;
      }
      metrics_->RecordForward(rpc.seconds(), appended, queries);
    }
    return absl::OkStatus();
  });
}

grpc::Status AttentionServiceImpl::ReleaseSequences(grpc::ServerContext* ctx,
                                                    const v1::ReleaseSequencesRequest* req,
                                                    v1::ReleaseSequencesResponse* resp) {
  return Handle("ReleaseSequences", ctx, [&](Rpc& rpc) -> absl::Status {
    rpc.set_cache(req->cache_id());
    absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req->cache_id(), rpc.tenant());
    if (!cache.ok()) return cache.status();
    ReleaseResult r = (*cache)->Release(
        absl::MakeConstSpan(req->seq_ids().data(), static_cast<size_t>(req->seq_ids_size())));
    resp->set_released(r.released);
    resp->set_freed_pages(r.freed_pages);
    for (uint64_t id : r.unknown_seq_ids) resp->add_unknown_seq_ids(id);
    return absl::OkStatus();
  });
}

}  // namespace pagedattn
