// pagedattn::Client: a typed wrapper over the AttentionService stub returning absl::StatusOr,
// plus helpers that turn host arrays into Tensors and back.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/wire.h"
#include "pagedattn/v1/attention.grpc.pb.h"

namespace pagedattn {

struct ClientOptions {
  std::string target = "localhost:50051";      // host:port of the server.
  absl::Duration timeout = absl::Seconds(60);  // Per-RPC deadline; > 0 (Connect checks).
  std::string bearer_token;                    // Sent as "authorization: Bearer <token>" if set.
  std::string tls_ca_file;                     // PEM roots: enables TLS when set.
  std::string tls_cert_file;                   // Client certificate (mTLS), PEM.
  std::string tls_key_file;                    // Client key (mTLS), PEM.
  std::string tls_server_name;                 // Overrides the name checked in the server cert.
  int64_t max_message_bytes = 512 << 20;
  // HTTP/2 windows, frames and socket reads sized for MB messages (common/transport.h); false:
  // gRPC's defaults.
  bool tuned_transport = true;
};

// A tensor sent from the caller's own memory (no copy): it must stay valid until the call that
// sends it returns. dtype UNSPECIFIED: the field is not sent.
// With region_id set, it is a device tensor instead: its elements lie at `offset` in memory
// registered with RegisterMemory (data and bytes unused).
struct TensorArg {
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
  std::string region_id;
  int64_t offset = 0;

  static TensorArg Host(v1::DType dtype, std::vector<int64_t> shape, const void* data,
                        size_t bytes) {
    TensorArg t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.data = data;
    t.bytes = bytes;
    return t;
  }
  static TensorArg Device(v1::DType dtype, std::vector<int64_t> shape, std::string region_id,
                          int64_t offset) {
    TensorArg t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.region_id = std::move(region_id);
    t.offset = offset;
    return t;
  }
};

// One Forward (or one message of a Step stream) with its tensors in the caller's memory.
struct ForwardCall {
  std::string cache_id;  // Step: empty keeps the stream's.
  int32_t layer = 0;
  std::vector<wire::SpanRef> spans;  // Step: empty continues the open step.
  wire::ForwardOptionsRef options;
  TensorArg q, k, v;
  // Device tensors only: where the server writes the answer (ForwardOutput is then unused),
  // and the events that order the work with the caller's stream (wire::DeviceSyncRef; set
  // present to send it).
  TensorArg out, lse;
  wire::DeviceSyncRef sync;
};

// Where a Forward's answer goes: the caller's buffers, exactly out's and lse's size (lse may be
// null when not asked for).
struct ForwardOutput {
  void* out = nullptr;
  size_t out_bytes = 0;
  float* lse = nullptr;
  size_t lse_bytes = 0;
};

// What came back besides the tensors.
struct ForwardReply {
  v1::DType out_dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> out_shape;
  int32_t layer = 0;          // Step: the layer this answers.
  int64_t server_micros = 0;  // The server's time (trailing metadata / StepResponse).
  int64_t kernel_micros = 0;
};

// A request id for the calls of one thread: while a RequestId lives, every call the thread that
// made it sends through a Client (or a ShardedClient, on every shard) carries `id` as its
// x-request-id metadata. The server puts it on the call's log lines as req= (cut to 64 bytes),
// so that a failed call can be found in its log. A Step stream carries the id in force when it
// was opened. They nest: the innermost is in force, and the one outside it is again when it
// ends. Other threads do not inherit it (ShardedClient hands it to its own). An id must be
// printable ASCII and not empty (gRPC refuses the rest, and would abort the process): a call
// made under one that is not fails with INVALID_ARGUMENT, unsent. Made and ended on the same
// thread, innermost first, as a local variable is. Python's pagedattn.request_id is the same.
class RequestId {
 public:
  explicit RequestId(std::string id);
  ~RequestId();
  RequestId(const RequestId&) = delete;
  RequestId& operator=(const RequestId&) = delete;

  // The metadata key the id is sent as (the server's kRequestIdKey).
  static constexpr char kMetadataKey[] = "x-request-id";

