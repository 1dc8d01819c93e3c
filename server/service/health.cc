// Health: one serving bit, answered for "" and the AttentionService name; Watch streams are
// reactors that write the latest status whenever it changes.
#include "server/service/health.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/service/request_parse.h"
#include "server/service/status.h"

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

// The request of `method`, parsed when it is no larger than a health request needs to be.
absl::StatusOr<HealthCheckRequest> ParseHealthRequest(const grpc::ByteBuffer& bytes,
                                                      absl::string_view method) {
  if (absl::Status s = CheckRequestArrived(bytes); !s.ok()) return s;
  if (absl::Status s = CheckRequestSize(bytes, absl::StrCat(method, " request names a service"),
                                        HealthServiceImpl::kMaxRequestBytes);
      !s.ok()) {
    return s;
  }
  HealthCheckRequest request;
  if (absl::Status s = ParseRequest(bytes, method, &request); !s.ok()) return s;
  return request;
}

grpc::ByteBuffer Serialized(HealthCheckResponse::ServingStatus status) {
  HealthCheckResponse response;
  response.set_status(status);
  // A message of one enum field: it always serializes.
  return *SerializeResponse(response);
}
}  // namespace

// One Watch stream: at most one write in flight; a change that arrives meanwhile is written
// when it completes (only the latest status matters).
class HealthServiceImpl::Watcher final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
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
    response_ = Serialized(status);
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
    response_ = Serialized(pending_);
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
  grpc::ByteBuffer response_ ABSL_GUARDED_BY(mu_);  // the write in flight
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
                                                   const grpc::ByteBuffer* req,
                                                   grpc::ByteBuffer* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<HealthCheckRequest> request = ParseHealthRequest(*req, "Health/Check");
  if (!request.ok()) {
    reactor->Finish(ToGrpcStatus(request.status()));
    return reactor;
  }
  if (!KnownService(request->service())) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND,
                     "unknown service (known: \"\" and pagedattn.v1.AttentionService)"));
    return reactor;
  }
  *resp = Serialized(StatusOf(serving()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HealthServiceImpl::Watch(grpc::CallbackServerContext*,
                                                                     const grpc::ByteBuffer* req) {
  auto* watcher = new Watcher(this);  // deletes itself in OnDone
  absl::StatusOr<HealthCheckRequest> request = ParseHealthRequest(*req, "Health/Watch");
  if (!request.ok()) {
    watcher->FinishNow(ToGrpcStatus(request.status()));
    return watcher;
  }
  if (!KnownService(request->service())) {
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
