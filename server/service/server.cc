// Server assembly: backend, cache manager, auth, metrics, the gRPC service with health and
// reflection, the optional plaintext health port and the metrics HTTP endpoint; and shutdown.
#include "server/service/server.h"

#include <google/protobuf/descriptor.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/transport.h"
#include "server/core/host_memory.h"
#include "server/service/address.h"
#include "server/service/log_text.h"
#include "server/service/throttled_log.h"
#include "server/service/tls.h"
#include "spdlog/spdlog.h"

namespace pagedattn {
namespace {

// Control calls (the unary methods but Forward) run at once; more wait their turn. CreateCaches
// take turns on the manager's lock anyway; the others are quick, and one slow call leaves them
// fifteen threads.
constexpr int kControlThreads = 16;
// The threads of the calls on a cache's layers (Forwards and their parse on the CPU backend, Step
// layers, truncations, releases), at least: those of one layer wait their turn holding none
// (SerialQueues), so these serve every other cache and layer; on the CPU backend the calls then
// take turns on its compute threads.
constexpr int kLayerThreads = 16;

// What gRPC's resource quota holds past --request_memory_mb (Start: a message's framing and read
// buffers).
constexpr int64_t kTransportQuotaSlackBytes = kMaxReadChunkBytes;

// AttentionService's method of a call's path ("/pagedattn.v1.AttentionService/Forward" ->
// "Forward", as the handlers count it), or "" for any other path.
absl::string_view MethodOfPath(absl::string_view path) {
  static const google::protobuf::ServiceDescriptor* const service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::AttentionService::service_full_name());
  absl::string_view method = path;
  if (service == nullptr || !absl::ConsumePrefix(&method, "/") ||
      !absl::ConsumePrefix(&method, service->full_name()) || !absl::ConsumePrefix(&method, "/") ||
      service->FindMethodByName(std::string(method)) == nullptr) {
    return "";
  }
  return method;
}

// The main ports' credentials; with TLS, *cert_not_after is when the certificate expires.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MainCredentials(
    const ServerOptions& o, absl::Time* cert_not_after) {
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (o.tls_cert_file.empty()) {
    if (!o.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<TlsMaterial> tls =
      LoadTlsMaterial({o.tls_cert_file, o.tls_key_file, o.tls_client_ca_file});
  if (!tls.ok()) return tls.status();
  *cert_not_after = tls->cert_not_after;
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({tls->key_pem, tls->cert_pem});
  if (!o.tls_client_ca_file.empty()) {
    ssl.pem_root_certs = tls->client_ca_pem;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// Every gRPC port: one process per port (no SO_REUSEPORT: a second server on a busy port must
// fail to start, not take half of the first one's connections).
// No compressed requests either: gRPC inflates one before any handler sees it, so that a 64 KiB
// gzip request took 69 MiB before its size could be checked (a health check, which needs no
// token). Refused as its headers arrive (UNIMPLEMENTED, naming the algorithm); the clients send
// plain bytes.
void CommonArguments(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
}

// The --health_listen port's answer to any method but health's and reflection's: UNIMPLEMENTED,
// saying where the service is (gRPC's own answer has an empty message).
class HealthPortOthers final : public grpc::CallbackGenericService {
 public:
  explicit HealthPortOthers(std::string listening) : listening_(std::move(listening)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    class Refuse final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refuse(grpc::Status status) { Finish(std::move(status)); }
      void OnDone() override { delete this; }
    };
    return new Refuse(
        grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                     absl::StrCat(ForLog(ctx->method(), LogText::kField),
                                  ": this port (--health_listen) serves grpc.health.v1 and "
                                  "reflection only; the service listens on ",
                                  listening_)));
  }

 private:
  const std::string listening_;
};

// Whether a TCP address can be bound now, as gRPC binds it (SO_REUSEADDR): which of several
// --listen addresses stopped the server, which gRPC's builder does not say.
bool CanBind(const HostPort& address) {
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = absl::StrCat(address.port);
  if (getaddrinfo(address.host.empty() ? nullptr : address.host.c_str(), port.c_str(), &hints,
                  &found) != 0) {
    return false;
  }
  bool bindable = false;
  for (const addrinfo* a = found; a != nullptr && !bindable; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    bindable = bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
  }
  freeaddrinfo(found);
  return bindable;
}

}  // namespace

// A socket file left by a server that is gone is removed; one a live server answers on is in
// use (UNAVAILABLE, like a busy TCP port).
absl::Status ClearStaleSocket(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--listen=unix:", path, ": the path exists and is not a socket"));
  }
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=unix:", path, ": the path is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool live = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (fd >= 0) close(fd);
  if (live) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on --listen=unix:", path, " (a server answers on it)"));
  }
  unlink(path.c_str());
  return absl::OkStatus();
}