  // The id in force on this thread: the innermost RequestId's, or null outside any.
  static const std::string* Current();
  // The longest id sent: the server logs 64 bytes of it, and a call whose headers pass gRPC's
  // 8 KiB makes the server reset the connection, failing the channel's other calls with it.
  static constexpr size_t kMaxBytes = 256;
  // OK, or INVALID_ARGUMENT saying why `id` cannot be sent (empty, over kMaxBytes, or a byte
  // that is not printable ASCII).
  static absl::Status Check(absl::string_view id);

 private:
  std::string id_;
  const RequestId* outer_;  // the one in force before this one, restored when this one ends
};

class StepStream;

// A connection to one server. Its methods may be called from many threads at once (one gRPC
// channel carries them all). Each call fails with the server's status, or the transport's:
// UNAVAILABLE when the server cannot be reached. After the server restarts, calls keep failing
// UNAVAILABLE until the channel's next reconnect attempt, at most about 2 s after the server is
// up again (the backoff of common/transport.h), or, for a DNS name whose records went away
// while the server was down (a headless Service's pod that is not ready), until the name
// resolves again (gRPC's resolver retries on a backoff of its own). A caller that must not see
// that retries UNAVAILABLE (a Forward retried at the same spans' starts writes the same rows
// again).
class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  // On a channel of the caller's (options' target and TLS unused): the token and timeout that
  // Connect would check are checked before each call (INVALID_ARGUMENT; gRPC aborted the
  // process on a token with a line end).
  explicit Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options = {});

  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  absl::StatusOr<v1::ValidateCacheConfigResponse> ValidateCacheConfig(
      const v1::CacheConfig& config);
  absl::StatusOr<v1::CacheInfo> CreateCache(const v1::CacheConfig& config,
                                            const std::string& name = "");
  absl::StatusOr<v1::CacheInfo> GetCache(const std::string& cache_id);
  // Every cache (of the caller's tenant), oldest first, asking page_size a call (0: as many as
  // fit a message) until the last page.
  absl::StatusOr<std::vector<v1::CacheInfo>> ListCaches(int32_t page_size = 0);
  absl::StatusOr<int64_t> DeleteCache(const std::string& cache_id);
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request);
  absl::StatusOr<v1::TruncateSequencesResponse> TruncateSequences(
      const std::string& cache_id, int32_t layer,
      const std::vector<std::pair<uint64_t, int64_t>>& lengths);
  absl::StatusOr<v1::ReleaseSequencesResponse> ReleaseSequences(
      const std::string& cache_id, const std::vector<uint64_t>& seq_ids);
  // Forward with the tensors sent from and the answer written to the caller's memory (no
  // protobuf copies; the answer's bytes are copied once, into `output`).
  absl::StatusOr<ForwardReply> ForwardTensors(const ForwardCall& call, const ForwardOutput& output);
  // Maps a device allocation of this process into the server for cache_id (CUDA backend, same
  // node): ipc_handle is the cudaIpcMemHandle_t of the allocation's start
  // (client/device_region.h: DeviceRegion::ipc_handle()), size_bytes how much of it Forwards may
  // use, lease_seconds 0 for the server's default; ipc_events the cudaIpcEventHandle_t of events
  // for ForwardCall::sync (IpcEvent). Forward's TensorArgs then name {region_id, offset} in it.
  absl::StatusOr<v1::MemoryRegion> RegisterMemory(const std::string& cache_id,
                                                  const std::string& ipc_handle, int64_t size_bytes,
                                                  int32_t device = 0, int32_t lease_seconds = 0,
                                                  const std::vector<std::string>& ipc_events = {});
  absl::Status UnregisterMemory(const std::string& region_id);
  // A Step stream (one Forward per message, answered in order); the deadline covers the stream,
  // and every message carries the RequestId in force here (not the one in force at Send).
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStep();
  // grpc.health.v1 Check: true when SERVING.
  absl::StatusOr<bool> CheckHealth(const std::string& service = "");

  grpc::Channel* channel() const { return channel_.get(); }
  const ClientOptions& options() const { return options_; }

 private:
  // The call's deadline and metadata: the token, and the RequestId in force (INVALID_ARGUMENT,
  // nothing to send, when its id cannot be sent).
  absl::Status Prepare(grpc::ClientContext* ctx) const;

  std::shared_ptr<grpc::Channel> channel_;
  ClientOptions options_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

