// HttpServer: getaddrinfo + bind + a poll loop over the listening socket, a wake-up eventfd and
// the connections whose request is still arriving.
#include "server/service/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/service/address.h"
#include "spdlog/spdlog.h"

namespace pagedattn {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
// For the whole request, not each read: a client that trickles a byte at a time gives up its
// slot after this long.
constexpr int kRequestTimeoutMs = 2000;
// Connections served side by side (reading a request, writing an answer, or closing); past it
// the oldest connection of the client address holding the most gives way for a new one, so
// that one client opening connections cannot push out another's scrape.
constexpr size_t kMaxPending = 64;
// For the whole answer: a client that reads nothing (or a byte at a time) gives up its slot
// after this long. Answers are written without blocking: such a client holds only its own slot.
constexpr int kAnswerTimeoutMs = 5000;
// After the answer: the client's remaining bytes are read and dropped for at most this long
// before the socket is closed, so that closing on unread bytes (a POST body, a pipelined
// request) does not reset the connection and destroy the answer in flight.
constexpr int kLingerMs = 1000;
// accept() failing for want of descriptors (EMFILE, ENFILE) leaves the connection queued and
// the socket readable: the loop stops polling it this long instead of spinning on it.
constexpr int kAcceptBackoffMs = 100;

std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body, absl::string_view extra_headers = "",
                     bool with_body = true) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                      "Connection: close\r\n\r\n", with_body ? body : "");
}

