// Machine-readable numbers on an error: a reason ("OUT_OF_PAGES") and integer fields attached
// to an absl::Status as a payload, sent by the service as a google.rpc.ErrorInfo detail so that
// clients need not parse the message.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace pagedattn {

// Payload key: "reason\nkey=value\n...".
inline constexpr char kErrorInfoPayload[] = "type.pagedattn/error_info";

struct ErrorInfo {
  std::string reason;
  std::vector<std::pair<std::string, int64_t>> fields;
};

// status with the reason and fields attached (status must not be OK).
absl::Status WithErrorInfo(absl::Status status, const ErrorInfo& info);
// The attached info, or an empty reason.
ErrorInfo ErrorInfoOf(const absl::Status& status);

}  // namespace pagedattn
