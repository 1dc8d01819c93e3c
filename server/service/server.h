// PagedAttnServer: builds and runs the gRPC server (AttentionService, grpc.health.v1,
// reflection) from a plain options struct, and shuts it down gracefully.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/cache_manager.h"
#include "server/service/attention_service.h"

namespace pagedattn {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";  // host:port; port 0 picks a free one.
  std::string backend = "auto";           // auto | cuda | cpu
  int64_t max_message_bytes = 512 << 20;  // Largest request/response.
  int cpu_threads = 0;                    // CPU backend workers (0: one per core).
  CacheManagerLimits limits;
};

class PagedAttnServer {
 public:
  // Creates the backend and starts listening; health is SERVING once this returns.
  static absl::StatusOr<std::unique_ptr<PagedAttnServer>> Start(const ServerOptions& options);
  ~PagedAttnServer();

  int port() const { return port_; }
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
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace pagedattn