// Deadlines on a clock that does not step with the wall clock's corrections.
absl::Time Monotonic() {
  return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

// The address (no port) of a connection's peer: the unit that kMaxPending is shared between.
std::string PeerOf(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, text, sizeof(text));
  } else if (a.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, text, sizeof(text));
  }
  return text;
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
  // "Every interface": IPv6's wildcard first (with IPV6_V6ONLY off it takes IPv4 too, as the
  // gRPC ports do); IPv4's alone only where the host has no IPv6. getaddrinfo lists 0.0.0.0
  // first, which left /metrics unreachable over IPv6 while gRPC answered on it.
  std::vector<addrinfo*> candidates;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) candidates.push_back(a);
  if (host.empty()) {
    std::stable_partition(candidates.begin(), candidates.end(),
                          [](const addrinfo* a) { return a->ai_family == AF_INET6; });
  }
  std::unique_ptr<HttpServer> s(new HttpServer());
  std::string last_error = "no address";
  for (addrinfo* a : candidates) {
    if (s->listen_fd_ >= 0) break;
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // not REUSEPORT: a busy
                                                                  // port must fail
    if (a->ai_family == AF_INET6 && host.empty()) {
      const int zero = 0;  // "every interface" means IPv4 too
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
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
  // Every open connection: reading its request, writing its answer, or reading what is left
  // before closing. Nothing blocks: each holds only its own slot, until its deadline.
  enum class State { kReading, kWriting, kLingering };
  struct Conn {
    int fd = -1;
    std::string peer;
    absl::Time deadline;
    State state = State::kReading;
    std::string request;
    std::string answer;
    size_t sent = 0;
  };
  std::vector<Conn> conns;
  auto drop = [&](size_t i) {
    close(conns[i].fd);
    conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
  };
  // The answer is written; what the client still sends is read and dropped until it closes.
  auto linger = [](Conn& c, absl::Time now) {
    shutdown(c.fd, SHUT_WR);
    c.state = State::kLingering;
    c.deadline = now + absl::Milliseconds(kLingerMs);
  };
  // Writes what the socket takes now; true when the connection is done with (an error).
  auto write_some = [&](Conn& c, absl::Time now) {
    while (c.sent < c.answer.size()) {
      const ssize_t n = send(c.fd, c.answer.data() + c.sent, c.answer.size() - c.sent,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
      if (n <= 0) return true;
      c.sent += static_cast<size_t>(n);
    }
    linger(c, now);
    return false;
  };
  auto start_answer = [&](Conn& c, std::string answer, absl::Time now) {
    c.answer = std::move(answer);
    c.request.clear();
    c.state = State::kWriting;
    c.deadline = now + absl::Milliseconds(kAnswerTimeoutMs);
    return write_some(c, now);
  };
  absl::Time accept_paused_until = absl::InfinitePast();
  std::vector<pollfd> fds;
  while (true) {
    const absl::Time before = Monotonic();
    const bool accepting = before >= accept_paused_until;
    fds.assign(
        {{listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0}, {wake_fd_, POLLIN, 0}});
    absl::Time next = accepting ? absl::InfiniteFuture() : accept_paused_until;
    for (const Conn& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.state == State::kWriting ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const int timeout_ms =
        next == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(next - before) + 1));
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno != EINTR) {  // ENOMEM: try again shortly rather than end /metrics for good
        spdlog::warn("/metrics: poll failed ({}); retrying", std::strerror(errno));
        absl::SleepFor(absl::Milliseconds(100));
      }
      continue;
    }
    if (fds[1].revents != 0) break;
    const absl::Time now = Monotonic();
    for (size_t i = conns.size(); i-- > 0;) {
      const short revents = fds[2 + i].revents;
      if (revents == 0) continue;
      Conn& c = conns[i];
      if (c.state == State::kWriting) {
        if (write_some(c, now)) drop(i);
        continue;
      }
      char buf[4096];
      const ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) {  // closed (or reset)
        drop(i);
        continue;
      }
      if (c.state == State::kLingering) continue;  // dropped unread
      c.request.append(buf, static_cast<size_t>(n));
      bool done = false;
      if (c.request.find("\r\n\r\n") != std::string::npos ||
          c.request.find("\n\n") != std::string::npos) {
        done = start_answer(c, Answer(c.request), now);
      } else if (c.request.size() >= kMaxRequestBytes) {
        done = start_answer(
            c, Response("431 Request Header Fields Too Large", "text/plain", "request too large\n"),
            now);
      }
      if (done) drop(i);
    }
    for (size_t i = conns.size(); i-- > 0;) {
      if (conns[i].deadline <= now) drop(i);  // too slow
    }
    if (accepting && (fds[0].revents & POLLIN) != 0) {
      sockaddr_storage peer = {};
      socklen_t peer_len = sizeof(peer);
      const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &peer_len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        std::string who = PeerOf(peer);
        if (conns.size() >= kMaxPending) {
          // The oldest connection of the address holding the most (the newcomer's included)
          // gives way: one client opening connections pushes out only its own.
          std::map<std::string, size_t> held;
          for (const Conn& c : conns) ++held[c.peer];
          ++held[who];
          size_t most = 0;
          std::string greediest;
          for (const auto& [address, count] : held) {
            if (count > most) most = count, greediest = address;
          }
          size_t victim = 0;  // everyone holds one: the oldest
          if (most > 1) {
            while (conns[victim].peer != greediest) ++victim;
          }
          drop(victim);
        }
        Conn c;
        c.fd = fd;
        c.peer = std::move(who);
        c.deadline = now + absl::Milliseconds(kRequestTimeoutMs);
        conns.push_back(std::move(c));
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        accept_paused_until = now + absl::Milliseconds(kAcceptBackoffMs);
      }
    }
  }
  for (const Conn& c : conns) close(c.fd);
}

std::string HttpServer::Answer(const std::string& request) {
  // Request line: METHOD SP target SP version. An answer to HEAD has no body, whatever it says.
  const bool with_body = !absl::StartsWith(request, "HEAD ");
  const size_t sp1 = request.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : request.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) {
    return Response("400 Bad Request", "text/plain", "bad request line\n", "", with_body);
  }
  const std::string method = request.substr(0, sp1);
  std::string target = request.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = target.find('?'); q != std::string::npos) target.resize(q);
  if (target != path_) {
    return Response("404 Not Found", "text/plain", absl::StrCat("only ", path_, " is served\n"), "",
                    with_body);
  }
  if (method != "GET" && method != "HEAD") {
    return Response("405 Method Not Allowed", "text/plain", "GET only\n", "Allow: GET, HEAD\r\n");
  }
  return Response("200 OK", content_type_, body_(), "", with_body);
}

}  // namespace pagedattn
