// The listen flags' addresses: common/host_port.h's parser with the flag in its errors.
#include "server/service/address.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pagedattn {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view flag, absl::string_view address) {
  HostPort hp;
  if (const std::string why = ParseHostPort(std::string_view(address.data(), address.size()), &hp);
      !why.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must be host:port, [ipv6]:port or :port with a port in 0..65535 (got '", address,
        "': ", why, ")"));
  }
  return hp;
}

std::string GrpcListenAddress(const HostPort& hp) {
  return FormatHostPort({hp.host.empty() ? "0.0.0.0" : hp.host, hp.port});
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
