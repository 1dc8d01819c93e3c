// Client implementation: one deadline per RPC, optional TLS and bearer token.
#include "client/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/host_port.h"
#include "common/transport.h"
#include "google/rpc/status.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace pagedattn {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot read the file (", std::strerror(errno), ")"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (!status.error_details().empty()) {
    out.SetPayload(kStatusDetailsPayload, absl::Cord(status.error_details()));
  }
  return out;
}

namespace {
// What every call of a client takes from its options: checked by Connect, and before each call
// of a Client made on a channel of the caller's.
absl::Status CheckCallOptions(const ClientOptions& options) {
  if (!(options.timeout > absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be positive (absl::InfiniteDuration() for none; got ",
                     absl::FormatDuration(options.timeout), ")"));
  }
  // gRPC aborts the process on a header value it cannot send, and prints it: a token with a
  // newline (read from a secret file) would crash the caller and leak. Refused here, unquoted.
  for (size_t i = 0; i < options.bearer_token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(options.bearer_token[i]);
    if (!absl::ascii_isgraph(c)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bearer token: byte 0x%02x at position %d of %d is not printable ASCII%s", c, i,
          options.bearer_token.size(),
          c == '\n' || c == '\r' ? " (a line end, as read from a file: strip it)" : ""));
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  // gRPC takes an empty target to a channel that fails every call, and a port past 65535
  // modulo 65536 (another port, perhaps another server's).
  if (options.target.empty()) {
    return absl::InvalidArgumentError("target is required: host:port, unix:PATH or a gRPC URI");
  }
  if (const std::string why = TargetPortError(options.target); !why.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("target '", absl::CHexEscape(options.target), "': ", why));
  }
  if (options.max_message_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes must be positive (the largest message sent or received; got ",
        options.max_message_bytes, ")"));
  }
  if (absl::Status s = CheckCallOptions(options); !s.ok()) return s;
  // gRPC aborts the process on a certificate without its key; a name to check or a key with no
  // TLS to use them in would send the calls in plaintext unnoticed.
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: a client certificate and its key go together (got ",
                     options.tls_cert_file.empty() ? "a key without a certificate"
                                                   : "a certificate without a key",
                     ")"));
  }
  if (!options.tls_server_name.empty() && options.tls_ca_file.empty() &&
      options.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS: tls_server_name applies to TLS connections: set tls_ca_file (the CA to verify "
        "the server with) too");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (!options.tls_ca_file.empty() || !options.tls_cert_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    // A file that holds no PEM block of its kind is named here (gRPC's error names neither).
    auto pem = [](const std::string& path, const char* what,
                  absl::string_view marker) -> absl::StatusOr<std::string> {
      absl::StatusOr<std::string> data = ReadFile(path);
      if (!data.ok()) {
        return absl::Status(data.status().code(),
                            absl::StrCat("TLS ", what, " ", data.status().message()));
      }
      if (!absl::StrContains(*data, marker)) {
        return absl::InvalidArgumentError(
            absl::StrCat("TLS ", what, " ", path, " holds no PEM ", marker, " block"));
      }
      return data;
    };
    if (!options.tls_ca_file.empty()) {
      absl::StatusOr<std::string> ca = pem(options.tls_ca_file, "CA file", "CERTIFICATE");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!options.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert =
          pem(options.tls_cert_file, "certificate file", "CERTIFICATE");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = pem(options.tls_key_file, "key file", "PRIVATE KEY");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  if (options.tuned_transport) {
    for (const auto& [name, value] : kTransportArgs) args.SetInt(name, value);
  }
  const int max_bytes = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(max_bytes);
  args.SetMaxSendMessageSize(max_bytes);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, kMinResolutionIntervalMs);
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  return std::make_unique<Client>(grpc::CreateCustomChannel(options.target, creds, args), options);
}

Client::Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)),
      options_(std::move(options)),
      stub_(v1::AttentionService::NewStub(channel_)) {}

namespace {
// The innermost RequestId of this thread (each links to the one it hides).
thread_local const RequestId* current_request_id = nullptr;
}  // namespace

RequestId::RequestId(std::string id) : id_(std::move(id)), outer_(current_request_id) {
  current_request_id = this;
}

RequestId::~RequestId() { current_request_id = outer_; }

const std::string* RequestId::Current() {
  return current_request_id == nullptr ? nullptr : &current_request_id->id_;
}

