// HttpServer: a minimal HTTP/1.1 server answering GET on one path (Prometheus /metrics), IPv4
// and IPv6. One thread serves up to 64 connections side by side, reading each request and
// writing each answer without blocking (Connection: close), each with a deadline and a size
// bound: slow or hostile clients (sending nothing, or reading nothing) hold only their own
// connections, and when all slots are taken the client holding the most gives one up.
#pragma once

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
  std::string Answer(const std::string& request);  // a complete request's whole response

  std::string path_;
  std::string content_type_;
  std::function<std::string()> body_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: written to stop the loop
  int port_ = 0;
  std::thread thread_;
};

}  // namespace pagedattn
