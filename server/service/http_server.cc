// HttpServer: getaddrinfo + bind + a poll loop over the listening socket and a wake-up eventfd.
#include "server/service/http_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/service/address.h"

namespace pagedattn {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
// For the whole request, not each read: connections are answered one at a time, so a client that
// trickles a byte at a time must not hold the port (a scrape waits at most this long behind it).
constexpr int kRequestTimeoutMs = 2000;

void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

void Respond(int fd, absl::string_view status, absl::string_view content_type,
             absl::string_view body) {
  WriteAll(fd, absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                            "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n"));
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
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Answer(fd);
    close(fd);
  }
}

void HttpServer::Answer(int fd) {
  // A client that does not read the answer must not hold the port either.
  const timeval timeout = {kRequestTimeoutMs / 1000, (kRequestTimeoutMs % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(kRequestTimeoutMs);
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() >= kMaxRequestBytes) {
      Respond(fd, "431 Request Header Fields Too Large", "text/plain", "request too large\n");
      return;
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd readable = {fd, POLLIN, 0};
    if (left_ms <= 0 || poll(&readable, 1, static_cast<int>(left_ms)) <= 0) return;  // too slow
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) return;  // closed
    request.append(buf, static_cast<size_t>(n));
  }
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
    Respond(fd, "405 Method Not Allowed", "text/plain", "GET only\n");
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
