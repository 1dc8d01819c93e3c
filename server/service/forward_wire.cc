// ParseForward / ToForwardArgs / EncodeResponse: common/wire over gRPC's byte buffers.
#include "server/service/forward_wire.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "google/rpc/status.pb.h"

namespace pagedattn {
namespace {

TensorView ViewOf(const wire::TensorRef& t, std::vector<char>* gathered) {
  TensorView v;
  if (!t.present) return v;
  v.dtype = static_cast<DType>(t.dtype);
  v.shape = t.shape;
  v.size_bytes = t.data_size;
  if (t.data.size() == 1) {
    v.data = t.data[0].data;
  } else if (t.data_size > 0) {
    // The caller reserved room for every gathered tensor: this never reallocates, so the views
    // already taken stay valid.
    const size_t at = gathered->size();
    gathered->resize(at + t.data_size);
    t.CopyTo(gathered->data() + at);
    v.data = gathered->data() + at;
  }
  return v;
}

// A slice that owns a string (moved in, freed when gRPC is done with the bytes).
grpc::Slice OwningSlice(std::string&& bytes) {
  auto* owned = new std::string(std::move(bytes));
  return grpc::Slice(
      owned->data(), owned->size(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
}

}  // namespace

absl::Status ParseForward(const grpc::ByteBuffer& buffer, ReceivedForward* out) {
  if (!buffer.Dump(&out->chunks).ok()) {
    return absl::InvalidArgumentError("the request's bytes could not be read");
  }
  std::vector<wire::Piece> pieces;
  pieces.reserve(out->chunks.size());
  for (const grpc::Slice& s : out->chunks) {
    pieces.push_back({reinterpret_cast<const char*>(s.begin()), s.size()});
    out->bytes += s.size();
  }
  std::string error;
  if (!wire::ParseForwardRequest(pieces, &out->request, &error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a pagedattn.v1.ForwardRequest: ", error));
  }
  return absl::OkStatus();
}

ForwardArgs ToForwardArgs(const wire::ForwardRequestRef& r, std::vector<char>* gathered) {
  ForwardArgs a;
  a.layer = r.layer;
  a.spans.reserve(r.spans.size());
  for (const wire::SpanRef& s : r.spans) {
    a.spans.push_back({s.seq_id, s.start, s.num_new_tokens, s.num_queries});
  }
  gathered->clear();
  size_t gathered_bytes = 0;
  for (const wire::TensorRef* t : {&r.q, &r.k, &r.v}) {
    if (t->data.size() > 1) gathered_bytes += t->data_size;
  }
  gathered->reserve(gathered_bytes);
  a.q = ViewOf(r.q, gathered);
  a.k = ViewOf(r.k, gathered);
  a.v = ViewOf(r.v, gathered);
  a.causal = r.options.causal;
  a.sm_scale = r.options.sm_scale;
  a.return_lse = r.options.return_lse;
  return a;
}

grpc::ByteBuffer EncodeResponse(ForwardResult&& result, bool step, int32_t layer,
                                int64_t server_micros, int64_t kernel_micros) {
  std::vector<grpc::Slice> slices;
  slices.reserve(5);
  const size_t out_bytes = result.out.size();
  slices.emplace_back(wire::TensorFieldPrefix(
      wire::kResponseOut, static_cast<int32_t>(result.out_dtype), result.out_shape, out_bytes));
  if (out_bytes > 0) slices.push_back(OwningSlice(std::move(result.out)));
  if (!result.lse_shape.empty()) {
    const size_t lse_bytes = result.lse.size();
    slices.emplace_back(wire::TensorFieldPrefix(
        wire::kResponseLse, static_cast<int32_t>(DType::kFloat32), result.lse_shape, lse_bytes));
    if (lse_bytes > 0) slices.push_back(OwningSlice(std::move(result.lse)));
  }
  if (step) {
    slices.emplace_back(wire::StepResponseFields(layer, "", server_micros, kernel_micros));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeStepError(int32_t layer, const grpc::Status& status) {
  google::rpc::Status rich;
  if (!status.error_details().empty() && rich.ParseFromString(status.error_details())) {
    // ToGrpcStatus's details already are a google.rpc.Status with the field violations.
  } else {
    rich.set_code(static_cast<int>(status.error_code()));
    rich.set_message(status.error_message());
  }
  grpc::Slice slice(wire::StepResponseFields(layer, rich.SerializeAsString(), 0, 0));
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace pagedattn
