// absl::Status -> grpc::Status with rich details, bounded in size.
#include "server/service/status.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/core/cache_config.h"
#include "server/core/error_info.h"

namespace pagedattn {
namespace {

// s in at most max bytes: cut on a UTF-8 character boundary, saying how long it was.
std::string Bounded(absl::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  const std::string said = absl::StrCat("... (", s.size(), " bytes)");
  size_t end = max > said.size() ? max - said.size() : 0;
  while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xc0) == 0x80) --end;
  return absl::StrCat(s.substr(0, end), said);
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  const auto code = static_cast<grpc::StatusCode>(static_cast<int>(status.code()));
  const std::string message = Bounded(status.message(), kMaxStatusMessageBytes);
  std::vector<FieldViolation> violations = FieldViolationsFromStatus(status);
  const ErrorInfo info = ErrorInfoOf(status);
  if (violations.empty() && info.reason.empty()) return grpc::Status(code, message);

  google::rpc::Status rich;
  rich.set_code(static_cast<int>(code));
  rich.set_message(message);
  if (!violations.empty()) {
    google::rpc::BadRequest bad_request;
    const size_t shown = std::min(violations.size(), kMaxStatusViolations);
    size_t left = kMaxViolationDescriptionsBytes;
    for (size_t i = 0; i < shown; ++i) {
      auto* fv = bad_request.add_field_violations();
      fv->set_field(Bounded(violations[i].field, kMaxViolationFieldBytes));
      // Each later violation keeps at least kMinViolationDescriptionBytes of the budget.
      const size_t later = (shown - 1 - i) * kMinViolationDescriptionBytes;
      const size_t max = std::clamp(left - std::min(left, later), kMinViolationDescriptionBytes,
                                    kMaxViolationDescriptionBytes);
      fv->set_description(Bounded(violations[i].description, max));
      left -= std::min(left, fv->description().size());
    }
    rich.add_details()->PackFrom(bad_request);
  }
  if (!info.reason.empty()) {
    // The numbers of a RESOURCE_EXHAUSTED (pages, bytes, limits), for clients to read rather
    // than parse from the message.
    google::rpc::ErrorInfo error_info;
    error_info.set_reason(info.reason);
    error_info.set_domain("pagedattn.v1");
    for (const auto& [key, value] : info.fields) {
      (*error_info.mutable_metadata())[key] = std::to_string(value);
    }
    rich.add_details()->PackFrom(error_info);
  }
  return grpc::Status(code, message, rich.SerializeAsString());
}

}  // namespace pagedattn
