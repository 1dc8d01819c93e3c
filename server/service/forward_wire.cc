// ParseForward / ToForwardArgs / EncodeResponse: common/wire over gRPC's byte buffers.
#include "server/service/forward_wire.h"

#include <algorithm>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/rpc/status.pb.h"
#include "server/service/request_parse.h"

namespace pagedattn {
namespace {

// The tensor's view in the core, its bytes copied from the request's chunks to dst.
TensorView Place(const wire::TensorRef& t, char* dst) {
  TensorView v;
  if (!t.present) return v;
  v.dtype = static_cast<DType>(t.dtype);
  v.shape = t.shape;
  v.size_bytes = t.data_size;
  if (t.data_size > 0 && dst != nullptr) {
    t.CopyTo(dst);
    v.data = dst;
  }
  return v;
}

// A device tensor's view: dtype, shape and the bytes the shape spans (saturated: a shape that
// does not fit is refused by the shape check first); its address comes from its region later.
TensorView Described(const wire::TensorRef& t) {
  TensorView v;
  if (!t.present) return v;
  v.dtype = static_cast<DType>(t.dtype);
  v.shape = t.shape;
  int64_t bytes = std::max(0, DTypeSize(v.dtype));
  for (int64_t d : t.shape) {
    bytes = (d < 0 || (d > 0 && bytes > INT64_MAX / d)) ? INT64_MAX : bytes * d;
  }
  v.size_bytes = static_cast<size_t>(bytes);
  return v;
}

// A slice of bytes that `owner` keeps alive (released when gRPC is done with the slice).
grpc::Slice SliceOf(const char* data, size_t size, const std::shared_ptr<ForwardBuffers>& owner) {
  auto* keep = new std::shared_ptr<ForwardBuffers>(owner);
  return grpc::Slice(
      const_cast<char*>(data), size,
      [](void* p) { delete static_cast<std::shared_ptr<ForwardBuffers>*>(p); }, keep);
}

}  // namespace

absl::Status ParseForward(const grpc::ByteBuffer& buffer, int64_t max_spans,
                          ReceivedForward* out) {
  if (absl::Status s = CheckRequestArrived(buffer); !s.ok()) return s;
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
  wire::ParseLimits limits;
  limits.max_spans = static_cast<size_t>(std::max<int64_t>(max_spans, 0));
  if (!wire::ParseForwardRequest(pieces, &out->request, &error, limits)) {
    if (absl::StartsWith(error, "at most ")) return absl::InvalidArgumentError(error);
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a pagedattn.v1.ForwardRequest: ", error));
  }
  return absl::OkStatus();
}

bool HasDeviceTensors(const wire::ForwardRequestRef& r) {
  return r.q.on_device || r.k.on_device || r.v.on_device || r.out.on_device || r.lse.on_device;
}

size_t QBytes(const wire::ForwardRequestRef& r) { return r.q.data_size; }
size_t KvBytes(const wire::ForwardRequestRef& r) { return std::max(r.k.data_size, r.v.data_size); }

ForwardArgs ToForwardArgs(const wire::ForwardRequestRef& r, ForwardBuffers* buffers) {
  ForwardArgs a;
  a.layer = r.layer;
  a.spans.reserve(r.spans.size());
  for (const wire::SpanRef& s : r.spans) {
    a.spans.push_back({s.seq_id, s.start, s.num_new_tokens, s.num_queries});
  }
  a.device_tensors = HasDeviceTensors(r);
  if (a.device_tensors) {
    a.q = Described(r.q);
    a.k = Described(r.k);
    a.v = Described(r.v);
    a.out = Described(r.out);
    a.lse = Described(r.lse);
  } else {
    a.q = Place(r.q, buffers != nullptr ? buffers->q() : nullptr);
    a.k = Place(r.k, buffers != nullptr ? buffers->k() : nullptr);
    a.v = Place(r.v, buffers != nullptr ? buffers->v() : nullptr);
  }
  a.causal = r.options.causal;
  a.sm_scale = r.options.sm_scale;
  a.return_lse = r.options.return_lse;
  a.buffers = buffers;
  return a;
}

grpc::ByteBuffer EncodeResponse(const ForwardResult& result,
                                std::shared_ptr<ForwardBuffers> buffers, bool step, int32_t layer,
                                int64_t server_micros, int64_t kernel_micros) {
  std::vector<grpc::Slice> slices;
  slices.reserve(5);
  int64_t out_elems = 1;
  for (int64_t d : result.out_shape) out_elems *= d;
  const size_t out_bytes = static_cast<size_t>(out_elems) * DTypeSize(result.out_dtype);
  slices.emplace_back(wire::TensorFieldPrefix(
      wire::kResponseOut, static_cast<int32_t>(result.out_dtype), result.out_shape, out_bytes));
  if (out_bytes > 0) slices.push_back(SliceOf(buffers->out(), out_bytes, buffers));
  if (!result.lse_shape.empty()) {
    const size_t lse_bytes =
        static_cast<size_t>(result.lse_shape[0] * result.lse_shape[1]) * sizeof(float);
    slices.emplace_back(wire::TensorFieldPrefix(
        wire::kResponseLse, static_cast<int32_t>(DType::kFloat32), result.lse_shape, lse_bytes));
    if (lse_bytes > 0) {
      slices.push_back(SliceOf(reinterpret_cast<const char*>(buffers->lse()), lse_bytes, buffers));
    }
  }
  if (step) {
    slices.emplace_back(wire::StepResponseFields(layer, "", server_micros, kernel_micros));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeDeviceResponse(const ForwardResult& result,
                                      const wire::ForwardRequestRef& request, bool step,
                                      int32_t layer, int64_t server_micros, int64_t kernel_micros) {
  std::string bytes =
      wire::DeviceTensorField(wire::kResponseOut, static_cast<int32_t>(result.out_dtype),
                              result.out_shape, request.out.region_id, request.out.offset);
  if (!result.lse_shape.empty()) {
    bytes += wire::DeviceTensorField(wire::kResponseLse, static_cast<int32_t>(DType::kFloat32),
                                     result.lse_shape, request.lse.region_id, request.lse.offset);
  }
  if (step) bytes += wire::StepResponseFields(layer, "", server_micros, kernel_micros);
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
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
