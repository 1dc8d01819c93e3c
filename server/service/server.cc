// Server assembly: backend, cache manager, auth, metrics, the gRPC service with health and
// reflection, the optional plaintext health port and the metrics HTTP endpoint.
#include "server/service/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "server/core/backend_factory.h"
#include "spdlog/spdlog.h"

namespace pagedattn {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", flag, " ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MainCredentials(const ServerOptions& o) {
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (o.tls_cert_file.empty()) {
    if (!o.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadPem("--tls_cert", o.tls_cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("--tls_key", o.tls_key_file);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!o.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls_client_ca", o.tls_client_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PagedAttnServer>> PagedAttnServer::Start(
    const ServerOptions& options) {
  std::unique_ptr<PagedAttnServer> s(new PagedAttnServer());
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MainCredentials(options);
  if (!creds.ok()) return creds.status();
  s->tls_ = !options.tls_cert_file.empty();
  if (!options.auth_tokens_file.empty()) {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> auth =
        TokenAuthenticator::FromFile(options.auth_tokens_file);
    if (!auth.ok()) return auth.status();
    s->auth_ = *std::move(auth);
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      CreateBackend({.backend = options.backend,
                     .cpu_threads = options.cpu_threads,
                     .prefill_kernel = options.prefill_kernel,
                     .graph_launch = options.graph_launch});
  if (!backend.ok()) return backend.status();
  s->backend_ = *std::move(backend);
  s->manager_ = std::make_unique<CacheManager>(s->backend_.get(), options.limits);
  s->metrics_ = std::make_unique<Metrics>();
  s->service_ =
      std::make_unique<AttentionServiceImpl>(s->manager_.get(), s->auth_.get(), s->metrics_.get());
  // One health service answers on the main port and on the plaintext health port.
  s->health_ = std::make_unique<HealthServiceImpl>();

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  const int max_bytes = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *creds, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->health_.get());
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.listen, " (address in use or invalid?)"));
  }
  if (!options.health_listen.empty()) {
    // Kubernetes gRPC probes cannot speak TLS: health alone, in plaintext.
    grpc::ServerBuilder hb;
    hb.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(), &s->health_port_);
    hb.RegisterService(s->health_.get());
    s->health_server_ = hb.BuildAndStart();
    if (s->health_server_ == nullptr || s->health_port_ == 0) {
      s->server_->Shutdown();
      return absl::UnavailableError(
          absl::StrCat("could not listen on --health_listen ", options.health_listen));
    }
  }
  if (!options.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
        MetricsHttpServer::Start(options.metrics_listen, s->metrics_.get(), s->manager_.get());
    if (!http.ok()) {
      s->server_->Shutdown();
      if (s->health_server_) s->health_server_->Shutdown();
      return http.status();
    }
    s->metrics_http_ = *std::move(http);
  }
  s->health_->SetServing(true);
  return s;
}

PagedAttnServer::~PagedAttnServer() {
  Shutdown(absl::Seconds(1));
  Wait();
}

void PagedAttnServer::Shutdown(absl::Duration grace) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  health_->SetServing(false);
  const auto deadline = absl::ToChronoTime(absl::Now() + grace);
  server_->Shutdown(deadline);
  if (health_server_) health_server_->Shutdown(deadline);
}

void PagedAttnServer::Wait() {
  if (server_ != nullptr) server_->Wait();
  if (health_server_ != nullptr) health_server_->Wait();
}

}  // namespace pagedattn
