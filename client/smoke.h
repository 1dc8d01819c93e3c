// The smoke check behind `pagedattn-cli smoke`: a mixed prefill / chunked prefill / decode
// batch of random data through a real server, checked against the float64 reference.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace pagedattn {

struct SmokeOptions {
  int32_t head_dim = 128;
  int32_t page_size = 16;
  int32_t num_q_heads = 8;
  int32_t num_kv_heads = 2;
  v1::DType kv_dtype = v1::BFLOAT16;
  // FLOAT8_E4M3's scaling (unset: PER_TOKEN) and STATIC's scales: 2 values, or per layer, of
  // which the smoke cache's two layers take the first 4. Its K/V are standard normal: STATIC
  // scales near 4.5 / 448 = 0.01 fit them.
  v1::KvScaling kv_scaling = v1::KV_SCALING_UNSPECIFIED;
  std::vector<float> kv_scales;
  // The layers' attention variants (pagedattn.v1.LayerAttention): none, one for both of the
  // smoke cache's layers, or one each; checked against the reference like plain attention.
  std::vector<v1::LayerAttention> layers;
  v1::DType q_dtype = v1::FLOAT32;
  int32_t device = 0;  // The GPU (or CPU device) the smoke's cache lives on.
  uint64_t seed = 1;
};

struct SmokeReport {
  bool passed = false;
  double max_rel_error = 0;  // Worst ||out-ref||/||ref|| over the spans checked.
  double max_lse_error = 0;  // Worst |lse-ref| over all queries and heads.
  double tolerance = 0;
  int forwards = 0;
  int spans_checked = 0;
  std::string cache_id;
  std::string summary;  // One line per Forward.
};

// Creates a cache, runs four Forwards (mixed prefill, decode, chunked prefill, a rewind),
// checks every output, releases, deletes the cache. Transport errors are returned as status;
// a wrong answer is a report with passed=false.
absl::StatusOr<SmokeReport> RunSmoke(Client& client, const SmokeOptions& options);

}  // namespace pagedattn
