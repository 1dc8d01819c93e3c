// pagedattn-server: flags (from the command line or PAGEDATTN_<FLAG> variables), logging, and
// signal handling around PagedAttnServer. SIGTERM/SIGINT: a bounded graceful shutdown, exit 0;
// SIGHUP: a warning, nothing else.
#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <sys/resource.h>
#include <unistd.h>  // environ

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cmdline.h"
#include "common/transport.h"
#include "server/core/backend_factory.h"
#include "server/core/host_memory.h"
#include "server/service/address.h"
#include "server/service/server.h"
#include "server/service/throttled_log.h"
#include "server/service/tls.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace pagedattn {

// Flags with a fixed set of values are enums, parsed here (absl's AbslParseFlag protocol).
bool AbslParseFlag(absl::string_view text, BackendChoice* out, std::string* error) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto")
    *out = BackendChoice::kAuto;
  else if (t == "cuda")
    *out = BackendChoice::kCuda;
  else if (t == "cpu")
    *out = BackendChoice::kCpu;
  else {
    *error = "must be one of auto, cuda, cpu";
    return false;
  }
  return true;
}
std::string AbslUnparseFlag(BackendChoice b) {
  return b == BackendChoice::kCuda ? "cuda" : b == BackendChoice::kCpu ? "cpu" : "auto";
}
bool AbslParseFlag(absl::string_view text, PrefillKernel* out, std::string* error) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "auto")
    *out = PrefillKernel::kAuto;
  else if (t == "portable")
    *out = PrefillKernel::kPortable;
  else {
    *error = "must be one of auto, portable";
    return false;
  }
  return true;
}
std::string AbslUnparseFlag(PrefillKernel k) {
  return k == PrefillKernel::kPortable ? "portable" : "auto";
}

}  // namespace pagedattn

using pagedattn::BackendChoice;
using pagedattn::PrefillKernel;

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "where the gRPC service listens, comma-separated or the flag given again: host:port or "
          "[ipv6]:port (port 0 "
          "picks a free port; the start-up log line says which) and unix:/path/to.sock (a Unix "
          "socket for clients on the same host; see --unix_socket_mode). A port or socket in "
          "use is a start-up error; a socket file left by a stopped server is replaced");
ABSL_FLAG(std::string, unix_socket_mode, "0660",
          "file mode (octal) of the Unix sockets of --listen: who may connect is who may open "
          "the file (0660: the server's user and group)");
ABSL_FLAG(BackendChoice, backend, BackendChoice::kAuto,
          "auto | cuda | cpu. auto: CUDA when this build has it and every visible GPU can run "
          "its kernels, else the CPU backend (with a warning saying why); cuda: refuse to start "
          "without a usable GPU");
ABSL_FLAG(int64_t, max_message_mb, 512,
          "largest request or response, MiB (1..2047). A Forward carries q, k and v in and out "
          "(and lse) back; one whose answer would be larger is refused before anything is written, "
          "and a cache whose one query's answer would be is refused at CreateCache");
ABSL_FLAG(
    int64_t, request_memory_mb, 0,
    "memory for requests in flight, MiB: gRPC's receive buffers are held to it (past it "
    "the transport resets streams with RESOURCE_EXHAUSTED) and, separately, the Forward "
    "data held by calls, a Forward's from its arrival until its answer is sent or its call ends "
    "(past it a Forward gets RESOURCE_EXHAUSTED: retry). 0: a quarter of the "
    "memory this process may use (cgroup limits included), at least 64 and at most 2 x "
    "--max_message_mb + 64; else at least 16 (the transport's largest read) and --max_message_mb");
ABSL_FLAG(std::string, log_level, "info",
          "trace | debug | info | warn | error | off. debug logs one line per RPC; trace also "
          "gRPC's own debug lines");
ABSL_FLAG(int, cpu_threads, 0,
          "worker threads of the CPU backend (0..4096; 0: one per hardware thread)");
ABSL_FLAG(PrefillKernel, prefill_kernel, PrefillKernel::kAuto,
          "auto | portable. The CUDA backend's prefill kernel: auto runs the Hopper (wgmma) "
          "kernel on compute 9.0 GPUs when the build has sm_90a, the portable (mma.sync) kernel "
          "elsewhere; portable always runs the latter (an escape hatch)");
ABSL_FLAG(bool, graph_launch, true,
          "CUDA backend: launch kernels through cached CUDA graphs (about 2 us of host time per "
          "launch instead of 4-5, which an idle GPU waits for). false launches them plainly (an "
          "escape hatch; it also turns --forward_graph off)");
ABSL_FLAG(bool, forward_graph, true,
          "CUDA backend: submit each Forward's upload, and then its kernels, download and event "
          "records, as cached CUDA graphs (two runtime calls instead of about a dozen). false "
          "submits them one by one, the kernels through --graph_launch's per-kernel graphs");
