// absl::Status -> grpc::Status with rich details.
#include "server/service/status.h"

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/core/cache_config.h"

namespace pagedattn {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  const auto code = static_cast<grpc::StatusCode>(static_cast<int>(status.code()));
  const std::string message(status.message());
  std::vector<FieldViolation> violations = FieldViolationsFromStatus(status);
  if (violations.empty()) return grpc::Status(code, message);

  google::rpc::BadRequest bad_request;
  for (const FieldViolation& v : violations) {
    auto* fv = bad_request.add_field_violations();
    fv->set_field(v.field);
    fv->set_description(v.description);
  }
  google::rpc::Status rich;
  rich.set_code(static_cast<int>(code));
  rich.set_message(message);
  rich.add_details()->PackFrom(bad_request);
  return grpc::Status(code, message, rich.SerializeAsString());
}

}  // namespace pagedattn
