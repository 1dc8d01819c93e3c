// The Forward data path's edges: a received ForwardRequest's bytes parsed where they lie (no
// protobuf copy of the tensors), and the answer built around the result's own buffers (no
// serializing copy). Used by unary Forward and by the Step stream.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/wire.h"
#include "server/core/cache.h"

namespace pagedattn {

// A ForwardRequest as received: the parsed fields and the chunks its tensors point into.
struct ReceivedForward {
  std::vector<grpc::Slice> chunks;  // keep the bytes the pieces point into alive
  wire::ForwardRequestRef request;
  size_t bytes = 0;  // The message's size.
};

// INVALID_ARGUMENT naming what is wrong when the bytes are not a ForwardRequest.
absl::Status ParseForward(const grpc::ByteBuffer& buffer, ReceivedForward* out);

// The core's arguments. A tensor that arrived in one chunk is used where it lies; one spread
// over several chunks is gathered into *gathered (the one copy).
ForwardArgs ToForwardArgs(const wire::ForwardRequestRef& request, std::vector<char>* gathered);

// The answer's bytes: a ForwardResponse (step: false), or a StepResponse for `layer` with the
// timing (step: true). The result's buffers become the message's slices without a copy.
grpc::ByteBuffer EncodeResponse(ForwardResult&& result, bool step, int32_t layer,
                                int64_t server_micros, int64_t kernel_micros);
// A StepResponse that answers a layer with an error.
grpc::ByteBuffer EncodeStepError(int32_t layer, const grpc::Status& status);

}  // namespace pagedattn
