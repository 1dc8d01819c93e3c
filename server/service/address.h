// Listen addresses: "host:port", "[ipv6]:port", ":port" or "unix:/path", checked before
// anything binds so that a bad flag is a clear start-up error rather than a port gRPC wraps or
// ignores.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/host_port.h"

namespace pagedattn {

// INVALID_ARGUMENT naming the flag and the value when it is not host:port with a port in
// 0..65535 (common/host_port.h's parser).
absl::StatusOr<HostPort> ParseHostPort(absl::string_view flag, absl::string_view address);

// The address gRPC binds for a TCP listener: ":port" (every interface) as "0.0.0.0:port", which
// gRPC takes for IPv6's wildcard too where the host has IPv6; gRPC cannot parse an empty host.
std::string GrpcListenAddress(const HostPort& hp);

// One address of --listen: a TCP host:port, or a Unix socket "unix:/path/to.sock".
struct ListenAddress {
  std::string text;  // As given.
  bool unix_socket = false;
  std::string path;  // The socket's path (unix_socket).
  HostPort tcp;      // Otherwise.
};

// --listen's comma-separated addresses, each checked; INVALID_ARGUMENT naming a bad one.
absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(absl::string_view flag,
                                                                absl::string_view list);

}  // namespace pagedattn
