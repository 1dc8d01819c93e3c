// Listen addresses: "host:port", "[ipv6]:port" or ":port", checked before anything binds so
// that a bad flag is a clear start-up error rather than a port gRPC wraps or ignores.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pagedattn {

struct HostPort {
  std::string host;  // Without brackets; empty: every interface.
  int port = 0;      // 0..65535; 0 picks a free port.
};

// INVALID_ARGUMENT naming the flag and the value when it is not host:port with a port in
// 0..65535.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view flag, absl::string_view address);

}  // namespace pagedattn