ABSL_FLAG(double, shutdown_grace_s, 10,
          "on SIGTERM/SIGINT: health goes NOT_SERVING, new calls and new steps on open Step "
          "streams are refused, calls in flight (a Step stream's open step) get this many seconds "
          "(0..3600) less a margin to unwind in (a quarter of it, at most 1 s) and are then "
          "stopped (at once on a second signal); the process exits within it (at most 3 s later, "
          "forced, where gRPC cannot end a call: an answer its client does not read)");
ABSL_FLAG(int64_t, max_caches_per_tenant, 64,
          "CreateCache beyond this many caches per tenant fails with RESOURCE_EXHAUSTED "
          "(0: no limit)");
ABSL_FLAG(double, max_total_pool_gb, 0,
          "upper bound on the bytes of all pools together, GiB (0: only device memory limits; "
          "else at least 1/1024, a MiB)");
ABSL_FLAG(int64_t, cache_idle_timeout_s, 0,
          "delete a cache that no Forward (or Step layer), release or truncate has come to for "
          "this many seconds (from the last one's end; never while one runs, or while one that "
          "came in time waits for its turn), as DeleteCache "
          "would: the caches of an orchestrator that died (0: never; 1..31536000)");
ABSL_FLAG(int64_t, max_forward_tokens, 1 << 20,
          "largest number of queries plus new tokens in one Forward (>= 1)");
ABSL_FLAG(int64_t, max_forward_spans, 65536, "largest number of spans in one Forward (>= 1)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM server certificate: serve the main port over TLS (with --tls_key). Checked at "
          "start: readable, parseable, in its validity period, matching the key");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert (unencrypted)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mTLS); needs --tls_cert");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "file of bearer tokens, one per line as 'token [tenant]' (tenant 'default' when "
          "omitted; tokens of at least 16 RFC 6750 characters, 6 of them different, no "
          "placeholder text such as REPLACE or CHANGEME, e.g. `openssl rand -hex 32`). Set: every "
          "AttentionService call needs 'authorization: Bearer <token>' and sees only its "
          "tenant's caches; health and reflection stay open");
ABSL_FLAG(std::string, health_listen, "",
          "extra host:port serving grpc.health.v1 and server reflection in plaintext, not "
          "AttentionService (for Kubernetes gRPC probes, which cannot speak TLS); empty: none");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port (or [ipv6]:port) for Prometheus metrics over HTTP at /metrics (no auth: "
          "totals only, see --metrics_per_cache); empty: none");
ABSL_FLAG(bool, metrics_per_cache, false,
          "also export per-cache series labelled with cache id, name and tenant. /metrics needs "
          "no token and a cache id is a capability: turn on only where /metrics is private");
ABSL_FLAG(int64_t, max_memory_regions, 1024,
          "device memory regions clients may hold at once (RegisterMemory, CUDA backend; "
          "0..1000000, 0: RegisterMemory refused, tensors go as bytes)");
ABSL_FLAG(int64_t, memory_lease_seconds, 300,
          "a registered memory region no Forward has used for this long is released (the "
          "default of a RegisterMemory that names no lease; 1..86400): what a client that died "
          "leaves");

namespace {

constexpr char kEnvPrefix[] = "PAGEDATTN_";

std::string Usage() {
  return "a gRPC attention service with a paged KV cache.\n\n"
         "Holds paged KV caches in GPU memory (or RAM with the CPU backend), validates each\n"
         "cache's config when it is created, and runs paged attention Forward passes.\n"
         "grpc.health.v1 and server reflection are served on the same port.\n\n"
         "usage: pagedattn-server [--flag=value ...]\n"
         "  e.g. pagedattn-server --listen=0.0.0.0:50051 --backend=auto --log_level=info\n\n"
         "Every flag can also be set as an environment variable PAGEDATTN_<FLAG> (upper case,\n"
         "e.g. PAGEDATTN_LOG_LEVEL=debug); the command line wins. Other PAGEDATTN_* variables\n"
         "are ignored (and named in the start-up log).\n";
}

// This program's own flags (not absl's or gRPC's), by name.
std::map<std::string, absl::CommandLineFlag*> ServerFlags() {
  std::map<std::string, absl::CommandLineFlag*> out;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "server/main.cc")) out[std::string(name)] = flag;
  }
  return out;
}

// --help: the usage and every flag with its default, on stdout, exit 0.
void PrintHelp() {
  std::cout << "pagedattn-server: " << Usage() << "\nflags:\n";
  pagedattn::PrintFlagsHelp(std::cout, ServerFlags());
}

// Sets each flag that has a PAGEDATTN_<FLAG> variable; the command line, parsed after, wins.
// Returns the PAGEDATTN_* variables that name no flag (for a log line), or exits on a bad value.
// Edits (insertions, deletions, substitutions) that take a to b.
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// An environment variable that is no flag's, with the flag's variable it is likely a typo of
// (at most 3 edits away), if any: PAGEDATTN_AUTH_TOKEN_FILE would otherwise start a server
// without the auth its operator meant to turn on.
struct IgnoredVariable {
  std::string name;
  std::string likely;  // empty: no flag's variable is close
};

