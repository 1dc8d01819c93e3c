// Translation between pagedattn.v1 messages and the core's plain structs. No logic beyond
// field mapping: validation lives in the core.
#pragma once

#include "pagedattn/v1/attention.pb.h"
#include "server/core/cache.h"
#include "server/core/cache_config.h"

namespace pagedattn {

CacheConfigRequest FromProto(const v1::CacheConfig& config);
void ToProto(const CacheGeometry& geometry, v1::CacheConfig* out);
void ToProto(const Cache& cache, v1::CacheInfo* out);
void ToProto(const ValidationResult& result, v1::ValidateCacheConfigResponse* out);

}  // namespace pagedattn
