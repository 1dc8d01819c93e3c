// ReflectionServiceImpl: grpc.reflection.v1alpha (what grpcurl asks a server), answered from
// the descriptors compiled into this binary. The server's own handler rather than gRPC's plugin
// so that a request is bounded before protobuf parses it: reflection needs no token, and a parse
// can take tens of times a request's bytes (request_parse.h).
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace pagedattn {

// The answer to one reflection request, from protobuf's generated descriptor pool; `services`
// are the names a list_services request gets.
grpc::reflection::v1alpha::ServerReflectionResponse AnswerReflection(
    const grpc::reflection::v1alpha::ServerReflectionRequest& request,
    const std::vector<std::string>& services);

class ReflectionServiceImpl final : public grpc::reflection::v1alpha::ServerReflection::
                                        WithRawCallbackMethod_ServerReflectionInfo<
                                            grpc::reflection::v1alpha::ServerReflection::Service> {
 public:
  // A request names a file or a symbol: past this it is refused unparsed (RESOURCE_EXHAUSTED,
  // which ends the stream).
  static constexpr size_t kMaxRequestBytes = 16 << 10;
  // Streams open at once beyond this are refused with RESOURCE_EXHAUSTED: reflection needs no
  // token (as health's Watch streams, HealthServiceImpl::kMaxWatchers).
  static constexpr size_t kMaxStreams = 256;

  // services: the fully qualified names of the services of the server it is registered on
  // (this one's included).
  explicit ReflectionServiceImpl(std::vector<std::string> services)
      : services_(std::move(services)) {}

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ServerReflectionInfo(
      grpc::CallbackServerContext* ctx) override;

 private:
  class Stream;  // reflection.cc

  const std::vector<std::string> services_;
  std::atomic<int> streams_{0};  // open streams, refused ones included until they are done
};

}  // namespace pagedattn
