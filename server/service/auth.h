// Token auth: "authorization: Bearer <token>" maps to a tenant. Without a tokens file every
// caller is the anonymous tenant "". Tokens never appear in logs or error messages.
#pragma once

#include <grpcpp/server_context.h>

#include <memory>
#include <string>

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
  absl::StatusOr<std::string> TenantForToken(absl::string_view token) const;
  size_t num_tokens() const { return tenants_.size(); }
  size_t num_tenants() const;

 private:
  absl::flat_hash_map<std::string, std::string> tenants_;  // token -> tenant
};

}  // namespace pagedattn
