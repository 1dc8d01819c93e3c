// The one place core errors (absl::Status) become gRPC statuses. Field violations in the
// status payload travel as google.rpc.BadRequest details (grpc-status-details-bin).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace pagedattn {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace pagedattn
