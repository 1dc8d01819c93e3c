// Server assembly: backend, cache manager, service, health and reflection.
#include "server/service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"
#include "server/core/backend_factory.h"
#include "spdlog/spdlog.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<PagedAttnServer>> PagedAttnServer::Start(const ServerOptions& options) {
  std::unique_ptr<PagedAttnServer> s(new PagedAttnServer());
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(options.backend, options.cpu_threads);
  if (!backend.ok()) return backend.status();
  s->backend_ = *std::move(backend);
  s->manager_ = std::make_unique<CacheManager>(s->backend_.get(), options.limits);
  s->service_ = std::make_unique<AttentionServiceImpl>(s->manager_.get());

  // The built-in health service has no descriptor in the generated pool; linking ours lets
  // reflection describe grpc.health.v1 so grpcurl can call it without a .proto.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  const int max_bytes = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.listen, " (address in use or invalid?)"));
  }
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  return s;
}

PagedAttnServer::~PagedAttnServer() {
  Shutdown(absl::Seconds(1));
  Wait();
}

void PagedAttnServer::Shutdown(absl::Duration grace) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
}

void PagedAttnServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace pagedattn
