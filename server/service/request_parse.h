// The requests of every method but Forward and Step (which read their own bytes: forward_wire)
// arrive as bytes and are parsed here, not by gRPC: so that a request's size is known before
// protobuf allocates anything for it. A parsed message can take tens of times its bytes (an
// empty entry of a repeated message field is 2 bytes on the wire and an object parsed, an
// unknown field likewise), so the memory a parse may take is held from the server's request
// budget first, and a request it cannot fit is refused unparsed.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "server/service/rpc_gate.h"

namespace pagedattn {

// Memory a request is held to for each of its bytes while its call runs: half for protobuf's
// parse (the worst of this server's requests takes 40: CacheConfig's empty `layers` entries; an
// unknown field up to 33), half for what its handler builds from it (the core's copy of a
// config's layers, 20 more). tests/service/hardening_test.cc measures each request.
inline constexpr int64_t kParsedBytesPerRequestByte = 128;
// Requests up to this size hold nothing: ListCaches, GetCache, DeleteCache and their like, whose
// parse takes at most half a MiB, so that Forward data filling the budget never refuses them
// (control calls run 16 at a time: server.cc).
inline constexpr int64_t kUnheldRequestBytes = 4 << 10;
// Requests up to this size are always parsed, alone if the budget is smaller than their hold
// (as one Forward always runs): a valid config is a few hundred KiB at most (4096 layers of
// sinks), and the smallest --request_memory_mb must not refuse it.
inline constexpr int64_t kAlwaysParsedRequestBytes = 1 << 20;

// The largest request (other than Forward's and Step's) a budget lets the server parse: one that
// holds a quarter of it, or kAlwaysParsedRequestBytes.
int64_t MaxParsedRequestBytes(const ByteBudget& budget);

// OK when gRPC delivered a request; RESOURCE_EXHAUSTED when it reset the call's stream before
// the request arrived whole, as it does when the requests in flight pass --request_memory_mb
// (it runs the handler anyway, with no message).
absl::Status CheckRequestArrived(const grpc::ByteBuffer& request);

// Holds kParsedBytesPerRequestByte x `bytes` of `budget` for the call of a request of `method`
// (nothing up to kUnheldRequestBytes):
// RESOURCE_EXHAUSTED when they do not fit now (SERVER_BUSY: retry), or never (REQUEST_TOO_LARGE:
// past MaxParsedRequestBytes; the error says how large one may be).
absl::StatusOr<ByteBudget::Hold> HoldForParse(ByteBudget& budget, absl::string_view method,
                                              size_t bytes);

// RESOURCE_EXHAUSTED (REQUEST_TOO_LARGE) when `request` is longer than max_bytes; `what` says
// what such a request holds ("health request names a service").
absl::Status CheckRequestSize(const grpc::ByteBuffer& request, absl::string_view what,
                              size_t max_bytes);

// Parses `request` into *out: INVALID_ARGUMENT naming the method when protobuf cannot.
absl::Status ParseRequest(const grpc::ByteBuffer& request, absl::string_view method,
                          google::protobuf::MessageLite* out);

// The bytes of an answer.
absl::StatusOr<grpc::ByteBuffer> SerializeResponse(const google::protobuf::MessageLite& response);

}  // namespace pagedattn
