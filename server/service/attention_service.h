// AttentionServiceImpl: thin gRPC handlers over the CacheManager. Each handler is parse ->
// core -> serialize inside Handle(), which does what every call needs: refuse while shutting
// down, the caller's tenant from its token, a stop token, metrics, one log line, status mapping.
#pragma once

#include <chrono>
#include <string>

#include "pagedattn/v1/attention.grpc.pb.h"
#include "server/core/cache_manager.h"
#include "server/core/stop_token.h"
#include "server/service/auth.h"
#include "server/service/metrics.h"
#include "server/service/rpc_gate.h"

namespace pagedattn {

// What a handler body knows of its call.
class Rpc {
 public:
  Rpc(const char* method, grpc::ServerContext* ctx, const RpcGate* gate);
  const char* method() const { return method_; }
  const std::string& tenant() const { return tenant_; }
  void set_tenant(std::string tenant) { tenant_ = std::move(tenant); }
  // Stops when the caller cancels, its deadline passes, or shutdown's grace runs out.
  const StopToken& stop() const { return stop_; }
  // The cache the call names, for the log line (escaped and shortened: it is request data).
  void set_cache(absl::string_view cache_id);
  const std::string& cache() const { return cache_; }
  grpc::ServerContext* context() const { return ctx_; }
  double seconds() const;

 private:
  const char* method_;
  grpc::ServerContext* ctx_;
  std::string tenant_;
  StopToken stop_;
  std::string cache_ = "-";
  std::chrono::steady_clock::time_point start_;
};

class AttentionServiceImpl final : public v1::AttentionService::Service {
 public:
  // auth: null means no token auth (every caller is tenant ""). metrics: may be null.
  // gate: the server's calls in flight. budget: bytes of Forward data in flight.
  AttentionServiceImpl(CacheManager* manager, const TokenAuthenticator* auth, Metrics* metrics,
                       RpcGate* gate, ByteBudget* budget)
      : manager_(manager), auth_(auth), metrics_(metrics), gate_(gate), budget_(budget) {}

  grpc::Status GetServerInfo(grpc::ServerContext* ctx, const v1::GetServerInfoRequest* req,
                             v1::ServerInfo* resp) override;
  grpc::Status ValidateCacheConfig(grpc::ServerContext* ctx, const v1::CacheConfig* req,
                                   v1::ValidateCacheConfigResponse* resp) override;
  grpc::Status CreateCache(grpc::ServerContext* ctx, const v1::CreateCacheRequest* req,
                           v1::CacheInfo* resp) override;
  grpc::Status GetCache(grpc::ServerContext* ctx, const v1::GetCacheRequest* req,
                        v1::CacheInfo* resp) override;
  grpc::Status ListCaches(grpc::ServerContext* ctx, const v1::ListCachesRequest* req,
                          v1::ListCachesResponse* resp) override;
  grpc::Status DeleteCache(grpc::ServerContext* ctx, const v1::DeleteCacheRequest* req,
                           v1::DeleteCacheResponse* resp) override;
  grpc::Status Forward(grpc::ServerContext* ctx, const v1::ForwardRequest* req,
                       v1::ForwardResponse* resp) override;
  grpc::Status ReleaseSequences(grpc::ServerContext* ctx, const v1::ReleaseSequencesRequest* req,
                                v1::ReleaseSequencesResponse* resp) override;

 private:
  // Runs body(rpc) -> absl::Status as the call named method, with the preamble and epilogue
  // every call shares.
  template <typename Body>
  grpc::Status Handle(const char* method, grpc::ServerContext* ctx, Body&& body);
  grpc::Status Finish(const Rpc& rpc, const absl::Status& status);

  CacheManager* const manager_;
  const TokenAuthenticator* const auth_;
  Metrics* const metrics_;
  RpcGate* const gate_;
  ByteBudget* const budget_;
};

// The capability table of a backend, as sent in ServerInfo.
void FillCapabilities(BackendKind backend, v1::Capabilities* out);

}  // namespace pagedattn
