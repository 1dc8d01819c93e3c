// CacheConfig validation: every rule a cache must satisfy, checked once, at allocation time,
// against the capability table (common/capabilities.h) and the memory actually free.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/core/backend.h"

namespace pagedattn {

// One layer's attention options as requested (pagedattn.v1.LayerAttention).
struct LayerAttentionRequest {
  std::optional<int32_t> sliding_window;
  std::optional<float> logit_softcap;
  std::vector<float> sinks;
};

// A cache configuration as requested, before defaults are resolved.
struct CacheConfigRequest {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  DType kv_dtype = DType::kUnspecified;
  std::optional<int64_t> num_pages;  // Exactly one of num_pages / max_bytes, or neither.
  std::optional<int64_t> max_bytes;
  int32_t device = 0;
  std::vector<LayerAttentionRequest> layers;       // Empty, one (every layer), or num_layers.
  KvScaling kv_scaling = KvScaling::kUnspecified;  // FP8 caches only; unset: kPerToken.
  std::vector<float> kv_scales;                    // kStatic: 2 or 2 * num_layers values.
};

struct FieldViolation {
  std::string field;        // CacheConfig field name.
  std::string description;  // Names the value received and what would be valid.
};

// The environment a config is validated against.
struct ValidationContext {
  BackendKind backend = BackendKind::kCpu;
  int device_count = 1;
  int64_t free_bytes = 0;  // Memory free for pools on the requested device.
  // What free_bytes is, for messages: "free on device 0", or the pool budget that bounds it.
  std::string free_bytes_source = "free";
  // The server's largest message (--max_message_mb), which one query's answer (and its row of
  // q) must fit; 0: no bound.
  int64_t max_message_bytes = 0;
  // Whether the requested device runs a head_dim for a kv_dtype (its kernels' shared memory:
  // an A10's 99 KB a block does not hold head_dim 96's portable prefill tile); unset: every
  // head_dim of the backend's table. Asked only of a config valid otherwise.
  std::function<absl::Status(DType kv_dtype, int head_dim)> device_runs;
};

struct ValidationResult {
  std::vector<FieldViolation> violations;  // Every broken rule; empty when the config is valid.
  CacheGeometry geometry;                  // Resolved config (num_pages set) when no violations.
  int64_t bytes = 0;                       // Pool bytes the config takes.
  int64_t free_bytes = 0;
  bool fits = false;              // bytes <= free_bytes.
  std::string free_bytes_source;  // ValidationContext::free_bytes_source.
  // The field that set the capacity ("num_pages", "max_bytes", or "capacity" for the default):
  // where a pool that does not fit is reported.
  std::string capacity_field = "capacity";
  bool valid() const { return violations.empty(); }
};

// Fraction of free memory a pool with no explicit capacity takes.
inline constexpr double kDefaultPoolFraction = 0.9;

// Checks every rule and resolves capacity. Never allocates.
ValidationResult ValidateCacheConfig(const CacheConfigRequest& config,
                                     const ValidationContext& ctx);

// INVALID_ARGUMENT listing all violations (message and a structured payload), or
// RESOURCE_EXHAUSTED naming bytes asked and free, or OK.
absl::Status ValidationStatus(const ValidationResult& result);

// Payload key of the structured violations in an absl::Status: lines of "field\tdescription".
inline constexpr char kFieldViolationsPayload[] = "type.pagedattn/field_violations";
std::vector<FieldViolation> FieldViolationsFromStatus(const absl::Status& status);

// INVALID_ARGUMENT with `description` as its message and as the one violation of `field`.
absl::Status InvalidFieldError(absl::string_view field, absl::string_view description);

}  // namespace pagedattn
