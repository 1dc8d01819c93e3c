// HealthServiceImpl: grpc.health.v1 for the whole server ("") and for
// pagedattn.v1.AttentionService, shared by the main port and the plaintext health port.
// Callback API: an open Watch stream holds no thread, and the streams at once are bounded.
// Requests arrive as bytes, refused unparsed past kMaxRequestBytes: health needs no token, and
// protobuf's parse of a request can take tens of times its bytes (request_parse.h).
#pragma once

#include <cstddef>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace pagedattn {

using RawHealthService = grpc::health::v1::Health::WithRawCallbackMethod_Check<
    grpc::health::v1::Health::WithRawCallbackMethod_Watch<grpc::health::v1::Health::Service>>;

class HealthServiceImpl final : public RawHealthService {
 public:
  // A request names a service (ours are "" and "pagedattn.v1.AttentionService").
  static constexpr size_t kMaxRequestBytes = 1024;
  // Watch streams open at once beyond this are refused with RESOURCE_EXHAUSTED: health needs no
  // token, so an unauthenticated caller must not be able to hold unbounded server state.
  static constexpr size_t kMaxWatchers = 256;

  ~HealthServiceImpl() override;

  void SetServing(bool serving);
  bool serving() const;

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override;
  // Sends the status now and on every change until the call ends.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Watch(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req) override;

  class Watcher;

 private:
  void Remove(Watcher* w);

  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
