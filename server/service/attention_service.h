// AttentionServiceImpl: thin gRPC handlers over the CacheManager. Every method takes its
// messages as bytes. Forward and the Step stream read theirs with common/wire (no protobuf copy
// of the tensors either way); the others go through Unary(), which does what every such call
// needs: refuse while shutting down, the caller's tenant from its token, the memory its parse
// may take held before protobuf parses it (request_parse.h), a stop token, metrics, one log
// line, status mapping; their bodies (Run*) take and fill parsed messages.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <memory>
#include <string>

#include "pagedattn/v1/attention.grpc.pb.h"
#include "server/core/cache_manager.h"
#include "server/core/memory_registry.h"
#include "server/core/stop_token.h"
#include "server/service/auth.h"
#include "server/service/executor.h"
#include "server/service/forward_wire.h"
#include "server/service/log_text.h"
#include "server/service/metrics.h"
#include "server/service/rpc_gate.h"
#include "server/service/serial_queues.h"

namespace pagedattn {

// What a handler body knows of its call.
class Rpc {
 public:
  Rpc(const char* method, grpc::ServerContextBase* ctx, const RpcGate* gate);
  // A call within a stream (a Step layer): the stream's peer, read as the stream began.
  Rpc(const char* method, grpc::ServerContextBase* ctx, const RpcGate* gate, std::string peer);
  const char* method() const { return method_; }
  const std::string& tenant() const { return tenant_; }
  void set_tenant(std::string tenant) { tenant_ = std::move(tenant); }
  // Stops when the caller cancels, its deadline passes, or shutdown's grace runs out.
  const StopToken& stop() const { return stop_; }
  // The cache the call names, for the log line (escaped and shortened: it is request data).
  void set_cache(absl::string_view cache_id);
  const std::string& cache() const { return cache_; }
  // Who called, for a log line: "[tenant=T ]peer=P[ req=R]". R is the call's x-request-id
  // metadata, escaped and shortened like all request text: the one metadata key ever logged, so
  // that an orchestrator's failed call can be found in this server's log.
  std::string Caller() const;
  // The caller's address as the call (or its stream) began: gRPC's peer() says "unknown" once
  // the transport of a dropped or drained call is gone, as a stream's end is logged. Read for
  // every call (a copy of a short string, next to a Forward's hundreds of microseconds).
  const std::string& peer() const { return peer_; }
  grpc::ServerContextBase* context() const { return ctx_; }
  double seconds() const;
  // The call's way to its cache (a release or truncate: from its arrival to its lookup).
  void set_arrival(CacheManager::Arrival arrival) { arrival_ = std::move(arrival); }
  CacheManager::Arrival& arrival() { return arrival_; }

