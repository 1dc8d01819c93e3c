// TokenAuthenticator: parses the tokens file and checks bearer tokens; TokenAuthProcessor
// checks them as a call's headers arrive.
#include "server/service/auth.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "server/service/flag_file.h"
#include "server/service/log_text.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::FromFile(
    const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFlagFile("--auth_tokens_file", path);
  if (!contents.ok()) return contents.status();
  absl::StatusOr<std::unique_ptr<TokenAuthenticator>> a = FromString(*contents);
  if (!a.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file ", path, ": ", a.status().message()));
  }
  return a;
}

absl::Status CheckTokenStrength(absl::string_view token) {
  // Never quotes the token: error messages reach logs.
  if (token.size() < kMinTokenLength) {
    return absl::InvalidArgumentError(absl::StrCat("a token must be at least ", kMinTokenLength,
                                                   " characters (this one has ", token.size(),
                                                   "); make one with: openssl rand -hex 32"));
  }
  const std::string upper = absl::AsciiStrToUpper(token);
  for (const char* placeholder : {"REPLACE", "CHANGEME", "PLACEHOLDER", "EXAMPLE"}) {
    if (absl::StrContains(upper, placeholder)) {
      return absl::InvalidArgumentError(
          absl::StrCat("a token holds placeholder text ('", placeholder,
                       "'): replace it with a random one (openssl rand -hex 32)"));
    }
  }
  absl::flat_hash_set<char> distinct(token.begin(), token.end());
  if (distinct.size() < kMinTokenDistinctChars) {
    return absl::InvalidArgumentError(
        absl::StrCat("a token must use at least ", kMinTokenDistinctChars,
                     " different characters; make one with: openssl rand -hex 32"));
  }
  if (absl::Status s = CheckTokenCharacters(token); !s.ok()) return s;
  return absl::OkStatus();
}

absl::Status CheckTokenCharacters(absl::string_view token) {
  // RFC 6750's b64token: letters, digits and -._~+/, then '=' padding. Never quotes the token.
  size_t i = 0;
  auto token_char = [](unsigned char c) {
    return absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || c == '+' ||
           c == '/';
  };
  while (i < token.size() && token_char(static_cast<unsigned char>(token[i]))) ++i;
  while (i < token.size() && token[i] == '=') ++i;
  if (i == token.size()) return absl::OkStatus();
  const unsigned char c = static_cast<unsigned char>(token[i]);
  const std::string shown = absl::ascii_isgraph(c)
                                ? absl::StrCat("'", std::string(1, static_cast<char>(c)), "'")
                                : absl::StrFormat("byte 0x%02x", c);
  return absl::InvalidArgumentError(absl::StrCat(
      "a token is letters, digits and -._~+/ with '=' padding at its end (RFC 6750); this one has ",
      shown, " at position ", i, " of ", token.size(),
      c == ',' || c == ';' || c == ':' ? " (the separator before a tenant is whitespace)" : ""));
}

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::FromString(
    absl::string_view contents) {
  auto a = std::unique_ptr<TokenAuthenticator>(new TokenAuthenticator());
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> parts =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.size() > 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_no, ": expected 'token' or 'token tenant', got ", parts.size(), " fields"));
    }
    if (absl::Status s = CheckTokenStrength(parts[0]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": ", s.message()));
    }
    const std::string tenant = parts.size() == 2 ? std::string(parts[1]) : "default";
    for (char c : tenant) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
        return absl::InvalidArgumentError(absl::StrCat(
            "line ", line_no, ": a tenant name is letters, digits, '-', '_' and '.' only"));
      }
    }
    if (!a->tenants_.emplace(std::string(parts[0]), tenant).second) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": duplicate token"));
    }
  }
  if (a->tenants_.empty())
    return absl::InvalidArgumentError("no tokens (every line is empty or a comment)");
  return a;
}

absl::StatusOr<std::string> TokenAuthenticator::TenantForToken(absl::string_view token) const {
  auto it = tenants_.find(token);
  if (it == tenants_.end()) return absl::UnauthenticatedError("invalid bearer token");
  return it->second;
}

absl::StatusOr<std::string> TokenAuthenticator::Authenticate(
    const grpc::ServerContextBase& ctx) const {
  std::vector<absl::string_view> values;
  const auto [first, last] = ctx.client_metadata().equal_range("authorization");
  for (auto it = first; it != last; ++it) values.emplace_back(it->second.data(), it->second.size());
  return AuthenticateValues(values);
}

absl::StatusOr<std::string> TokenAuthenticator::AuthenticateValues(
    const std::vector<absl::string_view>& authorization) const {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  // Two credentials are refused, not resolved by their order.
  if (authorization.size() > 1) {
    return absl::UnauthenticatedError(
        "more than one 'authorization' metadata entry: send exactly one 'Bearer <token>'");
  }
  absl::string_view value = authorization[0];
  // The scheme is case-insensitive (RFC 9110), then at least one space.
  constexpr absl::string_view kScheme = "bearer";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme) ||
      value[kScheme.size()] != ' ') {
    return absl::UnauthenticatedError("authorization metadata must be 'Bearer <token>'");
  }
  value.remove_prefix(kScheme.size());
  return TenantForToken(absl::StripAsciiWhitespace(value));
}

size_t TokenAuthenticator::num_tenants() const {
  absl::flat_hash_set<std::string> t;
  for (const auto& [token, tenant] : tenants_) t.insert(tenant);
  return t.size();
}

bool PathNeedsToken(absl::string_view path) {
  return !absl::StartsWith(path, "/grpc.health.v1.Health/") &&
         !absl::StartsWith(path, "/grpc.reflection.");
}

grpc::Status TokenAuthProcessor::Process(const InputMetadata& metadata, grpc::AuthContext* context,
                                         OutputMetadata*, OutputMetadata*) {
  const auto path = metadata.find(":path");
  // gRPC always sends the path; without one the handlers decide.
  if (path == metadata.end()) return grpc::Status::OK;
  const absl::string_view p(path->second.data(), path->second.size());
  if (!PathNeedsToken(p)) return grpc::Status::OK;
  std::vector<absl::string_view> values;
  const auto [first, last] = metadata.equal_range("authorization");
  for (auto it = first; it != last; ++it) values.emplace_back(it->second.data(), it->second.size());
  const absl::StatusOr<std::string> tenant = auth_->AuthenticateValues(values);
  if (tenant.ok()) return grpc::Status::OK;
  if (refused_) {
    std::string who;
    if (context != nullptr) {
      for (const grpc::string_ref& cn : context->FindPropertyValues("x509_common_name")) {
        absl::StrAppend(
            &who, "client certificate CN=",
            absl::CHexEscape(absl::string_view(cn.data(), std::min<size_t>(cn.size(), 64))), " ");
      }
    }
    const auto agent = metadata.find("user-agent");
    if (agent != metadata.end()) {
      absl::StrAppend(&who, "user-agent=",
                      absl::CHexEscape(absl::string_view(
                          agent->second.data(), std::min<size_t>(agent->second.size(), 64))));
    }
    // The call's request id (x-request-id, as the handlers' lines carry it: req=).
    const auto id = metadata.find(kRequestIdKey);
    if (id != metadata.end()) {
      absl::StrAppend(
          &who, who.empty() ? "" : " ",
          "req=", ForLog(absl::string_view(id->second.data(), id->second.size()), LogText::kField));
    }
    refused_(p, tenant.status(), who);
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(tenant.status().message()));
}

}  // namespace pagedattn
