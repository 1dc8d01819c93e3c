// HealthServiceImpl: grpc.health.v1 for the whole server ("") and for
// pagedattn.v1.AttentionService, shared by the main port and the plaintext health port.
#pragma once

#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace pagedattn {

class HealthServiceImpl final : public grpc::health::v1::Health::Service {
 public:
  void SetServing(bool serving);
  bool serving() const;

  grpc::Status Check(grpc::ServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req,
                     grpc::health::v1::HealthCheckResponse* resp) override;
  // Sends the status now and on every change until the call is cancelled.
  grpc::Status Watch(grpc::ServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pagedattn
