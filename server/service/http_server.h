// HttpServer: a minimal HTTP/1.1 server answering GET on one path (Prometheus /metrics), IPv4
// and IPv6. One thread answers one connection at a time (Connection: close); a request is read
// with a timeout and a size bound, so a slow or hostile client holds it for seconds at most.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace pagedattn {

class HttpServer {
 public:
  // listen: host:port (see ParseHostPort; port 0 picks one). body() is called per request.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& listen,
                                                           std::string path,
                                                           std::string content_type,
                                                           std::function<std::string()> body);
  ~HttpServer();  // Stops: closes the socket and joins the thread.
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

 private:
  HttpServer() = default;
  void Loop();
  void Answer(int fd);

  std::string path_;
  std::string content_type_;
  std::function<std::string()> body_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: written to stop the loop
  int port_ = 0;
  std::thread thread_;
};

}  // namespace pagedattn
