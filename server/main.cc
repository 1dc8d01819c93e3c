// pagedattn-server: flags, logging and signal handling around PagedAttnServer.
// SIGTERM/SIGINT: health NOT_SERVING, new RPCs refused, in-flight ones finish, exit 0.
#include <csignal>
#include <cstdlib>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/core/backend_factory.h"
#include "server/service/server.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "host:port the gRPC service listens on (port 0 picks a free port)");
ABSL_FLAG(std::string, backend, "auto",
          "auto | cuda | cpu. auto uses CUDA when this build has it and a GPU is visible, "
          "otherwise the CPU backend");
ABSL_FLAG(int64_t, max_message_mb, 512,
          "largest request or response in MiB (a Forward carries q, k, v and out)");
ABSL_FLAG(std::string, log_level, "info",
          "trace | debug | info | warn | error | off. debug logs one line per RPC");
ABSL_FLAG(int, cpu_threads, 0, "worker threads of the CPU backend (0: one per hardware thread)");
ABSL_FLAG(std::string, prefill_kernel, "auto",
          "auto | portable. The CUDA backend's prefill kernel: auto runs the Hopper (wgmma) kernel "
          "on compute 9.0 GPUs when the build has sm_90a, the portable (mma.sync) kernel "
          "elsewhere; portable always runs the latter");
ABSL_FLAG(bool, graph_launch, true,
          "CUDA backend: launch kernels through cached CUDA graphs (about 2 us of host "
          "time per launch instead of 4-5, which an idle GPU waits for). false launches them "
          "plainly (an escape hatch)");
ABSL_FLAG(double, shutdown_grace_s, 10,
          "on SIGTERM/SIGINT, seconds in-flight RPCs get to finish before they are cancelled");
ABSL_FLAG(int64_t, max_caches_per_tenant, 64,
          "CreateCache beyond this many caches per tenant "
          "fails with RESOURCE_EXHAUSTED (0: no limit)");
ABSL_FLAG(double, max_total_pool_gb, 0,
          "upper bound on the bytes of all pools together, GiB (0: only device memory limits)");
ABSL_FLAG(int64_t, max_forward_tokens, 1 << 20,
          "largest number of queries plus new tokens in one Forward");
ABSL_FLAG(int64_t, max_forward_spans, 65536, "largest number of spans in one Forward");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM server certificate: serve the main port over TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mTLS); needs --tls_cert");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "file of bearer tokens, one per line as 'token [tenant]' (tenant 'default' when "
          "omitted). Set: every AttentionService call needs 'authorization: Bearer <token>' and "
          "sees only its tenant's caches; health and reflection stay open");
ABSL_FLAG(std::string, health_listen, "",
          "extra host:port serving only grpc.health.v1 in plaintext (for Kubernetes gRPC probes, "
          "which cannot speak TLS); empty: none");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port for Prometheus metrics over HTTP at /metrics; empty: none");

namespace {

std::string Usage() {
  return "a gRPC attention service with a paged KV cache.\n\n"
         "Holds paged KV caches in GPU memory (or RAM with the CPU backend), validates each\n"
         "cache's config when it is created, and runs paged attention Forward passes.\n"
         "grpc.health.v1 and server reflection are served on the same port.\n\n"
         "  pagedattn-server --listen=0.0.0.0:50051 --backend=auto --log_level=info\n";
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(Usage());
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "server/main.cc");
  };
  usage_config.version_string = [] {
    return std::string("pagedattn-server " PAGEDATTN_VERSION "\n");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);

  auto logger = spdlog::stdout_color_mt("pagedattn");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e%z %^%l%$ %v");
  const std::string level_name = absl::GetFlag(FLAGS_log_level);
  const spdlog::level::level_enum level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    spdlog::error("--log_level must be one of trace, debug, info, warn, error, off (got '{}')",
                  level_name);
    return 2;
  }
  spdlog::set_level(level);
  spdlog::flush_on(spdlog::level::info);

  // Block the shutdown signals in every thread; one thread waits for them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  pagedattn::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.prefill_kernel = absl::GetFlag(FLAGS_prefill_kernel);
  options.graph_launch = absl::GetFlag(FLAGS_graph_launch);
  options.limits.max_caches_per_tenant = absl::GetFlag(FLAGS_max_caches_per_tenant);
  options.limits.max_total_pool_bytes =
      static_cast<int64_t>(absl::GetFlag(FLAGS_max_total_pool_gb) * (1ull << 30));
  options.limits.forward.max_tokens = absl::GetFlag(FLAGS_max_forward_tokens);
  options.limits.forward.max_spans = absl::GetFlag(FLAGS_max_forward_spans);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);

  absl::StatusOr<std::unique_ptr<pagedattn::PagedAttnServer>> server =
      pagedattn::PagedAttnServer::Start(options);
  if (!server.ok()) {
    spdlog::critical("cannot start: {}", server.status().ToString());
    return 1;
  }
  pagedattn::Backend& backend = (*server)->backend();
  absl::StatusOr<pagedattn::MemoryInfo> mem = backend.memory(0);
  spdlog::info(
      "pagedattn-server {} listening on port {} ({}); backend {} on {} ({} device{}, "
      "{:.1f} of {:.1f} GiB free); build has CUDA: {}; health SERVING",
      PAGEDATTN_VERSION, (*server)->port(), options.listen, backend.name(), backend.device_name(),
      backend.device_count(), backend.device_count() == 1 ? "" : "s",
      mem.ok() ? mem->free_bytes / double(1 << 30) : 0.0,
      mem.ok() ? mem->total_bytes / double(1 << 30) : 0.0,
      pagedattn::BuiltWithCuda() ? "yes" : "no");
  if (backend.name() == "cuda") {
    spdlog::info("CUDA kernels: prefill {}, launches {}", options.prefill_kernel,
                 options.graph_launch ? "through cached graphs" : "plain");
  }
  spdlog::info(
      "security: {}; auth: {}; health port: {}; metrics: {}",
      (*server)->tls() ? (options.tls_client_ca_file.empty() ? "TLS" : "mTLS") : "plaintext",
      (*server)->auth() ? absl::StrCat((*server)->auth()->num_tokens(), " tokens, ",
                                       (*server)->auth()->num_tenants(), " tenants")
                        : std::string("off"),
      (*server)->health_port() ? absl::StrCat((*server)->health_port()) : std::string("none"),
      (*server)->metrics_port() ? absl::StrCat("http port ", (*server)->metrics_port(), " /metrics")
                                : std::string("off"));

  std::thread signal_thread([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    const double grace = absl::GetFlag(FLAGS_shutdown_grace_s);
    spdlog::info(
        "received {}: health NOT_SERVING, refusing new RPCs, waiting up to {} s for "
        "in-flight ones",
        sig == SIGTERM ? "SIGTERM" : "SIGINT", grace);
    (*server)->Shutdown(absl::Seconds(grace));
  });
  (*server)->Wait();
  signal_thread.join();
  spdlog::info("pagedattn-server stopped");
  return 0;
}
