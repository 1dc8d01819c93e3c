// ParseHostPort: the one parser of listen addresses for the gRPC ports and /metrics.
#include "server/service/address.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pagedattn {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view flag, absl::string_view address) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must be host:port, [ipv6]:port or :port with a port in 0..65535 (got '", address,
        "': ", why, ")"));
  };
  HostPort hp;
  absl::string_view port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return bad("no closing ']'");
    hp.host = std::string(address.substr(1, close - 1));
    if (close + 1 >= address.size() || address[close + 1] != ':') return bad("no :port");
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return bad("no :port");
    hp.host = std::string(address.substr(0, colon));
    if (hp.host.find(':') != std::string::npos) return bad("an IPv6 address needs [brackets]");
    port = address.substr(colon + 1);
  }
  for (char c : hp.host) {
    if (absl::ascii_iscntrl(static_cast<unsigned char>(c)) || c == ' ') {
      return bad("the host has a space or a control character");
    }
  }
  if (port.empty() || port.size() > 5 || !absl::SimpleAtoi(port, &hp.port) ||
      !absl::ascii_isdigit(static_cast<unsigned char>(port.front()))) {
    return bad("the port is not a number");
  }
  if (hp.port < 0 || hp.port > 65535) return bad("the port is out of range");
  return hp;
}

absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(absl::string_view flag,
                                                                absl::string_view list) {
  std::vector<ListenAddress> out;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    ListenAddress a;
    a.text = std::string(item);
    if (absl::ConsumePrefix(&item, "unix:")) {
      absl::ConsumePrefix(&item, "//");  // unix:///abs/path
      if (item.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag, ": a Unix socket needs a path (unix:/path/to.sock)"));
      }
      a.unix_socket = true;
      a.path = std::string(item);
    } else {
      absl::StatusOr<HostPort> hp = ParseHostPort(flag, item);
      if (!hp.ok()) return hp.status();
      a.tcp = *hp;
    }
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace pagedattn