std::vector<IgnoredVariable> FlagsFromEnvironment(std::set<std::string>* from_env) {
  std::map<std::string, absl::CommandLineFlag*> flags = ServerFlags();
  std::vector<IgnoredVariable> ignored;
  for (char** e = environ; *e != nullptr; ++e) {
    absl::string_view entry(*e);
    if (!absl::StartsWith(entry, kEnvPrefix)) continue;
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos) continue;
    const std::string var(entry.substr(0, eq));
    const std::string name = absl::AsciiStrToLower(var.substr(sizeof(kEnvPrefix) - 1));
    auto it = flags.find(name);
    if (it == flags.end()) {
      if (var == "PAGEDATTN_TOKEN") continue;  // the CLI's token
      IgnoredVariable v{var, ""};
      size_t best = 4;
      for (const auto& [flag, unused] : flags) {
        const size_t d = EditDistance(name, flag);
        if (d < best) {
          best = d;
          v.likely = absl::StrCat(kEnvPrefix, absl::AsciiStrToUpper(flag));
        }
      }
      ignored.push_back(std::move(v));
      continue;
    }
    std::string error;
    if (!it->second->ParseFrom(entry.substr(eq + 1), &error)) {
      std::cerr << "pagedattn-server: " << var << ": " << error << "\n";
      std::exit(2);
    }
    from_env->insert(name);
  }
  return ignored;
}

// " (set by PAGEDATTN_<FLAG>, ...)" for the flags a message names whose values came from the
// environment (empty if none): a container sets variables, not flags, and its operator looks
// for the variable.
std::string SetByEnvironment(absl::string_view message, const std::set<std::string>& from_env) {
  std::vector<std::string> variables;
  for (const std::string& name : from_env) {
    const std::string flag = absl::StrCat("--", name);
    for (size_t at = message.find(flag); at != absl::string_view::npos;
         at = message.find(flag, at + 1)) {
      const size_t end = at + flag.size();
      if (end == message.size() || !(absl::ascii_isalnum(message[end]) || message[end] == '_')) {
        variables.push_back(absl::StrCat(kEnvPrefix, absl::AsciiStrToUpper(name)));
        break;
      }
    }
  }
  if (variables.empty()) return "";
  return absl::StrCat(" (set by ", absl::StrJoin(variables, ", "), ")");
}

absl::StatusOr<int> ParseSocketMode(const std::string& text) {
  if (text.empty() || text.size() > 4 || text.find_first_not_of("01234567") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--unix_socket_mode must be an octal file mode like 0660 (got '", text, "')"));
  }
  int mode = 0;
  for (char c : text) mode = mode * 8 + (c - '0');
  return mode;
}

// --request_memory_mb's largest value (16 TiB).
constexpr int64_t kMaxRequestMemoryMb = int64_t{1} << 24;