absl::Status RequestId::Check(absl::string_view id) {
  if (id.empty()) {
    return absl::InvalidArgumentError("the request id is empty: give one, or make no RequestId");
  }
  if (id.size() > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request id is ", id.size(), " bytes: at most ", kMaxBytes,
        " (the server logs its first 64; headers over 8 KiB reset the whole connection)"));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrFormat("byte 0x%02x at position %d of %d of the request id is not printable "
                          "ASCII (gRPC cannot send it as metadata)",
                          c, i, id.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::Prepare(grpc::ClientContext* ctx) const {
  if (absl::Status s = CheckCallOptions(options_); !s.ok()) return s;
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.bearer_token.empty()) {
    ctx->AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
  if (const std::string* id = RequestId::Current(); id != nullptr) {
    if (absl::Status s = RequestId::Check(*id); !s.ok()) return s;
    ctx->AddMetadata(RequestId::kMetadataKey, *id);
  }
  return absl::OkStatus();
}

#define PAGEDATTN_UNARY(Method, request, Response)          \
  grpc::ClientContext ctx;                                  \
  if (absl::Status p = Prepare(&ctx); !p.ok()) return p;    \
  Response response;                                        \
  grpc::Status s = stub_->Method(&ctx, request, &response); \
  if (!s.ok()) return FromGrpcStatus(s);

absl::StatusOr<v1::ServerInfo> Client::GetServerInfo() {
  PAGEDATTN_UNARY(GetServerInfo, v1::GetServerInfoRequest(), v1::ServerInfo);
  return response;
}

absl::StatusOr<v1::ValidateCacheConfigResponse> Client::ValidateCacheConfig(
    const v1::CacheConfig& config) {
  PAGEDATTN_UNARY(ValidateCacheConfig, config, v1::ValidateCacheConfigResponse);
  return response;
}

absl::StatusOr<v1::CacheInfo> Client::CreateCache(const v1::CacheConfig& config,
                                                  const std::string& name) {
  v1::CreateCacheRequest request;
  *request.mutable_config() = config;
  request.set_name(name);
  PAGEDATTN_UNARY(CreateCache, request, v1::CacheInfo);
  return response;
}

absl::StatusOr<v1::CacheInfo> Client::GetCache(const std::string& cache_id) {
  v1::GetCacheRequest request;
  request.set_cache_id(cache_id);
  PAGEDATTN_UNARY(GetCache, request, v1::CacheInfo);
  return response;
}

absl::StatusOr<std::vector<v1::CacheInfo>> Client::ListCaches(int32_t page_size) {
  std::vector<v1::CacheInfo> all;
  v1::ListCachesRequest request;
  request.set_page_size(page_size);
  while (true) {  // every page, each answer's token asking for the next
    PAGEDATTN_UNARY(ListCaches, request, v1::ListCachesResponse);
    all.insert(all.end(), response.caches().begin(), response.caches().end());
    if (response.next_page_token().empty()) return all;
    request.set_page_token(response.next_page_token());
  }
}

absl::StatusOr<int64_t> Client::DeleteCache(const std::string& cache_id) {
  v1::DeleteCacheRequest request;
  request.set_cache_id(cache_id);
  PAGEDATTN_UNARY(DeleteCache, request, v1::DeleteCacheResponse);
  return response.freed_bytes();
}

absl::StatusOr<v1::ForwardResponse> Client::Forward(const v1::ForwardRequest& request) {
  PAGEDATTN_UNARY(Forward, request, v1::ForwardResponse);
  return response;
}

absl::StatusOr<v1::TruncateSequencesResponse> Client::TruncateSequences(
    const std::string& cache_id, int32_t layer,
    const std::vector<std::pair<uint64_t, int64_t>>& lengths) {
  v1::TruncateSequencesRequest request;
  request.set_cache_id(cache_id);
  request.set_layer(layer);
  for (const auto& [seq_id, length] : lengths) {
    v1::SequenceLength* l = request.add_lengths();
    l->set_seq_id(seq_id);
    l->set_length(length);
  }
  PAGEDATTN_UNARY(TruncateSequences, request, v1::TruncateSequencesResponse);
  return response;
}

absl::StatusOr<v1::ReleaseSequencesResponse> Client::ReleaseSequences(
    const std::string& cache_id, const std::vector<uint64_t>& seq_ids) {
  v1::ReleaseSequencesRequest request;
  request.set_cache_id(cache_id);
  for (uint64_t id : seq_ids) request.add_seq_ids(id);
  PAGEDATTN_UNARY(ReleaseSequences, request, v1::ReleaseSequencesResponse);
  return response;
}

absl::StatusOr<v1::MemoryRegion> Client::RegisterMemory(
    const std::string& cache_id, const std::string& ipc_handle, int64_t size_bytes, int32_t device,
    int32_t lease_seconds, const std::vector<std::string>& ipc_events) {
  v1::RegisterMemoryRequest req;
  req.set_cache_id(cache_id);
  req.set_cuda_ipc_handle(ipc_handle);
  req.set_size_bytes(size_bytes);
  req.set_device(device);
  req.set_lease_seconds(lease_seconds);
  for (const std::string& e : ipc_events) req.add_cuda_ipc_events(e);
  PAGEDATTN_UNARY(RegisterMemory, req, v1::MemoryRegion);
  return response;
}

absl::Status Client::UnregisterMemory(const std::string& region_id) {
  v1::UnregisterMemoryRequest req;
  req.set_region_id(region_id);
  PAGEDATTN_UNARY(UnregisterMemory, req, v1::UnregisterMemoryResponse);
  return absl::OkStatus();
}

#undef PAGEDATTN_UNARY

namespace {

constexpr char kForwardMethod[] = "/pagedattn.v1.AttentionService/Forward";
constexpr char kStepMethod[] = "/pagedattn.v1.AttentionService/Step";

// The call's message as slices: small headers copied, tensor data referenced where it lies.
// Host tensors whose bytes have no data: sent, they would fail the connection in the kernel's
// writev (EFAULT), and with it every other call on the channel.
absl::Status CheckTensorData(const ForwardCall& call) {
  for (const auto& [name, t] : {std::pair{"q", &call.q},
                                {"k", &call.k},
                                {"v", &call.v},
                                {"out", &call.out},
                                {"lse", &call.lse}}) {
    if (t->dtype != v1::DTYPE_UNSPECIFIED && t->region_id.empty() && t->bytes > 0 &&
        t->data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has ", t->bytes, " bytes but no data (data is null)"));
    }
  }
  return absl::OkStatus();
}

grpc::ByteBuffer EncodeCall(const ForwardCall& call) {
  std::vector<grpc::Slice> slices;
  slices.emplace_back(
      wire::ForwardRequestHead(call.cache_id, call.layer, call.spans, call.options));
  for (const auto& [field, t] : {std::pair{wire::kRequestQ, &call.q},
                                 {wire::kRequestK, &call.k},
                                 {wire::kRequestV, &call.v},
                                 {wire::kRequestOut, &call.out},
                                 {wire::kRequestLse, &call.lse}}) {
    if (t->dtype == v1::DTYPE_UNSPECIFIED) continue;
    if (!t->region_id.empty()) {
      slices.emplace_back(
          wire::DeviceTensorField(field, t->dtype, t->shape, t->region_id, t->offset));
      continue;
    }
    slices.emplace_back(wire::TensorFieldPrefix(field, t->dtype, t->shape, t->bytes));
    if (t->bytes > 0) slices.emplace_back(t->data, t->bytes, grpc::Slice::STATIC_SLICE);
  }
  if (call.sync.present) slices.emplace_back(wire::DeviceSyncField(call.sync));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A buffer of the wrong size, found once the answer is here: the layer ran and was committed,
// so not INVALID_ARGUMENT (which says nothing was written: ShardedClient rolls back by it) but
// DATA_LOSS: the answer is lost to the caller.
absl::Status CopyTensor(const wire::TensorRef& t, void* dst, size_t dst_bytes, const char* name) {
  if (dst == nullptr) return absl::OkStatus();
  if (t.data_size != dst_bytes) {
    return absl::DataLossError(absl::StrCat(
        "the layer ran and was committed, but the answer's ", name, " holds ", t.data_size,
        " bytes and the buffer given has ", dst_bytes,
        ": the answer is lost (give buffers of the answer's size; sending the layer again at "
        "the same start rewrites the same rows)"));
  }
  t.CopyTo(static_cast<char*>(dst));
  return absl::OkStatus();
}

// The output buffers against the answer q's shape and dtype make (host q only; out takes q's
// dtype), checked before the call is sent: found after it, the server would have committed.
absl::Status CheckOutput(const ForwardCall& call, const ForwardOutput& output) {
  if (output.lse != nullptr && !call.options.return_lse) {
    return absl::InvalidArgumentError(
        "an lse buffer was given but options.return_lse is false: set it, or pass no lse");
  }
  const TensorArg& q = call.q;
  const size_t size = DTypeSize(static_cast<DType>(q.dtype));
  if (!q.region_id.empty() || q.shape.size() != 3 || size == 0 ||
      std::any_of(q.shape.begin(), q.shape.end(), [](int64_t d) { return d < 0; })) {
    return absl::OkStatus();  // the server names what is wrong with q
  }
  // A shape whose sizes pass 64 bits is the server's to name (q.shape), not a size made up.
  int64_t rows = 0, out_bytes = 0, lse_bytes = 0;
  if (__builtin_mul_overflow(q.shape[0], q.shape[1], &rows) ||
      __builtin_mul_overflow(rows, q.shape[2], &out_bytes) ||
      __builtin_mul_overflow(out_bytes, static_cast<int64_t>(size), &out_bytes) ||
      __builtin_mul_overflow(rows, static_cast<int64_t>(sizeof(float)), &lse_bytes)) {
    return absl::OkStatus();
  }
  if (output.out != nullptr && output.out_bytes != static_cast<size_t>(out_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("the out buffer has ", output.out_bytes,
                                                   " bytes; q's shape and dtype make the answer's ",
                                                   out_bytes));
  }
  if (output.lse != nullptr && output.lse_bytes != static_cast<size_t>(lse_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("the lse buffer has ", output.lse_bytes,
                                                   " bytes; the answer's lse has ", lse_bytes));
  }
  return absl::OkStatus();
}

// The reply's fields and tensors (into output); a StepResponse's error as a status.
absl::StatusOr<ForwardReply> DecodeReply(grpc::ByteBuffer& buffer, const ForwardOutput& output) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return absl::DataLossError("unreadable answer");
  std::vector<wire::Piece> pieces;
  for (const grpc::Slice& s : slices) {
    pieces.push_back({reinterpret_cast<const char*>(s.begin()), s.size()});
  }
  wire::ForwardResponseRef r;
  std::string error;
  if (!wire::ParseForwardResponse(pieces, &r, &error)) {
    return absl::DataLossError(absl::StrCat("the answer is not a ForwardResponse: ", error));
  }
  if (!r.error_status.empty()) {
    google::rpc::Status status;
    status.ParseFromString(r.error_status);
    absl::Status out(static_cast<absl::StatusCode>(status.code()), status.message());
    if (status.details_size() > 0) {
      out.SetPayload(kStatusDetailsPayload, absl::Cord(std::string(r.error_status)));
    }
    return out;
  }
  ForwardReply reply;
  reply.out_dtype = static_cast<v1::DType>(r.out.dtype);
  reply.out_shape = r.out.shape;
  reply.layer = r.layer;
  reply.server_micros = r.server_micros;
  reply.kernel_micros = r.kernel_micros;
  if (absl::Status s = CopyTensor(r.out, output.out, output.out_bytes, "out"); !s.ok()) return s;
  if (output.lse != nullptr) {
    if (absl::Status s = CopyTensor(r.lse, output.lse, output.lse_bytes, "lse"); !s.ok()) return s;
  }
  return reply;
}

int64_t TrailerMicros(const grpc::ClientContext& ctx, const char* key) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(key);
  int64_t v = 0;
  if (it != md.end())
    (void)absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &v);
  return v;
}

}  // namespace