int64_t RequestMemoryDefault(int64_t max_message_bytes) {
  const int64_t quarter = HostMemory().total_bytes / 4;
  return std::max<int64_t>(64 << 20, std::min(quarter, 2 * max_message_bytes + (64 << 20)));
}

absl::StatusOr<std::unique_ptr<PagedAttnServer>> PagedAttnServer::Start(
    const ServerOptions& options) {
  std::unique_ptr<PagedAttnServer> s(new PagedAttnServer());
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      MainCredentials(options, &s->tls_cert_not_after_);
  if (!creds.ok()) return creds.status();
  s->tls_ = !options.tls_cert_file.empty();
  if (!options.auth_tokens_file.empty()) {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> auth =
        TokenAuthenticator::FromFile(options.auth_tokens_file);
    if (!auth.ok()) return auth.status();
    s->auth_ = *std::move(auth);
  }
  const int64_t request_memory = options.request_memory_bytes > 0
                                     ? options.request_memory_bytes
                                     : RequestMemoryDefault(options.max_message_bytes);
  BackendOptions backend_options = options.backend;
  // Pools must leave room for requests: gRPC's buffers and the Forward data budget.
  backend_options.cpu_reserved_bytes = 2 * request_memory;
  absl::StatusOr<CreatedBackend> backend = CreateBackend(backend_options);
  if (!backend.ok()) return backend.status();
  s->backend_ = std::move(backend->backend);
  s->backend_fallback_reason_ = std::move(backend->fallback_reason);
  CacheManagerLimits limits = options.limits;
  limits.forward.max_response_bytes = options.max_message_bytes;
  limits.cache_idle_timeout = options.cache_idle_timeout;
  s->manager_ = std::make_unique<CacheManager>(s->backend_.get(), limits);
  s->regions_ = std::make_unique<MemoryRegistry>(
      s->backend_.get(), options.memory, [](const RegionInfo& r, const std::string& why) {
        spdlog::info("released memory region {} of cache {} ({} bytes): {}", r.id, r.cache_id,
                     r.size_bytes, why);
      });
  s->metrics_ = std::make_unique<Metrics>(options.metrics_per_cache);
  if (s->tls_ && s->auth_ != nullptr) {
    (*creds)->SetAuthMetadataProcessor(std::make_shared<TokenAuthProcessor>(
        s->auth_.get(),
        [metrics = s->metrics_.get()](absl::string_view path, const absl::Status& status,
                                      absl::string_view who) {
          // Counted under the method's name where it is one of AttentionService's (an unknown
          // path's name is the caller's to choose: no series for it).
          const absl::string_view method = MethodOfPath(path);
          if (!method.empty()) metrics->RecordRpc(std::string(method), status.code());
          // At most a line a second for each method and reason: the caller's address is not
          // known here, and a caller without a token must not flood the log.
          LogThrottled(
              spdlog::level::info,
              absl::StrCat("refused at headers ", method.empty() ? "?" : method, " ",
                           status.message()),
              absl::StrCat("rpc ", method.empty() ? absl::CHexEscape(path.substr(0, 64)) : method,
                           " refused as its headers arrived", who.empty() ? "" : " (", who,
                           who.empty() ? "" : ")", ": UNAUTHENTICATED: ", status.message()));
        }));
  }
  s->gate_ = std::make_unique<RpcGate>();
  s->budget_ = std::make_unique<ByteBudget>(request_memory);
  s->executor_ = std::make_unique<Executor>(
      std::max(kLayerThreads, static_cast<int>(std::thread::hardware_concurrency())));
  s->layer_queues_ = std::make_unique<SerialQueues>(s->executor_.get());
  s->control_executor_ = std::make_unique<Executor>(kControlThreads);
  // The CPU backend's Forwards (up to seconds each) leave gRPC's callback threads; a CUDA
  // Forward's milliseconds run where they arrive when their layer is free
  // (AttentionServiceImpl::Forward).
  s->service_ = std::make_unique<AttentionServiceImpl>(
      s->manager_.get(), s->regions_.get(), s->auth_.get(), s->metrics_.get(), s->gate_.get(),
      s->budget_.get(), s->executor_.get(), s->layer_queues_.get(), s->control_executor_.get(),
      /*forward_here=*/s->backend_->kind() != BackendKind::kCpu);
  // One health service answers on the main port and on the plaintext health port.
  s->health_ = std::make_unique<HealthServiceImpl>();
  const std::string health_name(grpc::health::v1::Health::service_full_name());
  const std::string reflection_name(
      grpc::reflection::v1alpha::ServerReflection::service_full_name());
  s->reflection_ = std::make_unique<ReflectionServiceImpl>(std::vector<std::string>{
      v1::AttentionService::service_full_name(), health_name, reflection_name});

  const int max_bytes = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
  absl::StatusOr<std::vector<ListenAddress>> addresses =
      ParseListenAddresses("--listen", options.listen);
  if (!addresses.ok()) return addresses.status();
  grpc::ServerBuilder builder;
  CommonArguments(builder);
  for (const auto& [name, value] : kTransportArgs) builder.AddChannelArgument(name, value);
  std::vector<int> bound(addresses->size(), 0);
  for (size_t i = 0; i < addresses->size(); ++i) {
    const ListenAddress& a = (*addresses)[i];
    if (a.unix_socket) {
      if (absl::Status st = ClearStaleSocket(a.path); !st.ok()) return st;
      builder.AddListeningPort("unix:" + a.path, *creds, &bound[i]);
    } else {
      builder.AddListeningPort(GrpcListenAddress(a.tcp), *creds, &bound[i]);
    }
  }
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->health_.get());
  builder.RegisterService(s->reflection_.get());
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  // The transport counts a socket read's buffer against its quota beside the message: with the
  // two flags equal (16 MiB), a quota of exactly --request_memory_mb reset 26 of 50 requests
  // from 4 MiB under --max_message_mb to 4 KiB under it, their clients told nothing but
  // RST_STREAM; a 1 MiB slack 15 of 40; a read's, 1 of 50 (at the limit, back to back).
  grpc::ResourceQuota quota("pagedattn");
  quota.Resize(static_cast<size_t>(request_memory + kTransportQuotaSlackBytes));
  builder.SetResourceQuota(quota);
  s->server_ = builder.BuildAndStart();
  auto could_not_listen = [](const ListenAddress& a) {
    return absl::UnavailableError(absl::StrCat(
        "could not listen on --listen=", a.text,
        a.unix_socket ? " (is its directory there and writable?)"
                      : " (in use by another process? see `ss -ltnp`; or not an address of this "
                        "host)"));
  };
  if (s->server_ == nullptr) {
    // No address is marked bound then: the one to name is the first that cannot be bound now.
    for (const ListenAddress& a : *addresses) {
      if (!a.unix_socket && !CanBind(a.tcp)) return could_not_listen(a);
    }
    return could_not_listen(addresses->front());
  }
  for (size_t i = 0; i < addresses->size(); ++i) {
    const ListenAddress& a = (*addresses)[i];
    if (bound[i] == 0) {
      s->server_->Shutdown();
      return could_not_listen(a);
    }
    if (a.unix_socket) {
      // Who may connect is who may open the file: the mode, not the umask, decides it.
      if (chmod(a.path.c_str(), static_cast<mode_t>(options.unix_socket_mode)) != 0) {
        s->server_->Shutdown();
        return absl::PermissionDeniedError(
            absl::StrCat("chmod of the socket ", a.path, ": ", std::strerror(errno)));
      }
      s->unix_sockets_.push_back(a.path);
      s->listening_.push_back("unix:" + a.path);
    } else {
      if (s->port_ == 0) s->port_ = bound[i];
      s->listening_.push_back(FormatHostPort({a.tcp.host, bound[i]}));
    }
  }
  if (!options.health_listen.empty()) {
    // Kubernetes gRPC probes cannot speak TLS: health (and reflection) alone, in plaintext.
    absl::StatusOr<HostPort> health = ParseHostPort("--health_listen", options.health_listen);
    if (!health.ok()) {
      s->server_->Shutdown();
      return health.status();
    }
    grpc::ServerBuilder hb;
    CommonArguments(hb);
    hb.AddListeningPort(GrpcListenAddress(*health), grpc::InsecureServerCredentials(),
                        &s->health_port_);
    hb.RegisterService(s->health_.get());
    s->health_port_reflection_ = std::make_unique<ReflectionServiceImpl>(
        std::vector<std::string>{health_name, reflection_name});
    hb.RegisterService(s->health_port_reflection_.get());
    s->health_port_others_ = std::make_unique<HealthPortOthers>(absl::StrJoin(s->listening_, ", "));
    hb.RegisterCallbackGenericService(s->health_port_others_.get());
    s->health_server_ = hb.BuildAndStart();
    if (s->health_server_ == nullptr || s->health_port_ == 0) {
      s->server_->Shutdown();
      return absl::UnavailableError(absl::StrCat(
          "could not listen on --health_listen=", options.health_listen,
          " (in use by another process? see `ss -ltnp`; or not an address of this host)"));
    }
  }
  if (!options.metrics_listen.empty()) {
    const Metrics* metrics = s->metrics_.get();
    const CacheManager* manager = s->manager_.get();
    absl::StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Start(
        options.metrics_listen, "/metrics", "text/plain; version=0.0.4; charset=utf-8",
        [metrics, manager] { return metrics->Render(*manager); });
    if (!http.ok()) {
      s->server_->Shutdown();
      if (s->health_server_) s->health_server_->Shutdown();
      return http.status();
    }
    s->metrics_http_ = *std::move(http);
  }
  s->health_->SetServing(true);
  s->started_ = true;
  if (options.cache_idle_timeout > absl::ZeroDuration()) {
    // A cache goes at most a quarter of its timeout (and a second) past it.
    const absl::Duration every =
        std::clamp(options.cache_idle_timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
    s->idle_sweep_ =
        std::make_unique<PeriodicTask>(every, [server = s.get()] { server->DeleteIdleCaches(); });
  }
  return s;
}

