// AttentionServiceImpl: thin gRPC handlers over the CacheManager. Each handler parses,
// calls the core, serializes, and logs one debug line.
#pragma once

#include <string>

#include "pagedattn/v1/attention.grpc.pb.h"
#include "server/core/cache_manager.h"
#include "server/service/auth.h"
#include "server/service/metrics.h"

namespace pagedattn {

class AttentionServiceImpl final : public v1::AttentionService::Service {
 public:
  // auth: null means no token auth (every caller is tenant ""). metrics: may be null.
  AttentionServiceImpl(CacheManager* manager, const TokenAuthenticator* auth, Metrics* metrics)
      : manager_(manager), auth_(auth), metrics_(metrics) {}

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
  absl::StatusOr<std::string> Tenant(const grpc::ServerContext& ctx) const;

  CacheManager* const manager_;
  const TokenAuthenticator* const auth_;
  Metrics* const metrics_;
};

// The capability table of a backend, as sent in ServerInfo.
void FillCapabilities(BackendKind backend, v1::Capabilities* out);

}  // namespace pagedattn