absl::StatusOr<ForwardReply> Client::ForwardTensors(const ForwardCall& call,
                                                    const ForwardOutput& output) {
  if (absl::Status s = CheckTensorData(call); !s.ok()) return s;
  if (absl::Status s = CheckOutput(call, output); !s.ok()) return s;
  grpc::ClientContext ctx;
  if (absl::Status p = Prepare(&ctx); !p.ok()) return p;
  const grpc::ByteBuffer request = EncodeCall(call);
  grpc::ByteBuffer response;
  const grpc::internal::RpcMethod method(kForwardMethod, grpc::internal::RpcMethod::NORMAL_RPC,
                                         channel_);
  grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), method, &ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  absl::StatusOr<ForwardReply> reply = DecodeReply(response, output);
  if (!reply.ok()) return reply;
  reply->server_micros = TrailerMicros(ctx, "pagedattn-server-us");
  reply->kernel_micros = TrailerMicros(ctx, "pagedattn-kernel-us");
  return reply;
}

absl::StatusOr<std::unique_ptr<StepStream>> Client::OpenStep() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  // The stream's metadata, the request id with it, is sent once: every message carries this id.
  if (absl::Status p = Prepare(ctx.get()); !p.ok()) return p;
  const grpc::internal::RpcMethod method(kStepMethod, grpc::internal::RpcMethod::BIDI_STREAMING,
                                         channel_);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> rw(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel_.get(), method, ctx.get()));
  return std::make_unique<StepStream>(std::move(ctx), std::move(rw));
}

