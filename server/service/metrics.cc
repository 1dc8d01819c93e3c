// Metrics rendering (Prometheus text format 0.0.4).
#include "server/service/metrics.h"

#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace pagedattn {
namespace {

std::string Escape(absl::string_view v) {
  return absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

void Header(std::string* out, const char* name, const char* type, const char* help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

}  // namespace

void Metrics::RecordRpc(const std::string& method, absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  ++rpcs_[{method, absl::StatusCodeToString(code)}];
}

void Metrics::RecordForward(double seconds, int64_t tokens_appended, int64_t queries) {
  size_t b = 0;  // buckets are stored non-cumulative and summed when rendered
  while (b < kLatencyBuckets.size() && seconds > kLatencyBuckets[b]) ++b;
  latency_buckets_[b].fetch_add(1, std::memory_order_relaxed);
  latency_sum_ns_.fetch_add(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
  tokens_appended_.fetch_add(tokens_appended, std::memory_order_relaxed);
  queries_attended_.fetch_add(queries, std::memory_order_relaxed);
}

void Metrics::RecordForwardPhases(double parse_us, double stage_in_us, const ForwardTimings& core,
                                  double serialize_us, double queue_us) {
  const std::array<double, kPhases.size()> us = {
      parse_us,    queue_us,       stage_in_us, core.validate_us, core.stage_us, core.submit_us,
      core.h2d_us, core.kernel_us, core.d2h_us, core.commit_us,   serialize_us};
  for (size_t p = 0; p < kPhases.size(); ++p) {
    // A Forward answered once queued has no GPU phases to count.
    const std::string_view phase = kPhases[p];
    if (core.queued && (phase == "h2d" || phase == "kernel" || phase == "d2h")) continue;
    if (phase == "queue" && queue_us < 0) continue;  // run where it arrived: no queue
    const double seconds = us[p] * 1e-6;
    size_t b = 0;
    while (b < kPhaseBuckets.size() && seconds > kPhaseBuckets[b]) ++b;
    phase_buckets_[p][b].fetch_add(1, std::memory_order_relaxed);
    phase_sum_ns_[p].fetch_add(static_cast<int64_t>(us[p] * 1e3), std::memory_order_relaxed);
  }
}

std::string Metrics::Render(const CacheManager& manager) const {
  std::string out;
  Header(&out, "pagedattn_rpcs_total", "counter",
         "RPCs served, by method and status code (a Step stream's layers "
         "each count as one, under method Step).");
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, n] : rpcs_) {
      absl::StrAppend(&out, "pagedattn_rpcs_total{method=\"", key.first, "\",code=\"", key.second,
                      "\"} ", n, "\n");
    }
  }
  Header(&out, "pagedattn_forward_latency_seconds", "histogram",
         "Latency of successful Forwards in the service, unary or a Step stream's layers (parse "
         "to response).");
  int64_t cumulative = 0;
  for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
    cumulative += latency_buckets_[i].load(std::memory_order_relaxed);
    absl::StrAppend(&out, "pagedattn_forward_latency_seconds_bucket{le=\"", kLatencyBuckets[i],
                    "\"} ", cumulative, "\n");
  }
  const int64_t count =
      cumulative + latency_buckets_[kLatencyBuckets.size()].load(std::memory_order_relaxed);
  absl::StrAppend(&out, "pagedattn_forward_latency_seconds_bucket{le=\"+Inf\"} ", count, "\n");
  absl::StrAppendFormat(&out, "pagedattn_forward_latency_seconds_sum %.9f\n",
                        latency_sum_ns_.load(std::memory_order_relaxed) * 1e-9);
  absl::StrAppend(&out, "pagedattn_forward_latency_seconds_count ", count, "\n");
  Header(&out, "pagedattn_forward_phase_seconds", "histogram",
         "Where successful Forwards' time went in the server, by phase: parse (the request's "
         "bytes), queue (its wait for a thread, then for its turn on its layer: the calls on "
         "one layer of a cache run one at a time), stage_in (its tensors into "
         "the backend's buffers), validate (checks, pages, plan), stage "
         "(host-side preparation in the backend), submit (CUDA: host time queuing copies, event "
         "waits and kernels), h2d, kernel (GPU time; CPU: the compute), d2h, commit, serialize "
         "(the answer's bytes).");
  for (size_t p = 0; p < kPhases.size(); ++p) {
    int64_t n = 0;
    for (size_t b = 0; b <= kPhaseBuckets.size(); ++b) {
      n += phase_buckets_[p][b].load(std::memory_order_relaxed);
      absl::StrAppend(
          &out, "pagedattn_forward_phase_seconds_bucket{phase=\"", kPhases[p], "\",le=\"",
          b < kPhaseBuckets.size() ? absl::StrCat(kPhaseBuckets[b]) : "+Inf", "\"} ", n, "\n");
    }
    absl::StrAppendFormat(&out, "pagedattn_forward_phase_seconds_sum{phase=\"%s\"} %.9f\n",
                          kPhases[p], phase_sum_ns_[p].load(std::memory_order_relaxed) * 1e-9);
    absl::StrAppend(&out, "pagedattn_forward_phase_seconds_count{phase=\"", kPhases[p], "\"} ", n,
                    "\n");
  }
  Header(&out, "pagedattn_tokens_appended_total", "counter", "K/V rows written by Forward.");
  absl::StrAppend(&out, "pagedattn_tokens_appended_total ", tokens_appended_.load(), "\n");
  Header(&out, "pagedattn_queries_attended_total", "counter", "Query tokens attended by Forward.");
  absl::StrAppend(&out, "pagedattn_queries_attended_total ", queries_attended_.load(), "\n");

  const std::vector<std::shared_ptr<Cache>> caches = manager.ListAll();
  Header(&out, "pagedattn_caches", "gauge", "Live caches.");
  absl::StrAppend(&out, "pagedattn_caches ", caches.size(), "\n");
  Header(&out, "pagedattn_idle_caches_deleted_total", "counter",
         "Caches deleted for going unused past --cache_idle_timeout_s.");
  absl::StrAppend(&out, "pagedattn_idle_caches_deleted_total ", idle_caches_deleted_.load(), "\n");
  // Totals over every cache; per cache (labelled with its id, name and tenant) only when asked.
  CacheStats total;
  std::string free, used, seqs;
  for (const auto& c : caches) {
    const CacheStats s = c->Stats();
    total.free_pages += s.free_pages;
    total.used_pages += s.used_pages;
    total.live_sequences += s.live_sequences;
    if (!per_cache_) continue;
    const std::string labels =
        absl::StrCat("{cache_id=\"", c->id(), "\",name=\"", Escape(c->name()), "\",tenant=\"",
                     Escape(c->owner()), "\"} ");
    absl::StrAppend(&free, "pagedattn_cache_pages_free", labels, s.free_pages, "\n");
    absl::StrAppend(&used, "pagedattn_cache_pages_used", labels, s.used_pages, "\n");
    absl::StrAppend(&seqs, "pagedattn_cache_live_sequences", labels, s.live_sequences, "\n");
  }
  Header(&out, "pagedattn_pages_free", "gauge", "Free pages, all caches together.");
  absl::StrAppend(&out, "pagedattn_pages_free ", total.free_pages, "\n");
  Header(&out, "pagedattn_pages_used", "gauge", "Pages held by live sequences, all caches.");
  absl::StrAppend(&out, "pagedattn_pages_used ", total.used_pages, "\n");
  Header(&out, "pagedattn_live_sequences", "gauge", "Live sequences, all caches.");
  absl::StrAppend(&out, "pagedattn_live_sequences ", total.live_sequences, "\n");
  if (per_cache_) {
    Header(&out, "pagedattn_cache_pages_free", "gauge", "Free pages per cache.");
    out += free;
    Header(&out, "pagedattn_cache_pages_used", "gauge", "Pages held by live sequences per cache.");
    out += used;
    Header(&out, "pagedattn_cache_live_sequences", "gauge", "Live sequences per cache.");
    out += seqs;
  }
  Header(&out, "pagedattn_pool_bytes", "gauge", "Bytes of all cache pools.");
  absl::StrAppend(&out, "pagedattn_pool_bytes ", manager.total_pool_bytes(), "\n");
  absl::StatusOr<MemoryInfo> mem = manager.backend().memory(0);
  if (mem.ok()) {
    Header(&out, "pagedattn_device_memory_used_bytes", "gauge",
           "Device memory in use (all processes) on device 0, or host RAM on the CPU backend.");
    absl::StrAppend(&out, "pagedattn_device_memory_used_bytes ", mem->total_bytes - mem->free_bytes,
                    "\n");
    Header(&out, "pagedattn_device_memory_total_bytes", "gauge",
           "Device memory on device 0, or the host RAM this process may use on the CPU backend.");
    absl::StrAppend(&out, "pagedattn_device_memory_total_bytes ", mem->total_bytes, "\n");
  }
  return out;
}

}  // namespace pagedattn