 private:
  const char* method_;
  grpc::ServerContextBase* ctx_;
  std::string peer_;
  std::string tenant_;
  StopToken stop_;
  std::string cache_ = "-";
  std::chrono::steady_clock::time_point start_;
  CacheManager::Arrival arrival_;
};

// One layer of a Forward as the service runs it (unary Forward, or one message of a Step): the
// result, the backend buffers its answer lies in, and where the time went.
struct ForwardAnswer {
  ForwardResult result;
  std::shared_ptr<ForwardBuffers> buffers;
  ForwardTimings timings;
  double stage_in_us = 0;  // copying the request's tensors into the buffers
  // Device tensors: out and lse were written where the request said (no buffers).
  bool device_tensors = false;
};

// AttentionService with every method's messages as bytes.
using RawAttentionService = v1::AttentionService::WithRawCallbackMethod_GetServerInfo<
    v1::AttentionService::WithRawCallbackMethod_ValidateCacheConfig<
        v1::AttentionService::WithRawCallbackMethod_CreateCache<
            v1::AttentionService::WithRawCallbackMethod_GetCache<
                v1::AttentionService::WithRawCallbackMethod_ListCaches<
                    v1::AttentionService::WithRawCallbackMethod_DeleteCache<
                        v1::AttentionService::WithRawCallbackMethod_Forward<
                            v1::AttentionService::WithRawCallbackMethod_ReleaseSequences<
                                v1::AttentionService::WithRawCallbackMethod_TruncateSequences<
                                    v1::AttentionService::WithRawCallbackMethod_Step<
                                        v1::AttentionService::WithRawCallbackMethod_RegisterMemory<
                                            v1::AttentionService::
                                                WithRawCallbackMethod_UnregisterMemory<
                                                    v1::AttentionService::Service>>>>>>>>>>>>;

// Where a call on a cache waits its turn (SerialQueues): the group of the tenant's cache (as the
// call names it), and the key of one of its layers (Forwards, Step layers, truncations), or of
// the whole cache (releases, which wait for its layers' calls); the tenant owns it.
QueueSlot LayerQueue(absl::string_view tenant, absl::string_view cache_id, int32_t layer);
QueueSlot CacheQueue(absl::string_view tenant, absl::string_view cache_id);

class AttentionServiceImpl final : public RawAttentionService {
 public:
  // Messages of one Step stream read ahead of its answers written: each is queued for its layer
  // as it is read, and layers of the stream run at once where their turns come.
  static constexpr int kStepMessagesAhead = 8;

  // auth: null means no token auth (every caller is tenant ""). metrics: may be null.
  // gate: the server's calls in flight. budget: bytes of requests in flight (Forward data, the
  // other methods' requests). layer_queues (over executor): runs what works on one layer of a
  // cache (Forwards, Step layers, truncations; a cache's releases), each layer's in turn, so
  // that calls waiting for a layer hold no thread; those calls are parsed and queued as they
  // arrive (on gRPC's callback thread), so each runs after the calls on its layer or cache that
  // came before it. control_executor: the other unary calls. forward_here: a unary Forward runs
  // on the callback thread it arrived on when its layer is free (a CUDA Forward's
  // milliseconds); else on executor's threads (the CPU backend's, up to seconds). regions: the
  // memory clients registered (RegisterMemory).
  AttentionServiceImpl(CacheManager* manager, MemoryRegistry* regions,
                       const TokenAuthenticator* auth, Metrics* metrics, RpcGate* gate,
                       ByteBudget* budget, Executor* executor, SerialQueues* layer_queues,
                       Executor* control_executor, bool forward_here)
      : manager_(manager),
        regions_(regions),
        auth_(auth),
        metrics_(metrics),
        gate_(gate),
        budget_(budget),
        executor_(executor),
        layer_queues_(layer_queues),
        control_executor_(control_executor),
        forward_here_(forward_here) {}

