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

// Memory a parse is held to for each byte of its request: the worst of this server's requests
// takes 40 (CacheConfig's empty `layers` entries), an unknown field up to 32
// (tests/service/request_parse_test.cc measures each).
inline constexpr int64_t kParsedBytesPerRequestByte = 64;

// OK when gRPC delivered a request; RESOURCE_EXHAUSTED when it reset the call's stream before
// the request arrived whole, as it does when the requests in flight pass --request_memory_mb
// (it runs the handler anyway, with no message).
absl::Status CheckRequestArrived(const grpc::ByteBuffer& request);

// Holds kParsedBytesPerRequestByte x `bytes` of `budget` for the parse of a request of
// `method`: RESOURCE_EXHAUSTED when they do not fit now (retry), or never (a request too large
// for any parse this server allows; the error says how large one may be).
absl::StatusOr<ByteBudget::Hold> HoldForParse(ByteBudget& budget, absl::string_view method,
                                              size_t bytes);

// Parses `request` into *out: INVALID_ARGUMENT naming the method when protobuf cannot.
absl::Status ParseRequest(const grpc::ByteBuffer& request, absl::string_view method,
                          google::protobuf::MessageLite* out);

// The bytes of an answer.
absl::StatusOr<grpc::ByteBuffer> SerializeResponse(const google::protobuf::MessageLite& response);

}  // namespace pagedattn
