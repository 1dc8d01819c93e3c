// HttpServer: getaddrinfo + bind + a poll loop over the listening socket, a wake-up eventfd and
// the connections whose request is still arriving.
#include "server/service/http_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/service/address.h"

namespace pagedattn {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
// For the whole request, not each read: a client that trickles a byte at a time gives up its
// slot after this long.
constexpr int kRequestTimeoutMs = 2000;
// Requests read side by side; past it the oldest is dropped for a new connection, so that
// connections that send nothing cannot keep a scrape out (6 of them held one for 12 s when
// connections were read one at a time).
constexpr size_t kMaxPending = 64;
// Answers are written blocking (they fit a socket's buffer but for the largest /metrics): a
// client that reads nothing holds the loop this long at most.
constexpr int kAnswerTimeoutMs = 500;

void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

void Respond(int fd, absl::string_view status, absl::string_view content_type,
             absl::string_view body, absl::string_view extra_headers = "") {
  WriteAll(fd, absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                            "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                            "Connection: close\r\n\r\n"));
  WriteAll(fd, body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& listen,
                                                              std::string path,
                                                              std::string content_type,
                                                              std::function<std::string()> body) {
  absl::StatusOr<HostPort> hp = ParseHostPort("--metrics_listen", listen);
  if (!hp.ok()) return hp.status();
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(hp->port);
  const std::string host = hp->host == "0.0.0.0" || hp->host == "*" ? "" : hp->host;
  if (const int err =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      err != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen ", listen, ": ", gai_strerror(err)));
  }
  std::unique_ptr<HttpServer> s(new HttpServer());
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr && s->listen_fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // not REUSEPORT: a busy
                                                                  // port must fail
    if (a->ai_family == AF_INET6 && host.empty()) {
      const int zero = 0;  // "every interface" means IPv4 too
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      s->listen_fd_ = fd;
    } else {
      last_error = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (s->listen_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen ", listen, ": cannot listen (", last_error, ")"));
  }
  sockaddr_storage bound = {};
  socklen_t len = sizeof(bound);
  getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  s->path_ = std::move(path);
  s->content_type_ = std::move(content_type);
  s->body_ = std::move(body);
  s->thread_ = std::thread([raw = s.get()] { raw->Loop(); });
  return s;
}

HttpServer::~HttpServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void HttpServer::Loop() {
  // Connections whose request is still arriving, read side by side: a client that trickles
  // bytes (or sends none) holds only its own slot, for at most kRequestTimeoutMs.
  struct Pending {
    int fd;
    absl::Time deadline;
    std::string request;
  };
  std::vector<Pending> pending;
  auto drop = [&](size_t i) {
    close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  std::vector<pollfd> fds;
  while (true) {
    fds.assign({{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}});
    absl::Time next = absl::InfiniteFuture();
    for (const Pending& p : pending) {
      fds.push_back({p.fd, POLLIN, 0});
      next = std::min(next, p.deadline);
    }
    const int timeout_ms = next == absl::InfiniteFuture()
                               ? -1
                               : static_cast<int>(std::max<int64_t>(
                                     0, absl::ToInt64Milliseconds(next - absl::Now()) + 1));
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;
    // Reads what each pending connection has; answers those whose request is complete.
    for (size_t i = pending.size(); i-- > 0;) {
      if (fds[2 + i].revents == 0) continue;
      Pending& p = pending[i];
      char buf[1024];
      const ssize_t n = recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        drop(i);  // closed
        continue;
      }
      if (n > 0) p.request.append(buf, static_cast<size_t>(n));
      if (p.request.find("\r\n\r\n") != std::string::npos ||
          p.request.find("\n\n") != std::string::npos) {
        Answer(p.fd, p.request);
        drop(i);
      } else if (p.request.size() >= kMaxRequestBytes) {
        Respond(p.fd, "431 Request Header Fields Too Large", "text/plain", "request too large\n");
        drop(i);
      }
    }
    const absl::Time now = absl::Now();
    for (size_t i = pending.size(); i-- > 0;) {
      if (pending[i].deadline <= now) drop(i);  // too slow
    }
    if ((fds[0].revents & POLLIN) != 0) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        if (pending.size() >= kMaxPending) drop(0);  // the oldest gives way
        // A client that does not read its answer must not hold the loop either.
        const timeval timeout = {kAnswerTimeoutMs / 1000, (kAnswerTimeoutMs % 1000) * 1000};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
        pending.push_back({fd, now + absl::Milliseconds(kRequestTimeoutMs), {}});
      }
    }
  }
  for (const Pending& p : pending) close(p.fd);
}

void HttpServer::Answer(int fd, const std::string& request) {
  // Request line: METHOD SP target SP version.
  const size_t sp1 = request.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : request.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) {
    Respond(fd, "400 Bad Request", "text/plain", "bad request line\n");
    return;
  }
  const std::string method = request.substr(0, sp1);
  std::string target = request.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = target.find('?'); q != std::string::npos) target.resize(q);
  if (target != path_) {
    Respond(fd, "404 Not Found", "text/plain", absl::StrCat("only ", path_, " is served\n"));
    return;
  }
  if (method != "GET" && method != "HEAD") {
    Respond(fd, "405 Method Not Allowed", "text/plain", "GET only\n", "Allow: GET, HEAD\r\n");
    return;
  }
  const std::string body = body_();
  if (method == "HEAD") {
    WriteAll(fd,
             absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: ", content_type_,
                          "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n"));
    return;
  }
  Respond(fd, "200 OK", content_type_, body);
}

}  // namespace pagedattn
