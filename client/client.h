// pagedattn::Client: a typed wrapper over the AttentionService stub returning absl::StatusOr,
// plus helpers that turn host arrays into Tensors and back.
#pragma once

#include <grpcpp/channel.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pagedattn/v1/attention.grpc.pb.h"

namespace pagedattn {

struct ClientOptions {
  std::string target = "localhost:50051";      // host:port of the server.
  absl::Duration timeout = absl::Seconds(60);  // Per-RPC deadline.
  std::string bearer_token;                    // Sent as "authorization: Bearer <token>" if set.
  std::string tls_ca_file;                     // PEM roots: enables TLS when set.
  std::string tls_cert_file;                   // Client certificate (mTLS), PEM.
  std::string tls_key_file;                    // Client key (mTLS), PEM.
  std::string tls_server_name;                 // Overrides the name checked in the server cert.
  int64_t max_message_bytes = 512 << 20;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  explicit Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options = {});

  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  absl::StatusOr<v1::ValidateCacheConfigResponse> ValidateCacheConfig(
      const v1::CacheConfig& config);
  absl::StatusOr<v1::CacheInfo> CreateCache(const v1::CacheConfig& config,
                                            const std::string& name = "");
  absl::StatusOr<v1::CacheInfo> GetCache(const std::string& cache_id);
  absl::StatusOr<std::vector<v1::CacheInfo>> ListCaches();
  absl::StatusOr<int64_t> DeleteCache(const std::string& cache_id);
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request);
  absl::StatusOr<v1::ReleaseSequencesResponse> ReleaseSequences(
      const std::string& cache_id, const std::vector<uint64_t>& seq_ids);
  // grpc.health.v1 Check: true when SERVING.
  absl::StatusOr<bool> CheckHealth(const std::string& service = "");

  grpc::Channel* channel() const { return channel_.get(); }

 private:
  void Prepare(grpc::ClientContext* ctx) const;

  std::shared_ptr<grpc::Channel> channel_;
  ClientOptions options_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

// GET http://target/metrics (target "host:port" of the server's --metrics_listen): the
// Prometheus text, or UNAVAILABLE.
absl::StatusOr<std::string> FetchMetrics(const std::string& target);

// grpc::Status -> absl::Status (same code and message).
absl::Status FromGrpcStatus(const grpc::Status& status);

// Tensor helpers: values are rounded to dtype (FLOAT32/FLOAT16/BFLOAT16) on the way in.
v1::Tensor MakeTensor(v1::DType dtype, const std::vector<int64_t>& shape,
                      const std::vector<float>& values);
// The tensor's elements as floats; INVALID_ARGUMENT if its bytes do not match its shape.
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor);

}  // namespace pagedattn