// Every flag value that is out of range, each named (checked before anything starts).
std::vector<std::string> InvalidFlags() {
  std::vector<std::string> bad;
  // The TCP addresses with a fixed port, by flag: two flags on one port would fail at start as
  // "in use by another process", which it is not.
  std::vector<std::pair<std::string, pagedattn::HostPort>> fixed;
  auto claim = [&](const std::string& flag, const pagedattn::HostPort& hp) {
    if (hp.port == 0) return;
    auto any = [](const std::string& h) { return h.empty() || h == "0.0.0.0" || h == "::"; };
    for (const auto& [other, o] : fixed) {
      if (o.port == hp.port && (o.host == hp.host || any(o.host) || any(hp.host))) {
        bad.push_back(absl::StrCat(flag, " and ", other, " both take port ", hp.port,
                                   ": give each a port of its own"));
        return;
      }
    }
    fixed.emplace_back(flag, hp);
  };
  if (absl::StatusOr<std::vector<pagedattn::ListenAddress>> listen =
          pagedattn::ParseListenAddresses("--listen", absl::GetFlag(FLAGS_listen));
      !listen.ok()) {
    bad.emplace_back(listen.status().message());
  } else {
    for (const pagedattn::ListenAddress& a : *listen) {
      if (!a.unix_socket) claim("--listen", a.tcp);
    }
  }
  auto address = [&](const char* flag, const std::string& value, bool optional) {
    if (optional && value.empty()) return;
    absl::StatusOr<pagedattn::HostPort> hp = pagedattn::ParseHostPort(flag, value);
    if (!hp.ok()) {
      bad.emplace_back(hp.status().message());
    } else {
      claim(flag, *hp);
    }
  };
  if (absl::StatusOr<int> mode = ParseSocketMode(absl::GetFlag(FLAGS_unix_socket_mode));
      !mode.ok()) {
    bad.emplace_back(mode.status().message());
  }
  if (const std::string level = absl::AsciiStrToLower(absl::GetFlag(FLAGS_log_level));
      spdlog::level::from_str(level) == spdlog::level::off && level != "off") {
    bad.push_back(
        absl::StrCat("--log_level must be one of trace, debug, info, warn, error, off "
                     "(any case; got '",
                     absl::GetFlag(FLAGS_log_level), "')"));
  }
  // TLS's files come in pairs (the server's start checks them again, for callers of the library).
  const bool cert = !absl::GetFlag(FLAGS_tls_cert).empty(),
             key = !absl::GetFlag(FLAGS_tls_key).empty();
  if (cert != key) bad.emplace_back("--tls_cert and --tls_key must be given together");
  if (!cert && !key && !absl::GetFlag(FLAGS_tls_client_ca).empty()) {
    bad.emplace_back("--tls_client_ca needs --tls_cert and --tls_key");
  }
  address("--health_listen", absl::GetFlag(FLAGS_health_listen), true);
  address("--metrics_listen", absl::GetFlag(FLAGS_metrics_listen), true);
  // Whole numbers as integers ("0..31536000", not "0..3.1536e+07"), as --help gives them.
  auto number = [](double v) {
    return v == std::trunc(v) && std::abs(v) < 1e15 ? absl::StrCat(static_cast<int64_t>(v))
                                                    : absl::StrCat(v);
  };
  auto range = [&](const char* flag, double value, double lo, double hi) {
    if (!(value >= lo && value <= hi)) {  // also false for NaN
      bad.push_back(absl::StrCat(flag, " must be in ", number(lo), "..", number(hi), " (got ",
                                 number(value), ")"));
    }
  };
  range("--max_message_mb", absl::GetFlag(FLAGS_max_message_mb), 1, 2047);
  range("--request_memory_mb", absl::GetFlag(FLAGS_request_memory_mb), 0, kMaxRequestMemoryMb);
  range("--cpu_threads", absl::GetFlag(FLAGS_cpu_threads), 0, 4096);
  range("--shutdown_grace_s", absl::GetFlag(FLAGS_shutdown_grace_s), 0, 3600);
  range("--max_caches_per_tenant", absl::GetFlag(FLAGS_max_caches_per_tenant), 0, 1e9);
  range("--max_total_pool_gb", absl::GetFlag(FLAGS_max_total_pool_gb), 0, 1e7);
  // A budget under a MiB would be 0 bytes or hold no pool: 0 means no limit, so a tiny value
  // meant as "almost nothing" must not turn into "everything".
  if (const double gb = absl::GetFlag(FLAGS_max_total_pool_gb); gb > 0 && gb < 1.0 / 1024) {
    bad.push_back(
        absl::StrCat("--max_total_pool_gb must be 0 (no limit) or at least 1/1024 "
                     "(1 MiB; got ",
                     gb, ")"));
  }
  range("--cache_idle_timeout_s", absl::GetFlag(FLAGS_cache_idle_timeout_s), 0, 31536000);
  range("--max_forward_tokens", absl::GetFlag(FLAGS_max_forward_tokens), 1, 1e12);
  range("--max_forward_spans", absl::GetFlag(FLAGS_max_forward_spans), 1, 1e9);
  range("--max_memory_regions", absl::GetFlag(FLAGS_max_memory_regions), 0, 1e6);
  range("--memory_lease_seconds", absl::GetFlag(FLAGS_memory_lease_seconds), 1, 86400);
  const int64_t request_mb = absl::GetFlag(FLAGS_request_memory_mb);
  constexpr int64_t kMinRequestMemoryMb = pagedattn::kMaxReadChunkBytes >> 20;
  if (request_mb > 0 && request_mb < kMinRequestMemoryMb) {
    bad.push_back(absl::StrCat(
        "--request_memory_mb must be 0 or at least ", kMinRequestMemoryMb, " (got ", request_mb,
        "): gRPC reads a connection's bytes in pieces of up to ", kMinRequestMemoryMb,
        " MiB, and with less it cannot receive even a small call"));
  } else if (request_mb > 0 && request_mb < absl::GetFlag(FLAGS_max_message_mb)) {
    bad.push_back(absl::StrCat(
        "--request_memory_mb (", request_mb, ") must be at least --max_message_mb (",
        absl::GetFlag(FLAGS_max_message_mb), "): a largest message could never be received"));
  } else if (const pagedattn::HostMemoryInfo host = pagedattn::HostMemory();
             request_mb > 0 && request_mb <= kMaxRequestMemoryMb && host.total_bytes > 0 &&
             (request_mb << 20) > host.total_bytes) {  // out of range: said above
    bad.push_back(absl::StrCat("--request_memory_mb (", request_mb,
                               ") is more than the host memory this process may use (",
                               host.total_bytes >> 20,
                               " MiB: the host's, its memory cgroup's or RLIMIT_AS): the limit "
                               "would never hold requests back"));
  }
  return bad;
}

// The host of a --*_listen address (host:port, [ipv6]:port; ":port" binds 0.0.0.0, every
// interface), as the start-up log names where a port is bound: a probe port on 127.0.0.1 is
// unreachable from outside a pod.
std::string ListenHost(absl::string_view listen) {
  const size_t colon = listen.rfind(':');
  const absl::string_view host =
      colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  return host.empty() ? "0.0.0.0" : std::string(host);
}

