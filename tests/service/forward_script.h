// The script of Forwards the data-plane tests run through every path (unary protobuf, unary
// zero-copy, the Step stream, device tensors over CUDA IPC): mixed prefill / chunked / decode
// batches, rewinds, and errors in between that must change nothing. Every path must give
// bit-identical answers and the same errors.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"

namespace pagedattn::forward_script {

constexpr int kLayers = 2, kHeads = 8, kKvHeads = 2, kHeadDim = 64;

// One Forward of the script: spans, layer, and whether it must fail (with which code).
struct Case {
  int32_t layer;
  std::vector<wire::SpanRef> spans;  // seq, start, new, queries
  absl::StatusCode want = absl::StatusCode::kOk;
  bool bad_q_shape = false;
};

// The script: every kind of span, errors in between (which must change nothing), rewinds.
inline std::vector<Case> Script() {
  using C = absl::StatusCode;
  return {
      {0, {{1, 0, 37, 37}, {2, 0, 19, 19}}},
      {1, {{1, 0, 37, 37}, {2, 0, 19, 19}}},
      {0, {{1, 37, 1, 1}, {2, 19, 13, 13}, {3, 0, 5, 5}}},
      {0, {{1, 40, 1, 1}}, C::kFailedPrecondition},     // a gap
      {0, {{9, 5, 0, 1}}, C::kNotFound},                // attend an unknown sequence
      {1, {{1, 37, 1, 1}}, C::kInvalidArgument, true},  // q of the wrong shape
      {0, {{4, 0, 600, 600}}, C::kResourceExhausted},   // more pages than the pool has
      {1, {{1, 37, 1, 1}, {2, 19, 13, 13}, {3, 0, 5, 5}}},
      {0, {{1, 30, 3, 3}, {2, 32, 0, 4}, {3, 5, 0, 2}}},  // rewind, attend-only spans
      {1, {{1, 38, 2, 2}, {3, 5, 1, 1}}},
      {0, {{1, 33, 1, 1}, {3, 5, 1, 1}}},
  };
}

// Deterministic tensors of a case (the same for every path).
struct Tensors {
  std::string q, k, v;
  std::vector<int64_t> q_shape, kv_shape;
};
inline Tensors MakeTensors(const Case& c, uint64_t seed) {
  int64_t queries = 0, tokens = 0;
  for (const wire::SpanRef& s : c.spans) {
    queries += s.num_queries;
    tokens += s.num_new_tokens;
  }
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  auto bf16 = [&](int64_t n) {
    std::string bytes(static_cast<size_t>(n) * 2, '\0');
    for (int64_t i = 0; i < n; ++i) {
      const float f = d(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      const uint16_t h = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    return bytes;
  };
  Tensors t;
  t.q_shape = {queries, kHeads, kHeadDim};
  if (c.bad_q_shape) t.q_shape = {queries, kHeads + 1, kHeadDim};
  t.q = bf16(t.q_shape[0] * t.q_shape[1] * t.q_shape[2]);
  t.kv_shape = {tokens, kKvHeads, kHeadDim};
  t.k = bf16(tokens * kKvHeads * kHeadDim);
  t.v = bf16(tokens * kKvHeads * kHeadDim);
  return t;
}

inline ForwardCall CallOf(const std::string& cache, const Case& c, const Tensors& t) {
  ForwardCall call;
  call.cache_id = cache;
  call.layer = c.layer;
  call.spans = c.spans;
  call.options.return_lse = true;
  call.q = TensorArg::Host(v1::BFLOAT16, t.q_shape, t.q.data(), t.q.size());
  if (t.kv_shape[0] > 0) {
    call.k = TensorArg::Host(v1::BFLOAT16, t.kv_shape, t.k.data(), t.k.size());
    call.v = TensorArg::Host(v1::BFLOAT16, t.kv_shape, t.v.data(), t.v.size());
  }
  return call;
}

}  // namespace pagedattn::forward_script
