// HttpServer: a minimal HTTP/1.1 server answering GET on one path (Prometheus /metrics), IPv4
// and IPv6. One thread reads up to 64 requests side by side, each with a timeout and a size
// bound, and answers each once complete (Connection: close): slow or hostile clients hold only
// their own connections, a scrape is answered as soon as its request is in.
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
  void Answer(int fd, const std::string& request);  // a complete request's

  std::string path_;
  std::string content_type_;
  std::function<std::string()> body_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: written to stop the loop
  int port_ = 0;
  std::thread thread_;
};

}  // namespace pagedattn