PagedAttnServer::~PagedAttnServer() {
  Shutdown(absl::Seconds(1));
  Wait();
}

void PagedAttnServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_ || server_ == nullptr) return;
    shut_down_ = true;
  }
  if (!started_) {
    // Start failed part-way (a port in use): nothing was served, so there is nothing to drain
    // or to log before its error.
    const auto now = absl::ToChronoTime(absl::Now());
    server_->Shutdown(now);
    if (health_server_) health_server_->Shutdown(now);
    return;
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + std::max(grace, absl::ZeroDuration());
  health_->SetServing(false);
  gate_->StartDraining();
  const std::vector<std::shared_ptr<Cache>> caches = manager_->ListAll();
  int64_t pool_bytes = 0;
  for (const auto& cache : caches) pool_bytes += cache->geometry().TotalBytes();
  // Step streams waiting for the next message of their open step (an orchestrator between two
  // layers) are named apart: they hold the grace period, as a call does, but have nothing to
  // stop, and end with the connections as soon as the calls that do have stopped.
  auto waiting_streams = [](int64_t n) {
    return absl::StrCat(n, " Step stream", n == 1 ? "" : "s", " waiting for ",
                        n == 1 ? "its" : "their", " next message");
  };
  auto of_them_waiting = [&](int64_t waiting) {
    return waiting > 0 ? absl::StrCat(" (", waiting_streams(waiting), ")") : std::string();
  };
  const int64_t in_flight = gate_->in_flight();
  spdlog::info(
      "draining: {} call{} in flight{}; {} cache{} ({} bytes of pools) go with the process",
      in_flight, in_flight == 1 ? "" : "s", of_them_waiting(gate_->waiting()), caches.size(),
      caches.size() == 1 ? "" : "s", pool_bytes);
  // Calls in flight get the grace period less a margin; then they are told to stop and get the
  // margin to unwind (a CPU Forward stops between work items, a CUDA one before its kernels).
  // StopCallsNow (a second signal) ends the wait at once.
  const absl::Duration margin = StopMargin(grace);
  const bool drained = gate_->WaitIdle(deadline - margin);
  if (!drained || gate_->stopping()) {
    const int64_t left = gate_->in_flight(), waiting = gate_->waiting();
    if (gate_->stopping()) {
      spdlog::info("calls in flight stopped (a second signal) {} into the grace period",
                   absl::FormatDuration(absl::Now() - start));
    } else {
      spdlog::warn(
          "the grace period ran out with {} call{} in flight{}: stopping them (a stopped "
          "call commits nothing and answers UNAVAILABLE)",
          left, left == 1 ? "" : "s", of_them_waiting(waiting));
    }
    gate_->StopAll();
    if (!gate_->WaitIdle(deadline, /*but_waiting=*/true)) {
      const int64_t stuck = gate_->busy();
      spdlog::warn("{} call{} did not stop in time: cancelled with the connections", stuck,
                   stuck == 1 ? "" : "s");
    }
    if (const int64_t waiting = gate_->waiting(); waiting > 0) {
      spdlog::info("{}: ended with the connections", waiting_streams(waiting));
    }
  } else {
    spdlog::info("drained in {}", absl::FormatDuration(absl::Now() - start));
  }
  // Whatever is still open (Watch streams, idle connections, a call that did not stop) is
  // cancelled now rather than at the end of another wait.
  const auto now = absl::ToChronoTime(absl::Now());
  server_->Shutdown(now);
  if (health_server_) health_server_->Shutdown(now);
}