StepStream::~StepStream() {
  if (!closed_ && !finished_) {
    ctx_->TryCancel();
    (void)rw_->Finish();
  }
}

absl::Status StepStream::Send(const ForwardCall& call) {
  absl::MutexLock lock(&write_mu_);
  if (finished_ && !final_.ok()) return final_;
  if (closed_ || closing_ || finished_) {
    return absl::UnavailableError("the Step stream is closed (Close()) or ended");
  }
  if (absl::Status s = CheckTensorData(call); !s.ok()) return s;
  ++sent_;
  // Through to the socket before Write returns when it carries host tensors: they are the
  // caller's memory (no copy), which it may refill once Send returns, and by default gRPC may
  // complete a write once it passes flow control, before its bytes are written. (Device tensors
  // travel as references: nothing of the caller's goes with the message.)
  grpc::WriteOptions write;
  for (const TensorArg* t : {&call.q, &call.k, &call.v}) {
    if (t->region_id.empty() && t->bytes > 0) write.set_write_through();
  }
  if (!rw_->Write(EncodeCall(call), write)) {
    --sent_;
    // Why is known once the answers are read: Receive() gives those left, then the why.
    if (finished_ && !final_.ok()) return final_;
    return absl::UnavailableError(
        "the Step stream ended: Receive() gives the answers left, then why (or Close())");
  }
  return absl::OkStatus();
}

