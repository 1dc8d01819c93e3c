// PagedAttnServer: builds and runs the gRPC server (AttentionService, grpc.health.v1,
// reflection) from a plain options struct, and shuts it down within a bounded grace period.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/server.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/backend_factory.h"
#include "server/core/cache_manager.h"
#include "server/core/memory_registry.h"
#include "server/core/periodic_task.h"
#include "server/service/attention_service.h"
#include "server/service/auth.h"
#include "server/service/health.h"
#include "server/service/http_server.h"
#include "server/service/metrics.h"
#include "server/service/reflection.h"
#include "server/service/rpc_gate.h"

namespace pagedattn {

struct ServerOptions {
  // Comma-separated addresses: host:port (port 0 picks a free one) or unix:/path/to.sock.
  std::string listen = "0.0.0.0:50051";
  int unix_socket_mode = 0660;  // File mode of Unix sockets: who may connect.
  BackendOptions backend;
  int64_t max_message_bytes = 512 << 20;  // Largest request/response.
  // Memory for requests in flight: gRPC's buffers (a resource quota: past it, the transport
  // resets streams with RESOURCE_EXHAUSTED) and, separately, the Forward data held by calls.
  // 0: RequestMemoryDefault().
  int64_t request_memory_bytes = 0;
  CacheManagerLimits limits;
  // TLS for the main port: both set = TLS; tls_client_ca also set = mTLS (client certs
  // required and verified against it). PEM file paths, checked before anything listens.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  std::string auth_tokens_file;  // Bearer tokens ("token [tenant]" per line); empty = no auth.
  std::string health_listen;  // Extra plaintext port: grpc.health.v1 and reflection; empty = none.
  std::string metrics_listen;    // Prometheus /metrics over HTTP; empty = none.
  bool metrics_per_cache = false;  // Per-cache series with ids, names, tenants (Metrics).
  MemoryRegistryOptions memory;    // RegisterMemory: how many regions, their leases.
  // A cache that no Forward (or Step layer), release or truncate has come to for this long is
  // deleted, as DeleteCache would (an orchestrator that died leaves its caches behind); zero:
  // caches stay until deleted.
  absl::Duration cache_idle_timeout = absl::ZeroDuration();
};

// A quarter of the memory this process may use (cgroup limits included), at most twice the
// largest message plus 64 MiB: room for two largest requests in flight, or many ordinary ones.
int64_t RequestMemoryDefault(int64_t max_message_bytes);

class PagedAttnServer {
 public:
  // Creates the backend and starts listening; health is SERVING once this returns.
  // A port in use (by another server too: SO_REUSEPORT is off) is UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<PagedAttnServer>> Start(const ServerOptions& options);
  ~PagedAttnServer();

  // The first TCP address's port (0 when --listen has Unix sockets only).
  int port() const { return port_; }
  // Every --listen address as bound, in its order: host:port with the port a 0 picked, or
  // unix:/path.
  const std::vector<std::string>& listening() const { return listening_; }
  int health_port() const { return health_port_; }
  int metrics_port() const { return metrics_http_ ? metrics_http_->port() : 0; }
  bool tls() const { return tls_; }
  // When the TLS certificate expires (read at start only); InfiniteFuture without TLS.
  absl::Time tls_cert_not_after() const { return tls_cert_not_after_; }
  const TokenAuthenticator* auth() const { return auth_.get(); }
  Backend& backend() const { return *backend_; }
  CacheManager& manager() const { return *manager_; }
  MemoryRegistry& regions() const { return *regions_; }
  int64_t request_memory_bytes() const { return budget_->limit(); }
  // AttentionService calls running now (for tests and logs).
  int64_t calls_in_flight() const { return gate_->in_flight(); }
  // Why --backend=auto runs on the CPU although the build has CUDA; empty otherwise.
  const std::string& backend_fallback_reason() const { return backend_fallback_reason_; }

  // Health goes NOT_SERVING (on every port), new AttentionService calls are refused with
  // UNAVAILABLE, calls in flight get most of the grace period to finish, then are told to stop
  // (a stopped Forward commits nothing), and whatever is still open (Watch streams, calls that
  // did not stop) is cancelled when the grace period ends. Returns by then. Idempotent.
  void Shutdown(absl::Duration grace);
  // What Shutdown keeps of `grace` for calls told to stop to unwind in: a quarter, at most 1 s.
  static absl::Duration StopMargin(absl::Duration grace) {
    return std::min(grace / 4, absl::Seconds(1));
  }
  // During Shutdown: tells the calls in flight to stop now rather than at the end of the grace
  // period (a second SIGTERM or SIGINT); Shutdown then returns once they have.
  void StopCallsNow();
  // Blocks until the server has shut down.
  void Wait();
  // Health NOT_SERVING for good, on every port: the process can no longer serve (gRPC stopped
  // accepting on a listener) and must be restarted. Not from inside gRPC's own callbacks.
  void MarkBroken(const std::string& why);
  // Deletes the caches unused past ServerOptions::cache_idle_timeout (none when it is zero),
  // with their memory regions, and logs each; a thread of the server's calls it.
  void DeleteIdleCaches();

 private:
  PagedAttnServer() = default;

  // Declared first, destroyed last: the services below point at them.
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<CacheManager> manager_;
  std::unique_ptr<MemoryRegistry> regions_;  // after the backend: its mappings close first
  std::unique_ptr<TokenAuthenticator> auth_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<RpcGate> gate_;
  std::unique_ptr<ByteBudget> budget_;
  std::unique_ptr<SerialQueues> layer_queues_;  // over executor_, which runs its tasks
  std::unique_ptr<Executor> executor_;          // outlives the server: its tasks finish calls
  std::unique_ptr<Executor> control_executor_;  // likewise (its tasks post to executor_)
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<HealthServiceImpl> health_;
  std::unique_ptr<ReflectionServiceImpl> reflection_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ReflectionServiceImpl> health_port_reflection_;
  std::unique_ptr<grpc::CallbackGenericService> health_port_others_;  // its other methods' answer
  std::unique_ptr<grpc::Server> health_server_;
  std::unique_ptr<HttpServer> metrics_http_;
  std::string backend_fallback_reason_;
  std::vector<std::string> unix_sockets_;  // removed when the server has stopped
  int port_ = 0;
  std::vector<std::string> listening_;
  int health_port_ = 0;
  bool tls_ = false;
  absl::Time tls_cert_not_after_ = absl::InfiniteFuture();
  bool started_ = false;  // Start returned the server: it has served, and drains at shutdown
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  // Declared last, stopped first: it deletes through manager_, regions_ and metrics_.
  std::unique_ptr<PeriodicTask> idle_sweep_;
};

}  // namespace pagedattn
