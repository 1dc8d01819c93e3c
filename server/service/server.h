// PagedAttnServer: builds and runs the gRPC server (AttentionService, grpc.health.v1,
// reflection) from a plain options struct, and shuts it down gracefully.
#pragma once

#include <grpcpp/server.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/cache_manager.h"
#include "server/service/attention_service.h"
#include "server/service/auth.h"
#include "server/service/health.h"
#include "server/service/metrics.h"

namespace pagedattn {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";   // host:port; port 0 picks a free one.
  std::string backend = "auto";           // auto | cuda | cpu
  int64_t max_message_bytes = 512 << 20;  // Largest request/response.
  int cpu_threads = 0;                    // CPU backend workers (0: one per core).
  std::string prefill_kernel = "auto";    // CUDA prefill kernel: auto | portable
  bool graph_launch = true;               // CUDA: kernels through cached graphs (false: plain)
  CacheManagerLimits limits;
  // TLS for the main port: both set = TLS; tls_client_ca also set = mTLS (client certs
  // required and verified against it). PEM file paths.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  std::string auth_tokens_file;  // Bearer tokens ("token [tenant]" per line); empty = no auth.
  std::string health_listen;     // Extra plaintext port serving grpc.health.v1 only; empty = none.
  std::string metrics_listen;    // Prometheus /metrics over HTTP; empty = none.
};

class PagedAttnServer {
 public:
  // Creates the backend and starts listening; health is SERVING once this returns.
  static absl::StatusOr<std::unique_ptr<PagedAttnServer>> Start(const ServerOptions& options);
  ~PagedAttnServer();

  int port() const { return port_; }
  int health_port() const { return health_port_; }
  int metrics_port() const { return metrics_http_ ? metrics_http_->port() : 0; }
  bool tls() const { return tls_; }
  const TokenAuthenticator* auth() const { return auth_.get(); }
  Backend& backend() const { return *backend_; }
  CacheManager& manager() const { return *manager_; }

  // Health goes NOT_SERVING, new RPCs are refused, in-flight RPCs get until the deadline,
  // then they are cancelled. Idempotent.
  void Shutdown(absl::Duration grace);
  // Blocks until the server has shut down.
  void Wait();

 private:
  PagedAttnServer() = default;

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<CacheManager> manager_;
  std::unique_ptr<TokenAuthenticator> auth_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<HealthServiceImpl> health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  int port_ = 0;
  int health_port_ = 0;
  bool tls_ = false;
  bool shut_down_ = false;
};

}  // namespace pagedattn
