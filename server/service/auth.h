// Token auth: "authorization: Bearer <token>" maps to a tenant. Without a tokens file every
// caller is the anonymous tenant "". Tokens never appear in logs or error messages.
#pragma once

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/server_context.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pagedattn {

// What a token in the tokens file must be: at least kMinTokenLength characters of RFC 6750's
// b64token (CheckTokenCharacters), at least kMinTokenDistinctChars different ones, and no
// placeholder text ("REPLACE...").
inline constexpr size_t kMinTokenLength = 16;
inline constexpr size_t kMinTokenDistinctChars = 6;
absl::Status CheckTokenStrength(absl::string_view token);
// Letters, digits and -._~+/, then '=' padding; the error names the first other character and
// its position, never the token.
absl::Status CheckTokenCharacters(absl::string_view token);

class TokenAuthenticator {
 public:
  // File format: one token per line, optionally followed by whitespace and a tenant name
  // ("default" when omitted). Blank lines and lines starting with '#' are ignored.
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> FromString(absl::string_view contents);

  // The caller's tenant, or UNAUTHENTICATED (missing or unknown token).
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The same for a call's 'authorization' metadata values: exactly one 'Bearer <token>'.
  absl::StatusOr<std::string> AuthenticateValues(
      const std::vector<absl::string_view>& authorization) const;
  absl::StatusOr<std::string> TenantForToken(absl::string_view token) const;
  size_t num_tokens() const { return tenants_.size(); }
  size_t num_tenants() const;

 private:
  absl::flat_hash_map<std::string, std::string> tenants_;  // token -> tenant
};

// Whether a call to `path` ("/package.Service/Method") needs a token: every call but health's
// and reflection's, unknown methods too (they are refused before gRPC says UNIMPLEMENTED).
bool PathNeedsToken(absl::string_view path);

// Refuses a call that needs a token and has no valid one when its headers arrive, before gRPC
// reads its request: a caller without a token cannot hold request memory (--request_memory_mb)
// with a large message the handler would refuse only once it had arrived. gRPC runs it on TLS
// ports only; the handlers authenticate every call again. `refused(path, status, who)` counts
// and logs each refusal, which the handlers never see; `who` tells what is known of the caller
// here (its certificate's common name under mTLS, its user-agent, its x-request-id as req=;
// gRPC gives no address).
class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  using Refused = std::function<void(absl::string_view path, const absl::Status& status,
                                     absl::string_view who)>;
  TokenAuthProcessor(const TokenAuthenticator* auth, Refused refused)
      : auth_(auth), refused_(std::move(refused)) {}
  bool IsBlocking() const override { return false; }  // a hash lookup
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed, OutputMetadata* response) override;

 private:
  const TokenAuthenticator* auth_;
  Refused refused_;
};

}  // namespace pagedattn
