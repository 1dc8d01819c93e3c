// Control requests as bytes: arrived, held for, parsed; answers serialized.
#include "server/service/request_parse.h"

#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/core/error_info.h"

namespace pagedattn {

absl::Status CheckRequestArrived(const grpc::ByteBuffer& request) {
  if (request.Valid()) return absl::OkStatus();
  // The client was told RESOURCE_EXHAUSTED; the operator needs to see that, not a bad request.
  return absl::ResourceExhaustedError(
      "the request did not arrive whole: gRPC reset the call's stream (as it does when the "
      "requests in flight pass --request_memory_mb); retry");
}

int64_t MaxParsedRequestBytes(const ByteBudget& budget) {
  return std::max(kAlwaysParsedRequestBytes, budget.limit() / (4 * kParsedBytesPerRequestByte));
}

absl::StatusOr<ByteBudget::Hold> HoldForParse(ByteBudget& budget, absl::string_view method,
                                              size_t bytes) {
  const int64_t max_bytes = MaxParsedRequestBytes(budget);
  if (static_cast<int64_t>(bytes) > max_bytes) {
    return WithErrorInfo(
        absl::ResourceExhaustedError(absl::StrCat(
            "a ", method, " request of ", bytes, " bytes is larger than this server parses: ",
            "requests of methods other than Forward and Step are held to ",
            kParsedBytesPerRequestByte, " times their bytes while they run, one at most a ",
            "quarter of --request_memory_mb (", budget.limit(), " bytes): up to ", max_bytes,
            " bytes")),
        {"REQUEST_TOO_LARGE",
         {{"request_bytes", static_cast<int64_t>(bytes)}, {"max_request_bytes", max_bytes}}});
  }
  if (static_cast<int64_t>(bytes) <= kUnheldRequestBytes) return ByteBudget::Hold();
  const int64_t needed = static_cast<int64_t>(bytes) * kParsedBytesPerRequestByte;
  std::optional<ByteBudget::Hold> hold = budget.TryHold(needed);
  if (hold.has_value()) return *std::move(hold);
  return WithErrorInfo(
      absl::ResourceExhaustedError(absl::StrCat(
          "the server is busy: ", budget.used(), " bytes of request memory are in use (Forward ",
          "data and requests being parsed), this ", method, " request needs ", needed,
          " more and the budget is ", budget.limit(), " (--request_memory_mb); retry shortly")),
      {"SERVER_BUSY",
       {{"bytes_in_flight", budget.used()},
        {"bytes_needed", needed},
        {"budget_bytes", budget.limit()}}});
}

absl::Status CheckRequestSize(const grpc::ByteBuffer& request, absl::string_view what,
                              size_t max_bytes) {
  if (request.Length() <= max_bytes) return absl::OkStatus();
  return WithErrorInfo(absl::ResourceExhaustedError(absl::StrCat(
                           "a ", what, ": at most ", max_bytes, " bytes, got ", request.Length())),
                       {"REQUEST_TOO_LARGE",
                        {{"request_bytes", static_cast<int64_t>(request.Length())},
                         {"max_request_bytes", static_cast<int64_t>(max_bytes)}}});
}

absl::Status ParseRequest(const grpc::ByteBuffer& request, absl::string_view method,
                          google::protobuf::MessageLite* out) {
  grpc::ByteBuffer bytes(request);  // shares the slices: the reader consumes its own handle
  grpc::ProtoBufferReader reader(&bytes);
  if (!reader.status().ok() || !out->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request's bytes are not a valid ", out->GetTypeName(), " (the request of ", method,
        "): protobuf could not parse them (a string field that is not UTF-8, a truncated or "
        "corrupt message, or one nested too deeply)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<grpc::ByteBuffer> SerializeResponse(const google::protobuf::MessageLite& response) {
  grpc::ByteBuffer out;
  bool own = false;
  const grpc::Status s =
      grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(response, &out, &own);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("the answer (", response.GetTypeName(), ") could not be serialized"));
  }
  return out;
}

}  // namespace pagedattn
