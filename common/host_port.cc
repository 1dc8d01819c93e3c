// ParseHostPort and FormatHostPort: host:port, [ipv6]:port and :port, one parser for the
// server's listen flags and the clients' targets.
#include "common/host_port.h"

#include <cctype>
#include <charconv>

namespace pagedattn {

std::string ParseHostPort(std::string_view address, HostPort* out) {
  HostPort hp;
  std::string_view port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string_view::npos) return "no closing ']'";
    hp.host = std::string(address.substr(1, close - 1));
    if (close + 1 >= address.size() || address[close + 1] != ':') return "no :port";
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string_view::npos) return "no :port";
    hp.host = std::string(address.substr(0, colon));
    if (hp.host.find(':') != std::string::npos) return "an IPv6 address needs [brackets]";
    port = address.substr(colon + 1);
  }
  for (char c : hp.host) {
    if (std::iscntrl(static_cast<unsigned char>(c)) || c == ' ') {
      return "the host has a space or a control character";
    }
  }
  if (port.empty() || port.size() > 5 || !std::isdigit(static_cast<unsigned char>(port.front())) ||
      std::from_chars(port.data(), port.data() + port.size(), hp.port).ptr !=
          port.data() + port.size()) {
    return "the port is not a number";
  }
  if (hp.port < 0 || hp.port > 65535) return "the port is out of range";
  *out = std::move(hp);
  return "";
}

std::string TargetPortError(std::string_view target) {
  const bool dns = target.substr(0, 4) == "dns:";
  if (dns) {
    target.remove_prefix(4);
    if (target.substr(0, 2) == "//") {  // an authority (often empty) before the name
      const size_t slash = target.find('/', 2);
      if (slash == std::string_view::npos) return "";
      target.remove_prefix(slash + 1);
    }
  } else if (target.find('/') != std::string_view::npos || target.substr(0, 5) == "unix:" ||
             target.substr(0, 5) == "ipv4:" || target.substr(0, 5) == "ipv6:") {
    return "";
  }
  if (target.find(':') == std::string_view::npos) return "";
  HostPort hp;
  std::string why = ParseHostPort(target, &hp);
  return !dns || why == "the port is out of range" ? why : "";
}

std::string FormatHostPort(const HostPort& hp) {
  const bool v6 = hp.host.find(':') != std::string::npos;
  return (v6 ? "[" + hp.host + "]" : hp.host) + ":" + std::to_string(hp.port);
}

}  // namespace pagedattn