// One Step stream. Send() and Receive() may run on two threads (one each); Receive() returns
// the answers in the order of the messages sent. A layer's error is Receive()'s status; the
// stream goes on. Once the stream has ended (its deadline, a drain, Cancel(), a token refused),
// Receive() gives the answers left, then the stream's status (OUT_OF_RANGE after an OK end);
// Send() gives that status once Receive() has seen it, UNAVAILABLE before. The server stops
// reading messages while the answers not yet read fill the connection's buffers (16-32 MiB):
// a thread that sends more than that before it receives waits in Send() until its deadline. Close()
// may be called from either thread: it waits for a Receive() under way on the other, reads (and
// drops) answers while a Send() under way on the other waits, then reads what answers are left and
// returns the stream's status.
class StepStream {
 public:
  StepStream(std::unique_ptr<grpc::ClientContext> ctx,
             std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> rw)
      : ctx_(std::move(ctx)), rw_(std::move(rw)) {}
  ~StepStream();
  // Sends one message: a step's opening (spans set) or a layer of the open step.
  absl::Status Send(const ForwardCall& call);
  // The next answer, into `output` (the answer's size, as ForwardTensors checks). The layer ran
  // and was committed when the server answered: an output of another size is DATA_LOSS then,
  // not INVALID_ARGUMENT (the layer's tokens are in the cache; only its answer is lost).
  absl::StatusOr<ForwardReply> Receive(const ForwardOutput& output);
  // No more messages; waits for the stream's end and returns its status (again if called again).
  absl::Status Close();
  void Cancel() { ctx_->TryCancel(); }

 private:
  // The stream's status, once every answer is read (Finish, called once).
  absl::Status FinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_);

  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> rw_;
  // gRPC allows one read and one write at a time on a stream (a second aborts the process):
  // Send and Close's WritesDone take write_mu_, Receive and Close's reads read_mu_.
  absl::Mutex write_mu_;
  absl::Mutex read_mu_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> closing_{false};  // Close() began: Send refuses
  // Messages written (or being written) and answers read: Close() reads only answers owed.
  std::atomic<int64_t> sent_{0}, answered_{0};
  std::atomic<bool> finished_{false};  // final_ is set
  absl::Status final_;
};

// GET http://target/metrics (target "host:port" or "[ipv6]:port" of the server's
// --metrics_listen; a host name tries each of its addresses): the Prometheus text; UNAVAILABLE
// when no address answers (up to 5 s, at most `timeout`, to connect; `timeout` for the whole
// answer after) or
// the answer is not HTTP 200, INVALID_ARGUMENT for a target that is not host:port.
absl::StatusOr<std::string> FetchMetrics(const std::string& target,
                                         absl::Duration timeout = absl::Seconds(10));

// The payload of a status from the server that carries details: the serialized google.rpc.Status
// (its google.rpc.BadRequest violations, or the google.rpc.ErrorInfo of a RESOURCE_EXHAUSTED).
inline constexpr absl::string_view kStatusDetailsPayload = "type.googleapis.com/google.rpc.Status";

// grpc::Status -> absl::Status (same code and message; the server's details, if it sent any, as
// the kStatusDetailsPayload payload).
absl::Status FromGrpcStatus(const grpc::Status& status);

// Tensor helpers: values are rounded to dtype (FLOAT32/FLOAT16/BFLOAT16) on the way in.
v1::Tensor MakeTensor(v1::DType dtype, const std::vector<int64_t>& shape,
                      const std::vector<float>& values);
// The tensor's elements as floats; INVALID_ARGUMENT if its bytes do not match its shape.
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor);

}  // namespace pagedattn
