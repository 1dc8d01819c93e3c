// Health: one serving bit, answered for "" and the AttentionService name; Watch streams are
// reactors that write the latest status whenever it changes.
#include "server/service/health.h"

#include <string>

namespace pagedattn {
namespace {
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

bool KnownService(const std::string& s) {
  return s.empty() || s == "pagedattn.v1.AttentionService";
}

HealthCheckResponse::ServingStatus StatusOf(bool serving) {
  return serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}
}  // namespace

// One Watch stream: at most one write in flight; a change that arrives meanwhile is written
// when it completes (only the latest status matters).
class HealthServiceImpl::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  explicit Watcher(HealthServiceImpl* service) : service_(service) {}

  void Notify(HealthCheckResponse::ServingStatus status) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    pending_ = status;
    has_pending_ = true;
    if (!writing_) WriteNext();
  }

  void FinishNow(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    FinishOnce(status);
  }

  // One status, then the end of the stream (an unknown service: it will never change).
  void WriteAndFinish(HealthCheckResponse::ServingStatus status) {
    absl::MutexLock lock(&mu_);
    finished_ = true;
    response_.set_status(status);
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {  // the stream broke (the client went away, or the server is shutting down)
      FinishOnce(grpc::Status::OK);
      return;
    }
    WriteNext();
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    FinishOnce(grpc::Status::CANCELLED);
  }
  void OnDone() override {
    service_->Remove(this);
    delete this;
  }

 private:
  void WriteNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!has_pending_ || finished_) return;
    response_.set_status(pending_);
    has_pending_ = false;
    writing_ = true;
    StartWrite(&response_);
  }
  void FinishOnce(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  HealthServiceImpl* const service_;
  absl::Mutex mu_;
  HealthCheckResponse response_ ABSL_GUARDED_BY(mu_);
  HealthCheckResponse::ServingStatus pending_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

HealthServiceImpl::~HealthServiceImpl() {
  // The server has shut down before its services go: every stream is done.
  absl::MutexLock lock(&mu_);
  watchers_.clear();
}

void HealthServiceImpl::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (serving_ == serving) return;
  serving_ = serving;
  for (Watcher* w : watchers_) w->Notify(StatusOf(serving));
}

bool HealthServiceImpl::serving() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

void HealthServiceImpl::Remove(Watcher* w) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(w);
}

grpc::ServerUnaryReactor* HealthServiceImpl::Check(grpc::CallbackServerContext* ctx,
                                                   const HealthCheckRequest* req,
                                                   HealthCheckResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (!KnownService(req->service())) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND,
                     "unknown service (known: \"\" and pagedattn.v1.AttentionService)"));
    return reactor;
  }
  resp->set_status(StatusOf(serving()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthServiceImpl::Watch(
    grpc::CallbackServerContext*, const HealthCheckRequest* req) {
  auto* watcher = new Watcher(this);  // deletes itself in OnDone
  if (!KnownService(req->service())) {
    watcher->WriteAndFinish(HealthCheckResponse::SERVICE_UNKNOWN);
    return watcher;
  }
  absl::MutexLock lock(&mu_);
  if (watchers_.size() >= kMaxWatchers) {
    watcher->FinishNow(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                    "too many open health Watch streams; use Check, or retry"));
    return watcher;
  }
  watchers_.insert(watcher);
  watcher->Notify(StatusOf(serving_));
  return watcher;
}

}  // namespace pagedattn