  using Reactor = grpc::ServerUnaryReactor;
  using Bytes = grpc::ByteBuffer;
  // The unary methods but Forward: Unary() with their bodies (Run*).
  Reactor* GetServerInfo(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  Reactor* ValidateCacheConfig(grpc::CallbackServerContext* ctx, const Bytes* req,
                               Bytes* resp) override;
  Reactor* CreateCache(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  Reactor* GetCache(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  Reactor* ListCaches(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  Reactor* DeleteCache(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  Reactor* ReleaseSequences(grpc::CallbackServerContext* ctx, const Bytes* req,
                            Bytes* resp) override;
  Reactor* TruncateSequences(grpc::CallbackServerContext* ctx, const Bytes* req,
                             Bytes* resp) override;
  Reactor* RegisterMemory(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  Reactor* UnregisterMemory(grpc::CallbackServerContext* ctx, const Bytes* req,
                            Bytes* resp) override;
  Reactor* Forward(grpc::CallbackServerContext* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerBidiReactor<Bytes, Bytes>* Step(grpc::CallbackServerContext* ctx) override;

 private:
  class StepReactor;    // attention_service.cc
  class UnaryReactor;   // attention_service.cc
  struct UnaryForward;  // attention_service.cc

  // A unary method other than Forward: its request parsed (once the caller is authenticated and
  // the memory the parse may take is held) and given to body, whose answer is sent; with the
  // preamble and epilogue every call shares. queue, when given: body runs in the request's turn
  // on layer_queues_ (see LayerQueue).
  template <typename Request, typename Response>
  Reactor* Unary(const char* method, grpc::CallbackServerContext* ctx, const Bytes* req,
                 Bytes* resp,
                 absl::Status (AttentionServiceImpl::*body)(Rpc&, const Request&, Response*),
                 QueueSlot (*queue)(const Request&, const std::string& tenant) = nullptr);
  // The bodies of those methods.
  absl::Status RunGetServerInfo(Rpc& rpc, const v1::GetServerInfoRequest& req,
                                v1::ServerInfo* resp);
  absl::Status RunValidateCacheConfig(Rpc& rpc, const v1::CacheConfig& req,
                                      v1::ValidateCacheConfigResponse* resp);
  absl::Status RunCreateCache(Rpc& rpc, const v1::CreateCacheRequest& req, v1::CacheInfo* resp);
  absl::Status RunGetCache(Rpc& rpc, const v1::GetCacheRequest& req, v1::CacheInfo* resp);
  absl::Status RunListCaches(Rpc& rpc, const v1::ListCachesRequest& req,
                             v1::ListCachesResponse* resp);
  absl::Status RunDeleteCache(Rpc& rpc, const v1::DeleteCacheRequest& req,
                              v1::DeleteCacheResponse* resp);
  absl::Status RunReleaseSequences(Rpc& rpc, const v1::ReleaseSequencesRequest& req,
                                   v1::ReleaseSequencesResponse* resp);
  absl::Status RunTruncateSequences(Rpc& rpc, const v1::TruncateSequencesRequest& req,
                                    v1::TruncateSequencesResponse* resp);
  absl::Status RunRegisterMemory(Rpc& rpc, const v1::RegisterMemoryRequest& req,
                                 v1::MemoryRegion* resp);
  absl::Status RunUnregisterMemory(Rpc& rpc, const v1::UnregisterMemoryRequest& req,
                                   v1::UnregisterMemoryResponse* resp);
  // The caller's tenant into rpc (with token auth), or UNAUTHENTICATED.
  absl::Status Authenticate(Rpc& rpc, const grpc::ServerContextBase& ctx);
  // Counts the call in the metrics, logs one line, maps the status.
  grpc::Status Finish(const Rpc& rpc, const absl::Status& status);
  // A unary Forward after the gate and its authentication, as it arrives: its parse, then its
  // turn on its layer (layer_queues_), where RunForwardCall runs it.
  void StartForwardCall(std::shared_ptr<UnaryForward> call);
  // RunForward, encode, Finish on the call's reactor.
  void RunForwardCall(UnaryForward& call);
  // One Forward of received bytes (unary Forward, or one message of a Step stream): the cache,
  // the byte budget, the core.
  absl::StatusOr<ForwardAnswer> RunForward(Rpc& rpc, const std::string& cache_id,
                                           const wire::ForwardRequestRef& request,
                                           size_t request_bytes);
  // RunForward for device tensors: every region resolved and checked, then the core.
  absl::StatusOr<ForwardAnswer> RunDeviceForward(Rpc& rpc, Cache& cache,
                                                 const wire::ForwardRequestRef& request,
                                                 ForwardArgs args);
  void RecordForward(const Rpc& rpc, const ForwardArgs& args);

  CacheManager* const manager_;
  MemoryRegistry* const regions_;
  const TokenAuthenticator* const auth_;
  Metrics* const metrics_;
  RpcGate* const gate_;
  ByteBudget* const budget_;
  Executor* const executor_;
  SerialQueues* const layer_queues_;
  Executor* const control_executor_;
  const bool forward_here_;
};

// The capability table of a backend, as sent in ServerInfo.
void FillCapabilities(BackendKind backend, v1::Capabilities* out);

}  // namespace pagedattn
