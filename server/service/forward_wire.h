// The Forward data path's edges: a received ForwardRequest's bytes parsed where they lie (no
// protobuf copy of the tensors), and the answer built around the result's own buffers (no
// serializing copy). Used by unary Forward and by the Step stream.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/wire.h"
#include "server/core/cache.h"

namespace pagedattn {

// A ForwardRequest as received: the parsed fields and the chunks its tensors point into.
struct ReceivedForward {
  // The message, where the reader keeps it (a Step layer's, which outlives its read): its
  // bytes are freed by the ByteBuffer, which gives gRPC's core the context it needs under
  // memory pressure; freed by the last grpc::Slice instead, from a thread that is not gRPC's,
  // they crashed the server there (a null ExecCtx in the resource quota's reclaimer).
  // Declared first, so destroyed after the chunks' references.
  grpc::ByteBuffer buffer;
  std::vector<grpc::Slice> chunks;  // keep the bytes the pieces point into alive
  wire::ForwardRequestRef request;
  size_t bytes = 0;  // The message's size.
};

// INVALID_ARGUMENT naming what is wrong when the bytes are not a ForwardRequest, or hold more
// than max_spans spans (refused as they are read: see wire::ParseLimits); RESOURCE_EXHAUSTED when
// there is no message (gRPC reset the stream before it arrived).
absl::Status ParseForward(const grpc::ByteBuffer& buffer, int64_t max_spans,
                          ReceivedForward* out);

// Whether any of the request's tensors names a device buffer (RegisterMemory).
bool HasDeviceTensors(const wire::ForwardRequestRef& request);

// Bytes of the request's q, and of its k (= v's).
size_t QBytes(const wire::ForwardRequestRef& request);
size_t KvBytes(const wire::ForwardRequestRef& request);

// The core's arguments, with q, k and v copied from the request's chunks into the backend's
// buffers (the one host copy of the inputs; on the CUDA backend the upload reads them there).
// Without buffers: the tensors' dtypes, shapes and sizes only, to check the request. Device
// tensors (HasDeviceTensors) come with dtypes, shapes and sizes only: their addresses are the
// caller's to fill in (MemoryRegistry::Resolve).
ForwardArgs ToForwardArgs(const wire::ForwardRequestRef& request, ForwardBuffers* buffers);

// The answer's bytes: a ForwardResponse (step: false), or a StepResponse for `layer` with the
// timing (step: true). out and lse are slices of the buffers they lie in (no copy); the buffers
// go back to the backend when gRPC is done with the bytes.
grpc::ByteBuffer EncodeResponse(const ForwardResult& result,
                                std::shared_ptr<ForwardBuffers> buffers, bool step, int32_t layer,
                                int64_t server_micros, int64_t kernel_micros);
// The answer of a Forward with device tensors: out and lse named where they were written.
grpc::ByteBuffer EncodeDeviceResponse(const ForwardResult& result,
                                      const wire::ForwardRequestRef& request, bool step,
                                      int32_t layer, int64_t server_micros, int64_t kernel_micros);
// A StepResponse that answers a layer with an error.
grpc::ByteBuffer EncodeStepError(int32_t layer, const grpc::Status& status);

}  // namespace pagedattn