void PagedAttnServer::StopCallsNow() { gate_->StopAll(); }

void PagedAttnServer::MarkBroken(const std::string& why) {
  spdlog::error("health NOT_SERVING for good: {}; restart the process", why);
  health_->SetServing(false);
}

void PagedAttnServer::DeleteIdleCaches() {
  const absl::Duration timeout = manager_->limits().cache_idle_timeout;
  if (timeout <= absl::ZeroDuration()) return;
  for (const IdleCache& c : manager_->DeleteIdle(std::chrono::steady_clock::now(), timeout)) {
    const int64_t regions = regions_->ReleaseCache(c.id);
    metrics_->RecordIdleCacheDeleted();
    spdlog::warn(
        "deleted cache {} ('{}'{}): unused for {:.0f} s, past --cache_idle_timeout_s={:.0f} (no "
        "Forward, release or truncate); {} bytes freed{}",
        c.id, ForLog(c.name, LogText::kQuoted),
        c.owner.empty() ? "" : absl::StrCat(", tenant ", c.owner), absl::ToDoubleSeconds(c.idle),
        absl::ToDoubleSeconds(timeout), c.bytes,
        regions > 0 ? absl::StrCat(", ", regions, " memory regions released") : "");
  }
}

void PagedAttnServer::Wait() {
  if (server_ != nullptr) server_->Wait();
  if (health_server_ != nullptr) health_server_->Wait();
  for (const std::string& path : unix_sockets_) unlink(path.c_str());
  unix_sockets_.clear();
}

}  // namespace pagedattn