// The throttle's kind of a library's log line: its text before the first ':' (where the
// details a caller chooses, such as a TLS server name, usually follow), at most 80 characters,
// so that a client varying those details is still throttled as one kind.
std::string LineKind(absl::string_view library, absl::string_view message) {
  absl::string_view head = message.substr(0, 80);
  head = head.substr(0, head.find(':'));
  return absl::StrCat(library, ": ", head);
}

// Set by gRPC's line "Failed accept4: ...": gRPC has given up on a listener (before 1.56 it
// stops accepting on any accept error but EINTR, EAGAIN and ECONNABORTED, out-of-files included)
// and the port answers no one until a restart, while the health port may still say SERVING. Acted
// on by a thread in main, not here: this runs inside gRPC, where the health service's Watch streams
// must not be called back into.
std::atomic<bool> grpc_listener_failed{false};

// gRPC's own log lines. Errors a caller causes (a failed TLS handshake, a TLS server name the
// certificate does not have, a reset connection) are debug lines.
void GrpcLogToSpdlog(gpr_log_func_args* args) {
  const std::string message = absl::CHexEscape(args->message ? args->message : "");
  // gRPC's listener line only, from its own source: other lines quote text a caller chooses (a
  // TLS server name "Failed accept4" must not take the server out of service).
  const absl::string_view file = args->file != nullptr ? args->file : "";
  const absl::string_view raw = args->message != nullptr ? args->message : "";
  if (args->severity == GPR_LOG_SEVERITY_ERROR &&
      (absl::EndsWith(file, "tcp_server_posix.cc") ||
       absl::EndsWith(file, "posix_engine_listener.cc")) &&
      (absl::StartsWith(raw, "Failed accept4") ||
       absl::StartsWith(raw, "Closing acceptor. Failed accept4"))) {
    grpc_listener_failed.store(true);
  }
  spdlog::level::level_enum level = args->severity == GPR_LOG_SEVERITY_ERROR ? spdlog::level::warn
                                    : args->severity == GPR_LOG_SEVERITY_INFO
                                        ? spdlog::level::debug
                                        : spdlog::level::trace;
  for (const char* caller_caused :
       {"Handshake failed", "handshake", "ssl_transport_security", "No match found for server name",
        "Connection reset", "Socket closed", "endpoint", "Broken pipe", "frame of size"}) {
    if (absl::StrContains(message, caller_caused)) level = spdlog::level::debug;
  }
  pagedattn::LogThrottled(level, LineKind("grpc", message), "grpc: " + message);
}

// protobuf's own lines (by default unthrottled on stderr, whatever --log_level says). Those of a
// request that does not parse (a string field that is not UTF-8) are the caller's: debug.
void ProtobufLogToSpdlog(google::protobuf::LogLevel severity, const char* /*file*/, int /*line*/,
                         const std::string& text) {
  const std::string message = absl::CHexEscape(text);
  spdlog::level::level_enum level =
      severity >= google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn : spdlog::level::debug;
  if (absl::StrContains(message, "invalid UTF-8") || absl::StrContains(message, "parsing")) {
    level = spdlog::level::debug;
  }
  pagedattn::LogThrottled(level, LineKind("protobuf", message), "protobuf: " + message);
}

}  // namespace

// The open-file soft limit raised to the hard one (systemd's default soft limit is 1024). Every
// connection holds a descriptor, and gRPC stops accepting on a listener for good once accept()
// fails with EMFILE (grpc/grpc#20418): a burst of 1,100 idle connections against 1024 left the
// port dead while the health port said SERVING. Returns the limit now in force (0: unknown).
rlim_t RaiseOpenFilesLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return raised.rlim_cur;
  }
  return limit.rlim_cur;
}

// Below this many open files a client can exhaust them with connections alone.
constexpr rlim_t kFewOpenFiles = 65536;

// A TLS certificate that expires sooner than this is a start-up warning.
constexpr absl::Duration kCertificateWarning = absl::Hours(14 * 24);

// How long past the grace period the process may take to exit before it is made to (BoundTheExit).
constexpr absl::Duration kForcedExitAfter = absl::Seconds(3);

// Bounds the exit even where gRPC cannot end a call: an answer its client does not read held
// grpc::Server::Shutdown 13-15 s past the grace, or the server's destructor after main 8 s. A
// detached thread, so that it also outlives main: `after` from now it writes one error line in
// the log's format to stdout (not through spdlog, which may be going away by then) and exits 0
// (the shutdown was asked for; what the process held goes with it).
void BoundTheExit(absl::Duration after) {
  std::thread([after] {
    absl::SleepFor(after);
    const std::string line = absl::StrCat(
        absl::FormatTime("%Y-%m-%dT%H:%M:%E3S%Ez", absl::Now(), absl::UTCTimeZone()),
        " error shutdown not done ", absl::FormatDuration(kForcedExitAfter),
        " after the grace period: a call gRPC could not end holds it (an answer its client "
        "does not read); exiting now\n");
    std::fflush(stdout);
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fflush(stdout);
    std::_Exit(0);
  }).detach();
}

