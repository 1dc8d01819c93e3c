// "host:port", "[ipv6]:port" and ":port", parsed once for every part that takes an address: the
// server's listen flags (server/service/address.h) and the clients' targets (FetchMetrics).
#pragma once

#include <string>
#include <string_view>

namespace pagedattn {

struct HostPort {
  std::string host;  // Without brackets; empty: every interface (a listener) or this host.
  int port = 0;      // 0..65535; 0 picks a free port (a listener).
};

// Parses `address` into *out. Returns "" when it is host:port with a port in 0..65535, else why
// not ("no :port", "the port is out of range", ...), for the caller's message.
std::string ParseHostPort(std::string_view address, HostPort* out);

// Why a client refuses gRPC target `target`, "" when it does not: a port past 65535, which gRPC
// takes modulo 65536 (another port, perhaps another server's), in a plain target (checked whole
// as host:port: a malformed one is refused too) or in a dns: URI's name ("dns:host:port",
// "dns:///host:port", "dns://authority/host:port"; only the port's range: a named port or none,
// "[::1]", is gRPC's to read). unix:, ipv4:, ipv6: and other URIs, and a target with no colon
// (gRPC's default port), pass.
std::string TargetPortError(std::string_view target);

// host:port again, with brackets around an IPv6 host ("[::1]:9464").
std::string FormatHostPort(const HostPort& hp);

}  // namespace pagedattn
