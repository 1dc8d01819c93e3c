// The one place core errors (absl::Status) become gRPC statuses. Field violations in the
// status payload travel as google.rpc.BadRequest details (grpc-status-details-bin).
#pragma once

#include <grpcpp/support/status.h>

#include <cstddef>

#include "absl/status/status.h"

namespace pagedattn {

// A status travels in the response's trailing metadata, which clients cap (8 KiB by default);
// one that is too long fails the connection's other calls too. So the message (which may
// quote request data) and the details are bounded: message and details together stay under
// about 6 KiB even after grpc-message's percent-encoding.
inline constexpr size_t kMaxStatusMessageBytes = 1024;
inline constexpr size_t kMaxStatusViolations = 10;
inline constexpr size_t kMaxViolationFieldBytes = 64;
// Descriptions share one budget (what ten of 160 bytes took), each up to 512 bytes: the few
// violations a config usually has travel whole, with their numbers and what would be valid.
inline constexpr size_t kMaxViolationDescriptionBytes = 512;
inline constexpr size_t kMaxViolationDescriptionsBytes = 1600;
inline constexpr size_t kMinViolationDescriptionBytes = 64;

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace pagedattn
