// Metrics: Prometheus counters and histograms of the service, rendered as text exposition
// format, and a small embedded HTTP server (civetweb) that serves them at /metrics.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/cache_manager.h"

struct mg_context;
struct mg_connection;

namespace pagedattn {

class Metrics {
 public:
  // Upper bounds (seconds) of the Forward latency histogram buckets.
  static constexpr std::array<double, 14> kLatencyBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

  void RecordRpc(const std::string& method, absl::StatusCode code);
  // A successful Forward: its latency, K/V rows appended and queries attended.
  void RecordForward(double seconds, int64_t tokens_appended, int64_t queries);

  // The whole exposition: service counters plus per-cache and device gauges read now.
  std::string Render(const CacheManager& manager) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, int64_t> rpcs_ ABSL_GUARDED_BY(mu_);
  std::array<std::atomic<int64_t>, kLatencyBuckets.size()> latency_buckets_{};
  std::atomic<int64_t> latency_count_{0};
  std::atomic<int64_t> latency_sum_ns_{0};
  std::atomic<int64_t> tokens_appended_{0};
  std::atomic<int64_t> queries_attended_{0};
};

// Serves GET /metrics over plain HTTP. Stops on destruction.
class MetricsHttpServer {
 public:
  // listen: "host:port" or "port"; port 0 picks a free one.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& listen,
                                                                  const Metrics* metrics,
                                                                  const CacheManager* manager);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  static int HandleMetrics(::mg_connection* conn, void* self);

  const Metrics* metrics_ = nullptr;
  const CacheManager* manager_ = nullptr;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace pagedattn
