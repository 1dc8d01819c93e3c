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

// host:port again, with brackets around an IPv6 host ("[::1]:9464").
std::string FormatHostPort(const HostPort& hp);

}  // namespace pagedattn
