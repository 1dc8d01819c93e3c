// FetchMetrics: GET /metrics from the server's --metrics_listen over a plain socket (HTTP/1.0),
// IPv4 and IPv6 alike, with a connect and an I/O timeout so that a wrong target fails fast.
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/host_port.h"

namespace pagedattn {
namespace {

constexpr int kConnectTimeoutMs = 5000;  // per address, at most
constexpr size_t kMaxResponseBytes = size_t{256} << 20;

// Waits for `events` on fd: "" when ready, else why not.
std::string Await(int fd, short events, int timeout_ms) {
  pollfd p = {fd, events, 0};
  for (;;) {
    const int n = poll(&p, 1, timeout_ms);
    if (n > 0) return "";
    if (n == 0) return absl::StrCat("no answer in ", timeout_ms / 1000.0, " s");
    if (errno != EINTR) return std::strerror(errno);
  }
}

// A connected, non-blocking socket to one of host:port's addresses; else UNAVAILABLE saying why
// the last address failed.
absl::StatusOr<int> ConnectAny(const HostPort& hp, int timeout_ms) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(hp.port);
  if (const int err = getaddrinfo(hp.host.empty() ? "localhost" : hp.host.c_str(), port.c_str(),
                                  &hints, &found);
      err != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", hp.host, "': ", gai_strerror(err)));
  }
  absl::Cleanup free_found = [found] { freeaddrinfo(found); };
  std::string why = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    std::string failed;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        failed = std::strerror(errno);
      } else if (failed = Await(fd, POLLOUT, std::min(kConnectTimeoutMs, timeout_ms));
                 failed.empty()) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) failed = std::strerror(err);
      }
    }
    if (failed.empty()) return fd;
    char numeric[NI_MAXHOST] = "?";
    getnameinfo(a->ai_addr, a->ai_addrlen, numeric, sizeof(numeric), nullptr, 0, NI_NUMERICHOST);
    why = absl::StrCat("connect to ", FormatHostPort({numeric, hp.port}), ": ", failed);
    close(fd);
  }
  return absl::UnavailableError(why);
}

}  // namespace

absl::StatusOr<std::string> FetchMetrics(const std::string& target, absl::Duration timeout) {
  const int io_ms =
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 1, INT32_MAX));
  HostPort hp;
  if (const std::string why = ParseHostPort(target, &hp); !why.empty() || hp.port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics target must be host:port or [ipv6]:port with a port in 1..65535 "
                     "(got '",
                     target, "': ", why.empty() ? "port 0" : why, ")"));
  }
  const std::string authority = FormatHostPort({hp.host.empty() ? "localhost" : hp.host, hp.port});
  const std::string url = absl::StrCat("http://", authority, "/metrics");
  auto unavailable = [&](absl::string_view why) {
    return absl::UnavailableError(absl::StrCat("cannot fetch ", url, ": ", why));
  };
  const absl::StatusOr<int> connected = ConnectAny(hp, io_ms);
  if (!connected.ok()) return unavailable(connected.status().message());
  const int fd = *connected;
  absl::Cleanup close_fd = [fd] { close(fd); };

  const std::string request =
      absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", authority, "\r\nAccept: text/plain\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return unavailable(std::strerror(errno));
    } else if (std::string late = Await(fd, POLLOUT, io_ms); !late.empty()) {
      return unavailable(late);
    }
  }
  // The whole answer within `timeout` of the request, not each wait: a server trickling bytes
  // cannot hold the caller past it.
  const absl::Time answer_deadline = absl::Now() + timeout;
  std::string response;
  char buf[16384];
  for (;;) {
    const int64_t left_ms = absl::ToInt64Milliseconds(answer_deadline - absl::Now());
    if (left_ms <= 0) {
      return unavailable(absl::StrCat("no whole answer within ", absl::FormatDuration(timeout)));
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;  // HTTP/1.0: the server closes after the body
    if (n > 0) {
      response.append(buf, static_cast<size_t>(n));
      if (response.size() > kMaxResponseBytes) {
        return unavailable(absl::StrCat("the answer passed ", kMaxResponseBytes >> 20, " MiB"));
      }
    } else if (errno != EAGAIN && errno != EINTR) {
      return unavailable(std::strerror(errno));
    } else if (std::string late =
                   Await(fd, POLLIN, static_cast<int>(std::min<int64_t>(left_ms, io_ms)));
               !late.empty()) {
      return unavailable(late);
    }
  }
  // "HTTP/1.x NNN reason\r\n" headers "\r\n\r\n" body.
  const size_t head_end = response.find("\r\n\r\n");
  int status = 0;
  if (response.rfind("HTTP/1.", 0) != 0 || response.size() < 12 || response[8] != ' ' ||
      !absl::SimpleAtoi(absl::string_view(response).substr(9, 3), &status) ||
      head_end == std::string::npos) {
    return unavailable("the answer is not HTTP");
  }
  if (status != 200)
    return absl::UnavailableError(absl::StrCat("GET ", url, " answered HTTP ", status));
  return response.substr(head_end + 4);
}

}  // namespace pagedattn
