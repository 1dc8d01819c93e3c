// Health: one serving bit, answered for "" and the AttentionService name.
#include "server/service/health.h"

#include "absl/time/time.h"

namespace pagedattn {
namespace {
using grpc::health::v1::HealthCheckResponse;

bool KnownService(const std::string& s) {
  return s.empty() || s == "pagedattn.v1.AttentionService";
}
}  // namespace

void HealthServiceImpl::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  serving_ = serving;
}

bool HealthServiceImpl::serving() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

grpc::Status HealthServiceImpl::Check(grpc::ServerContext*,
                                      const grpc::health::v1::HealthCheckRequest* req,
                                      HealthCheckResponse* resp) {
  if (!KnownService(req->service())) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service " + req->service());
  }
  resp->set_status(serving() ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
  return grpc::Status::OK;
}

grpc::Status HealthServiceImpl::Watch(grpc::ServerContext* ctx,
                                      const grpc::health::v1::HealthCheckRequest* req,
                                      grpc::ServerWriter<HealthCheckResponse>* writer) {
  HealthCheckResponse resp;
  if (!KnownService(req->service())) {
    resp.set_status(HealthCheckResponse::SERVICE_UNKNOWN);
    writer->Write(resp);
    return grpc::Status::OK;
  }
  struct Changed {
    const bool* now;
    const bool* last;
    bool operator()() const { return *now != *last; }
    bool Eval() const { return *now != *last; }
  };
  bool last = !serving();
  while (!ctx->IsCancelled()) {
    absl::MutexLock lock(&mu_);
    // Wake on a change, or every second to notice cancellation.
    Changed changed{&serving_, &last};
    mu_.AwaitWithTimeout(absl::Condition(&changed, &Changed::Eval), absl::Seconds(1));
    if (serving_ == last) continue;
    last = serving_;
    resp.set_status(last ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
    mu_.Unlock();
    const bool ok = writer->Write(resp);
    mu_.Lock();
    if (!ok) break;
  }
  return grpc::Status::OK;
}

}  // namespace pagedattn