absl::Status StepStream::FinishLocked() {
  if (!finished_) {
    // Not while a Send writes: gRPC's Finish is for a stream with nothing more to send (a Send
    // on a stream that ended returns at once).
    absl::MutexLock write(&write_mu_);
    final_ = FromGrpcStatus(rw_->Finish());
    finished_ = true;  // after final_: Send reads final_ once it sees this
  }
  return final_;
}

absl::StatusOr<ForwardReply> StepStream::Receive(const ForwardOutput& output) {
  grpc::ByteBuffer buffer;
  absl::MutexLock lock(&read_mu_);
  if (finished_ || !rw_->Read(&buffer)) {
    // Every answer read: the stream's status says why it ended (a deadline, a token refused, a
    // drain, a cancel...).
    absl::Status ended = FinishLocked();
    if (!ended.ok()) return ended;
    return absl::OutOfRangeError("the Step stream ended: every message sent was answered");
  }
  ++answered_;
  return DecodeReply(buffer, output);
}

absl::Status StepStream::Close() {
  // No Send from here on. One under way on another thread may wait for the server, which waits
  // for its answers to be read: while it does, the answers owed are read (and dropped) here,
  // unless a Receive under way on another thread reads them.
  closing_ = true;
  grpc::ByteBuffer rest;
  bool more = true;
  while (!write_mu_.TryLock()) {
    if (more && answered_ < sent_ && read_mu_.TryLock()) {
      if (!finished_ && answered_ < sent_) {
        more = rw_->Read(&rest);
        if (more) ++answered_;
      }
      read_mu_.Unlock();
    } else {
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  if (!closed_.exchange(true) && !finished_) rw_->WritesDone();
  write_mu_.Unlock();
  absl::MutexLock read(&read_mu_);  // a Receive under way on another thread ends first
  while (more && !finished_ && rw_->Read(&rest)) {
  }
  return FinishLocked();
}

absl::StatusOr<bool> Client::CheckHealth(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  if (absl::Status p = Prepare(&ctx); !p.ok()) return p;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status s = stub->Check(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

v1::Tensor MakeTensor(v1::DType dtype, const std::vector<int64_t>& shape,
                      const std::vector<float>& values) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  const DType dt = static_cast<DType>(dtype);
  std::string data(values.size() * DTypeSize(dt), '\0');
  for (size_t i = 0; i < values.size(); ++i)
    StoreFromFloat(dt, data.data(), static_cast<int64_t>(i), values[i]);
  t.set_data(std::move(data));
  return t;
}

absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& t) {
  const DType dt = static_cast<DType>(t.dtype());
  if (DTypeSize(dt) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor.dtype must be FLOAT32, FLOAT16 or BFLOAT16 (got ",
                     static_cast<int>(t.dtype()), ")"));
  }
  // The elements the data holds, then the shape's product checked against it: a product past
  // 64 bits never wraps to a size that matches.
  const int64_t n = static_cast<int64_t>(t.data().size() / DTypeSize(dt));
  int64_t product = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor.shape must have no negative dimension (got [",
                       absl::StrJoin(t.shape(), ", "), "])"));
    }
    if (d != 0 && product > n / d) product = n + 1;  // more than the data holds, and no overflow
    else product *= d;
  }
  if (t.data().size() % DTypeSize(dt) != 0 || product != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor holds ", t.data().size(), " bytes, which its shape [",
                     absl::StrJoin(t.shape(), ", "), "] of ", DTypeSize(dt),
                     "-byte values does not match"));
  }
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = LoadAsFloat(dt, t.data().data(), i);
  return out;
}

}  // namespace pagedattn
