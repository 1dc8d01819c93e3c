// The Forward messages' wire format (pagedattn.v1.ForwardRequest / ForwardResponse), read and
// written without copying tensor bytes: a received message is parsed where it lies, in the
// chunks the transport delivered, and a message to send is a short header per tensor followed
// by the tensor's own bytes. The protobuf encoding is the contract (proto/pagedattn/v1); the
// round trips against protobuf's own encoder are tested (tests/service/wire_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedattn::wire {

// A run of bytes inside a received message or a buffer to send.
struct Piece {
  const char* data = nullptr;
  size_t size = 0;
};

// A Tensor field as received. Its data may span several pieces (the message arrived in
// several chunks); the pieces point into those chunks.
struct TensorRef {
  bool present = false;  // The field was in the message.
  int32_t dtype = 0;
  std::vector<int64_t> shape;
  std::vector<Piece> data;
  size_t data_size = 0;
  // Tensor.device_buffer: the tensor lies in a registered region instead of data.
  bool on_device = false;
  std::string region_id;
  int64_t offset = 0;

  // Copies the data's bytes to dst (data_size bytes).
  void CopyTo(char* dst) const;
};

struct SpanRef {
  uint64_t seq_id = 0;
  int64_t start = 0;
  int32_t num_new_tokens = 0;
  int32_t num_queries = 0;
};

struct ForwardOptionsRef {
  std::optional<bool> causal;
  std::optional<float> sm_scale;
  bool return_lse = false;
};

// ForwardRequest.sync: events of a region ordering the device work (0: none).
struct DeviceSyncRef {
  bool present = false;
  std::string region_id;
  int32_t wait_event = 0;
  int32_t done_event = 0;
};

struct ForwardRequestRef {
  std::string cache_id;
  int32_t layer = 0;
  std::vector<SpanRef> spans;
  TensorRef q, k, v;
  ForwardOptionsRef options;
  TensorRef out, lse;  // Where device tensors' answer goes (fields 8 and 9).
  DeviceSyncRef sync;  // Field 10.
};

// Bounds the parse checks as it goes: a repeated field's entry costs 1-2 bytes on the wire and
// 8-24 in memory, so a request of many empty spans or shape entries would otherwise grow 10-25
// times its size before any limit saw it.
struct ParseLimits {
  size_t max_spans = SIZE_MAX;  // ForwardRequest.spans (the server's --max_forward_spans)
  size_t max_shape_dims = 8;    // any Tensor's shape (a Forward's have 2 or 3)
};

// Parses a ForwardRequest whose bytes are `chunks` in order (protobuf's rules: unknown fields
// skipped, the last value of a singular field wins, repeated scalars packed or not, a message
// field seen twice merged, keys and lengths of at most 5 bytes, field numbers under 2^29,
// lengths under 2^31, strings UTF-8; groups, which proto3 never sends, are refused). Returns
// false and says why in *error for bytes that are not a ForwardRequest or pass `limits`. No
// tensor byte is copied. An error past `limits` starts "at most" ("at most 65536 spans per
// Forward"): the bytes may well be a ForwardRequest.
bool ParseForwardRequest(const std::vector<Piece>& chunks, ForwardRequestRef* out,
                         std::string* error, const ParseLimits& limits = {});

// The bytes before a Tensor field's data in a message: the field's tag and length, the
// tensor's dtype and shape, and the data's tag and length. The data_size bytes of the data
// follow it.
std::string TensorFieldPrefix(int field_number, int32_t dtype, const std::vector<int64_t>& shape,
                              size_t data_size);

// A Tensor field that names a place in a registered region (Tensor.device_buffer) instead of
// carrying data.
std::string DeviceTensorField(int field_number, int32_t dtype, const std::vector<int64_t>& shape,
                              const std::string& region_id, int64_t offset);

// A ForwardRequest's sync field (DeviceSync).
std::string DeviceSyncField(const DeviceSyncRef& sync);

// The bytes of a ForwardRequest without its tensors (cache id, layer, spans, options), to which
// the q, k and v fields (TensorFieldPrefix + data) are appended in any order.
std::string ForwardRequestHead(const std::string& cache_id, int32_t layer,
                               const std::vector<SpanRef>& spans, const ForwardOptionsRef& options);

// Field numbers of the messages (proto/pagedattn/v1/attention.proto).
inline constexpr int kRequestQ = 4, kRequestK = 5, kRequestV = 6;
inline constexpr int kRequestOut = 8, kRequestLse = 9, kRequestSync = 10;
inline constexpr int kResponseOut = 1, kResponseLse = 2;

// The fields of a StepResponse besides its tensors (which are ForwardResponse's out and lse,
// same numbers): the layer, an error (the bytes of a google.rpc.Status; empty: none) and the
// server's timing.
std::string StepResponseFields(int32_t layer, const std::string& error_status,
                               int64_t server_micros, int64_t kernel_micros);

// A ForwardResponse (or StepResponse) as received: out and lse (lse.present only when asked
// for); for a StepResponse also its layer, error (a google.rpc.Status's bytes; empty: none)
// and timing.
struct ForwardResponseRef {
  TensorRef out, lse;
  int32_t layer = 0;
  std::string error_status;
  int64_t server_micros = 0;
  int64_t kernel_micros = 0;
};
bool ParseForwardResponse(const std::vector<Piece>& chunks, ForwardResponseRef* out,
                          std::string* error, const ParseLimits& limits = {});

}  // namespace pagedattn::wire
