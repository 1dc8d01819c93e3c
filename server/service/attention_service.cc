// Handlers: translate, call the core, translate back. One debug log line per RPC.
#include "server/service/attention_service.h"

#include <chrono>

#include "server/service/auth.h"
#include "server/service/convert.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace pagedattn {
namespace {

// Ends every RPC: counts it in the metrics and logs one debug line (method, cache, outcome,
// latency). Never logs request metadata, so tokens stay out of logs.
class RpcLog {
 public:
  RpcLog(const char* method, grpc::ServerContext* ctx, Metrics* metrics)
      : method_(method), ctx_(ctx), metrics_(metrics), start_(std::chrono::steady_clock::now()) {}
  void set_cache(const std::string& id) { cache_ = id; }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  grpc::Status Finish(const absl::Status& s) {
    grpc::Status g = ToGrpcStatus(s);
    if (metrics_ != nullptr) metrics_->RecordRpc(method_, s.code());
    const double ms = seconds() * 1e3;
    if (s.ok()) {
      spdlog::debug("rpc {} cache={} peer={} ok {:.3f} ms", method_, cache_, ctx_->peer(), ms);
    } else if (s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kUnknown ||
               s.code() == absl::StatusCode::kDataLoss) {
      // The server's own failure (e.g. a CUDA error), not the caller's: always visible.
      spdlog::error("rpc {} cache={} peer={} {} {:.3f} ms: {}", method_, cache_, ctx_->peer(),
                    absl::StatusCodeToString(s.code()), ms, std::string(s.message()));
    } else {
      spdlog::debug("rpc {} cache={} peer={} {} {:.3f} ms: {}", method_, cache_, ctx_->peer(),
                    absl::StatusCodeToString(s.code()), ms, std::string(s.message()));
    }
    return g;
  }

 private:
  const char* method_;
  grpc::ServerContext* ctx_;
  Metrics* metrics_;
  std::chrono::steady_clock::time_point start_;
  std::string cache_ = "-";
};

}  // namespace

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

absl::StatusOr<std::string> AttentionServiceImpl::Tenant(const grpc::ServerContext& ctx) const {
  if (auth_ == nullptr) return std::string();
  return auth_->Authenticate(ctx);
}

grpc::Status AttentionServiceImpl::GetServerInfo(grpc::ServerContext* ctx,
                                                 const v1::GetServerInfoRequest*,
                                                 v1::ServerInfo* resp) {
  RpcLog log("GetServerInfo", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  Backend& b = manager_->backend();
  resp->set_version(PAGEDATTN_VERSION);
  resp->set_backend(b.name());
  resp->set_device_name(b.device_name());
  resp->set_device_count(b.device_count());
  if (absl::StatusOr<MemoryInfo> mem = b.memory(0); mem.ok()) {
    resp->set_device_memory_bytes(mem->total_bytes);
    resp->set_device_free_bytes(mem->free_bytes);
  }
  FillCapabilities(b.kind(), resp->mutable_capabilities());
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::ValidateCacheConfig(grpc::ServerContext* ctx,
                                                       const v1::CacheConfig* req,
                                                       v1::ValidateCacheConfigResponse* resp) {
  RpcLog log("ValidateCacheConfig", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  ToProto(manager_->Validate(FromProto(*req)), resp);
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::CreateCache(grpc::ServerContext* ctx,
                                               const v1::CreateCacheRequest* req,
                                               v1::CacheInfo* resp) {
  RpcLog log("CreateCache", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  absl::StatusOr<std::shared_ptr<Cache>> cache =
      manager_->Create(FromProto(req->config()), req->name(), *tenant);
  if (!cache.ok()) return log.Finish(cache.status());
  log.set_cache((*cache)->id());
  ToProto(**cache, resp);
  spdlog::info("created cache {} '{}': {} pages x {} tokens, {} bytes", (*cache)->id(),
               (*cache)->name(), resp->num_pages(), resp->config().page_size(), resp->bytes());
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::GetCache(grpc::ServerContext* ctx,
                                            const v1::GetCacheRequest* req, v1::CacheInfo* resp) {
  RpcLog log("GetCache", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  log.set_cache(req->cache_id());
  absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req->cache_id(), *tenant);
  if (!cache.ok()) return log.Finish(cache.status());
  ToProto(**cache, resp);
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::ListCaches(grpc::ServerContext* ctx,
                                              const v1::ListCachesRequest*,
                                              v1::ListCachesResponse* resp) {
  RpcLog log("ListCaches", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  for (const std::shared_ptr<Cache>& cache : manager_->List(*tenant)) {
    ToProto(*cache, resp->add_caches());
  }
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::DeleteCache(grpc::ServerContext* ctx,
                                               const v1::DeleteCacheRequest* req,
                                               v1::DeleteCacheResponse* resp) {
  RpcLog log("DeleteCache", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  log.set_cache(req->cache_id());
  absl::StatusOr<int64_t> freed = manager_->Delete(req->cache_id(), *tenant);
  if (!freed.ok()) return log.Finish(freed.status());
  resp->set_freed_bytes(*freed);
  spdlog::info("deleted cache {} ({} bytes)", req->cache_id(), *freed);
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::Forward(grpc::ServerContext* ctx, const v1::ForwardRequest* req,
                                           v1::ForwardResponse* resp) {
  RpcLog log("Forward", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  log.set_cache(req->cache_id());
  absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req->cache_id(), *tenant);
  if (!cache.ok()) return log.Finish(cache.status());
  ForwardArgs args = FromProto(*req);
  absl::StatusOr<ForwardResult> result = (*cache)->Forward(args);
  if (!result.ok()) return log.Finish(result.status());
  MoveToProto(*std::move(result), resp);
  if (metrics_ != nullptr) {
    int64_t appended = 0, queries = 0;
    for (const SpanRequest& s : args.spans) {
      appended += s.num_new_tokens;
      queries += s.num_queries;
    }
    metrics_->RecordForward(log.seconds(), appended, queries);
  }
  return log.Finish(absl::OkStatus());
}

grpc::Status AttentionServiceImpl::ReleaseSequences(grpc::ServerContext* ctx,
                                                    const v1::ReleaseSequencesRequest* req,
                                                    v1::ReleaseSequencesResponse* resp) {
  RpcLog log("ReleaseSequences", ctx, metrics_);
  absl::StatusOr<std::string> tenant = Tenant(*ctx);
  if (!tenant.ok()) return log.Finish(tenant.status());
  log.set_cache(req->cache_id());
  absl::StatusOr<std::shared_ptr<Cache>> cache = manager_->Get(req->cache_id(), *tenant);
  if (!cache.ok()) return log.Finish(cache.status());
  ReleaseResult r = (*cache)->Release(
      absl::MakeConstSpan(req->seq_ids().data(), static_cast<size_t>(req->seq_ids_size())));
  resp->set_released(r.released);
  resp->set_freed_pages(r.freed_pages);
  for (uint64_t id : r.unknown_seq_ids) resp->add_unknown_seq_ids(id);
  return log.Finish(absl::OkStatus());
}

}  // namespace pagedattn