// SIGHUP's default action ends the process at once, unlogged, with every cache and the calls in
// flight (`kill -HUP` from habit, a log rotator, a closed terminal). There is nothing to reload:
// it is logged and ignored.
void LogHangupIgnored() {
  spdlog::warn(
      "received SIGHUP: ignored (pagedattn-server reloads nothing: restart it for new flags, "
      "TLS files or tokens; SIGTERM or SIGINT shuts it down)");
}

int main(int argc, char** argv) {
  // Block the shutdown signals (and SIGHUP) first, in every thread to come; one thread waits for
  // them with sigwait once the server runs. A signal during start-up waits for it (it used to
  // kill the process unlogged in its first milliseconds).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  switch (pagedattn::FindInfoFlag(argc, argv)) {
    case pagedattn::InfoFlag::kHelp:
      PrintHelp();
      return 0;
    case pagedattn::InfoFlag::kVersion:
      std::cout << "pagedattn-server " << PAGEDATTN_VERSION
                << (pagedattn::BuiltWithCuda() ? " (CUDA and CPU backends)" : " (CPU backend)")
                << "\n";
      return 0;
    case pagedattn::InfoFlag::kNone:
      break;
  }
  absl::SetProgramUsageMessage(Usage());
  std::set<std::string> from_env;  // flags whose value is an environment variable's
  const std::vector<IgnoredVariable> ignored_env = FlagsFromEnvironment(&from_env);
  for (int i = 1; i < argc; ++i) {  // the command line wins
    absl::string_view a(argv[i]);
    if (!absl::ConsumePrefix(&a, "--") && !absl::ConsumePrefix(&a, "-")) continue;
    from_env.erase(std::string(a.substr(0, a.find('='))));
  }
  std::map<std::string, std::vector<std::string>> repeated =
      pagedattn::RepeatedFlags(argc, argv, pagedattn::FlagKinds(ServerFlags(), "server/main.cc"));
  // A value that does not parse is reported below with every other bad value; absl's parser
  // would exit 1 on it alone. Without one, absl parses the command line (its own flags too).
  const std::vector<std::string> unparsable = pagedattn::UnparsableFlags(
      argc, argv, ServerFlags(),
      [](absl::string_view name) { return absl::FindCommandLineFlag(name) != nullptr; });
  std::vector<char*> rest;
  if (unparsable.empty()) rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "pagedattn-server: unexpected argument '" << rest[1]
              << "' (flags are --name=value; see --help)\n";
    return 2;
  }
  // --listen given several times listens on every address, as its comma-separated list does;
  // any other flag given twice is an error rather than a value silently dropped.
  if (auto listen = repeated.find("listen"); listen != repeated.end()) {
    absl::SetFlag(&FLAGS_listen, absl::StrJoin(listen->second, ","));
    repeated.erase(listen);
  }
  // Every flag given twice and every bad value, together.
  std::vector<std::string> bad = unparsable;
  for (std::string& e : pagedattn::RepeatedFlagErrors(repeated)) bad.push_back(std::move(e));
  for (std::string& e : InvalidFlags()) bad.push_back(std::move(e));
  // A value from the environment is named by its variable too: a container sets no flags.
  for (std::string& e : bad) absl::StrAppend(&e, SetByEnvironment(e, from_env));
  if (!bad.empty()) {
    std::cerr << "pagedattn-server: " << absl::StrJoin(bad, "\npagedattn-server: ") << "\n";
    return 2;
  }

  auto logger = spdlog::stdout_color_mt("pagedattn");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e%z %^%l%$ %v");
  const spdlog::level::level_enum level =
      spdlog::level::from_str(absl::AsciiStrToLower(absl::GetFlag(FLAGS_log_level)));
  spdlog::set_level(level);  // a valid name: InvalidFlags checked it
  spdlog::flush_on(spdlog::level::info);
  gpr_set_log_function(GrpcLogToSpdlog);
  google::protobuf::SetLogHandler(ProtobufLogToSpdlog);
  gpr_set_log_verbosity(level <= spdlog::level::trace ? GPR_LOG_SEVERITY_DEBUG
                                                      : GPR_LOG_SEVERITY_ERROR);
  std::vector<std::string> unrelated;
  for (const IgnoredVariable& v : ignored_env) {
    if (v.likely.empty()) {
      unrelated.push_back(v.name);
    } else {
      spdlog::warn("environment: {} ignored (no such flag): did you mean {}?", v.name, v.likely);
    }
  }
  if (!unrelated.empty()) {
    spdlog::info("environment: {} ignored (no such flag; see --help)",
                 absl::StrJoin(unrelated, ", "));
  }

  pagedattn::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.unix_socket_mode = *ParseSocketMode(absl::GetFlag(FLAGS_unix_socket_mode));  // checked
  options.backend = {.backend = absl::GetFlag(FLAGS_backend),
                     .cpu_threads = absl::GetFlag(FLAGS_cpu_threads),
                     .prefill_kernel = absl::GetFlag(FLAGS_prefill_kernel),
                     .graph_launch = absl::GetFlag(FLAGS_graph_launch),
                     .forward_graph = absl::GetFlag(FLAGS_forward_graph)};
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  options.request_memory_bytes = absl::GetFlag(FLAGS_request_memory_mb) << 20;
  options.limits.max_caches_per_tenant = absl::GetFlag(FLAGS_max_caches_per_tenant);
  options.limits.max_total_pool_bytes =
      static_cast<int64_t>(absl::GetFlag(FLAGS_max_total_pool_gb) * (1ull << 30));
  options.cache_idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_cache_idle_timeout_s));
  options.limits.forward.max_tokens = absl::GetFlag(FLAGS_max_forward_tokens);
  options.limits.forward.max_spans = absl::GetFlag(FLAGS_max_forward_spans);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.metrics_per_cache = absl::GetFlag(FLAGS_metrics_per_cache);
  options.memory.max_regions = absl::GetFlag(FLAGS_max_memory_regions);
  options.memory.default_lease = absl::Seconds(absl::GetFlag(FLAGS_memory_lease_seconds));

  const rlim_t open_files = RaiseOpenFilesLimit();
  absl::StatusOr<std::unique_ptr<pagedattn::PagedAttnServer>> server =
      pagedattn::PagedAttnServer::Start(options);
  if (!server.ok()) {
    const std::string why = absl::StrCat(server.status().ToString(),
                                         SetByEnvironment(server.status().message(), from_env));
    if (spdlog::should_log(spdlog::level::critical)) {
      spdlog::critical("cannot start: {}", why);
    } else {  // --log_level=off: the reason the process exits is still told
      std::cerr << "pagedattn-server: cannot start: " << why << "\n";
    }
    return 1;
  }
  pagedattn::Backend& backend = (*server)->backend();
  if (!(*server)->backend_fallback_reason().empty()) {
    spdlog::warn(
        "--backend=auto: serving on the CPU backend because the CUDA backend cannot "
        "run here: {}",
        (*server)->backend_fallback_reason());
  }
  absl::StatusOr<pagedattn::MemoryInfo> mem = backend.memory(0);
  // "listening on port N" first (scripts read the port of --listen=host:0 from it), then every
  // address as bound.
  const std::string bound = absl::StrJoin((*server)->listening(), ", ");
  spdlog::info(
      "pagedattn-server {} listening on {} ({}; --listen={}); backend {} on {} ({} device{}, "
      "{:.1f} of {:.1f} GiB free for pools{}); build has CUDA: {}; health SERVING",
      PAGEDATTN_VERSION,
      (*server)->port() != 0 ? absl::StrCat("port ", (*server)->port()) : std::string("a socket"),
      bound, options.listen, backend.name(), backend.device_name(), backend.device_count(),
      backend.device_count() == 1 ? "" : "s", mem.ok() ? mem->free_bytes / double(1 << 30) : 0.0,
      mem.ok() ? mem->total_bytes / double(1 << 30) : 0.0,
      options.limits.max_total_pool_bytes > 0
          ? absl::StrFormat(", at most %.1f GiB of them by --max_total_pool_gb",
                            options.limits.max_total_pool_bytes / double(1 << 30))
          : std::string(),
      pagedattn::BuiltWithCuda() ? "yes" : "no");
  if (backend.kind() == pagedattn::BackendKind::kCpu && mem.ok() && mem->free_bytes == 0) {
    // The CPU backend's pools and requests share host memory: pools get what requests leave.
    spdlog::warn(
        "no host memory is left for pools: requests in flight keep 2 x {} MiB of it (--request_"
        "memory_mb; 0 sizes it by --max_message_mb) and the host has {} MiB free; every "
        "CreateCache fails until memory frees or the server restarts with less",
        (*server)->request_memory_bytes() >> 20, pagedattn::HostMemory().free_bytes >> 20);
  }
  if (backend.kind() == pagedattn::BackendKind::kCuda) {
    std::vector<std::string> ccs;
    for (int d = 0; d < backend.device_count(); ++d) ccs.push_back(backend.compute_capability(d));
    const char* launches = !options.backend.graph_launch   ? "plain"
                           : options.backend.forward_graph ? "a Forward as two cached graphs"
                                                           : "each kernel through a cached graph";
    spdlog::info("CUDA: compute capability {}; kernels built as {}; prefill {}, launches {}",
                 absl::StrJoin(ccs, ", "), absl::StrJoin(pagedattn::BuiltCudaArchitectures(), " "),
                 AbslUnparseFlag(options.backend.prefill_kernel), launches);
  }
  spdlog::info(
      "limits: messages up to {} MiB; {} MiB for requests in flight; {} per tenant, {}; a "
      "Forward of up to {} tokens and {} spans; {} open files",
      options.max_message_bytes >> 20, (*server)->request_memory_bytes() >> 20,
      options.limits.max_caches_per_tenant > 0
          ? absl::StrCat(options.limits.max_caches_per_tenant,
                         options.limits.max_caches_per_tenant == 1 ? " cache" : " caches")
          : std::string("any number of caches"),
      options.cache_idle_timeout > absl::ZeroDuration()
          ? absl::StrCat("deleted once unused for ",
                         absl::ToInt64Seconds(options.cache_idle_timeout),
                         " s (--cache_idle_timeout_s)")
          : std::string("kept until deleted"),
      options.limits.forward.max_tokens, options.limits.forward.max_spans,
      open_files == RLIM_INFINITY ? std::string("unlimited") : absl::StrCat(open_files));
  if (open_files != 0 && open_files != RLIM_INFINITY && open_files < kFewOpenFiles) {
    spdlog::warn(
        "only {} open files (the hard limit): every connection takes one, and once they run out "
        "gRPC stops accepting calls until a restart; raise it (LimitNOFILE= in systemd, ulimit "
        "-Hn, or the container runtime's nofile) to at least {}",
        open_files, kFewOpenFiles);
  }
  if ((*server)->auth() != nullptr && !(*server)->tls()) {
    spdlog::warn(
        "bearer tokens travel in plaintext on this port: serve TLS (--tls_cert, "
        "--tls_key) unless the network path is private");
  }
  // The certificate is read at start only: once it expires every handshake fails, and those
  // failures are the callers' debug lines. Its date is in the log, and a warning comes early.
  const absl::Time cert_not_after = (*server)->tls_cert_not_after();
  if ((*server)->tls() && cert_not_after - absl::Now() < kCertificateWarning) {
    spdlog::warn(
        "the TLS certificate --tls_cert={} expires at {}, in {:.1f} days; it is read only at "
        "start: renew it and restart the server before then, or every handshake fails",
        options.tls_cert_file, pagedattn::TlsTimeText(cert_not_after),
        absl::ToDoubleHours(cert_not_after - absl::Now()) / 24);
  }
  spdlog::info(
      "security: {}; auth: {}; health port: {}; metrics: {}",
      (*server)->tls()
          ? absl::StrCat(options.tls_client_ca_file.empty() ? "TLS" : "mTLS",
                         " (certificate valid until ", pagedattn::TlsTimeText(cert_not_after), ")")
          : std::string("plaintext"),
      (*server)->auth() ? absl::StrCat((*server)->auth()->num_tokens(), " tokens, ",
                                       (*server)->auth()->num_tenants(), " tenants")
                        : std::string("off"),
      (*server)->health_port()
          ? absl::StrCat((*server)->health_port(), " on ", ListenHost(options.health_listen))
          : std::string("none"),
      (*server)->metrics_port() ? absl::StrCat("http port ", (*server)->metrics_port(), " on ",
                                               ListenHost(options.metrics_listen), " /metrics")
                                : std::string("off"));

  // A listener gRPC gave up on does not come back, nor does a GPU whose context a CUDA error
  // left unusable (every Forward would fail): health says NOT_SERVING for good, so that the
  // liveness probe (on the health port, which may still accept) restarts the process.
  // The same thread tells the counts of throttled lines whose kind has gone quiet.
  absl::Notification stopped;
  std::thread listener_watch([&] {
    bool broken = false;
    while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      if (!broken && grpc_listener_failed.load()) {
        broken = true;
        (*server)->MarkBroken(
            "gRPC stopped accepting connections on a listener (\"Failed accept4\" above; out of "
            "open files: raise the nofile limit)");
      }
      if (!broken) {
        if (const std::string why = (*server)->backend().Unrecoverable(); !why.empty()) {
          broken = true;
          (*server)->MarkBroken(why);
        }
      }
      pagedattn::FlushThrottledLog();
    }
  });
  std::thread signal_thread([&] {
    int sig = 0;
    while (sigwait(&signals, &sig) != 0 || sig == SIGHUP) {
      if (sig == SIGHUP) LogHangupIgnored();
      sig = 0;
    }
    const double grace = absl::GetFlag(FLAGS_shutdown_grace_s);
    spdlog::info(
        "received {}: health NOT_SERVING, refusing new calls, {} s to drain (calls in flight "
        "are stopped {} s before its end to unwind; a second signal stops them now)",
        sig == SIGTERM ? "SIGTERM" : "SIGINT", grace,
        absl::ToDoubleSeconds(pagedattn::PagedAttnServer::StopMargin(absl::Seconds(grace))));
    BoundTheExit(absl::Seconds(grace) + kForcedExitAfter);
    // A second signal during the grace period (Ctrl-C again) cuts it short.
    std::atomic<bool> shut_down{false};
    std::thread again([&] {
      const timespec tick{0, 100'000'000};
      while (!shut_down.load()) {
        if (const int s = sigtimedwait(&signals, nullptr, &tick); s == SIGHUP) {
          LogHangupIgnored();
        } else if (s > 0) {
          spdlog::warn(
              "received {} again: calls in flight are stopped now (a stopped call "
              "commits nothing)",
              s == SIGTERM ? "SIGTERM" : "SIGINT");
          (*server)->StopCallsNow();
          return;
        }
      }
    });
    (*server)->Shutdown(absl::Seconds(grace));
    shut_down = true;
    again.join();
  });
  (*server)->Wait();
  signal_thread.join();
  stopped.Notify();
  listener_watch.join();
  spdlog::info("pagedattn-server stopped");
  return 0;
}
