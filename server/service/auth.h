// Caller identity: the tenant a request acts for. Without token auth every caller is the
// anonymous tenant "".
#pragma once

#include <string>

#include <grpcpp/server_context.h>

namespace pagedattn {

// Auth-context property that carries the authenticated tenant.
inline constexpr char kTenantProperty[] = "pagedattn-tenant";

inline std::string TenantOf(const grpc::ServerContext& ctx) {
  auto values = ctx.auth_context() ? ctx.auth_context()->FindPropertyValues(kTenantProperty)
                                   : std::vector<grpc::string_ref>{};
  if (values.empty()) return "";
  return std::string(values.front().data(), values.front().size());
}

}  // namespace pagedattn
