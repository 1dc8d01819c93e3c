// Metrics: Prometheus counters and histograms of the service, rendered as text exposition
// format (served at /metrics by an HttpServer). /metrics needs no token, so by default it holds
// no cache id (a capability), name or tenant: per-cache series are opt-in.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/cache_manager.h"

namespace pagedattn {

class Metrics {
 public:
  // per_cache: also series per cache, labelled with its id, name and tenant (--metrics_per_cache).
  explicit Metrics(bool per_cache = false) : per_cache_(per_cache) {}

  // Upper bounds (seconds) of the Forward latency histogram buckets.
  static constexpr std::array<double, 14> kLatencyBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

  void RecordRpc(const std::string& method, absl::StatusCode code);
  // A successful Forward: its latency, K/V rows appended and queries attended.
  void RecordForward(double seconds, int64_t tokens_appended, int64_t queries);
  // A cache deleted for going unused past --cache_idle_timeout_s.
  void RecordIdleCacheDeleted() { idle_caches_deleted_.fetch_add(1, std::memory_order_relaxed); }

  // Where a successful Forward's time went (microseconds): receiving and parsing, the core's
  // phases, building the answer; queue_us, its wait for a thread and its layer (negative: none).
  void RecordForwardPhases(double parse_us, double stage_in_us, const ForwardTimings& core,
                           double serialize_us, double queue_us = -1);

  // The whole exposition: service counters plus cache and device gauges read now.
  std::string Render(const CacheManager& manager) const;

 private:
  const bool per_cache_;
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, int64_t> rpcs_ ABSL_GUARDED_BY(mu_);
  // Non-cumulative, the last past every bound (+Inf): the count is their sum, so that a scrape
  // never shows a bucket above it (a separate count, read apart, once did).
  std::array<std::atomic<int64_t>, kLatencyBuckets.size() + 1> latency_buckets_{};
  std::atomic<int64_t> latency_sum_ns_{0};
  // Phase histograms, bucket counts non-cumulative: [phase][bucket], then +Inf.
  static constexpr std::array<double, 12> kPhaseBuckets = {1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5,
                                                           1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3,   5e-2};
  static constexpr std::array<const char*, 11> kPhases = {
      "parse", "queue",  "stage_in", "validate", "stage",    "submit",
      "h2d",   "kernel", "d2h",      "commit",   "serialize"};
  std::array<std::array<std::atomic<int64_t>, kPhaseBuckets.size() + 1>, kPhases.size()>
      phase_buckets_{};
  std::array<std::atomic<int64_t>, kPhases.size()> phase_sum_ns_{};
  std::atomic<int64_t> tokens_appended_{0};
  std::atomic<int64_t> queries_attended_{0};
  std::atomic<int64_t> idle_caches_deleted_{0};
};

}  // namespace pagedattn
