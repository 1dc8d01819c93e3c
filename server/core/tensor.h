// TensorView: a non-owning view of a request tensor (dtype, shape, raw bytes) and the
// check that it has exactly the expected dtype class, shape and byte length.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/capabilities.h"

namespace pagedattn {

struct TensorView {
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t size_bytes = 0;

  // A tensor that was not sent at all (no dtype, no shape, no bytes).
  bool empty() const { return dtype == DType::kUnspecified && shape.empty() && size_bytes == 0; }
};

// A received shape for an error message: at most its first 8 dims, so that a hostile shape
// cannot make the message (and the status metadata that carries it) arbitrarily long.
inline std::string ShapeString(const std::vector<int64_t>& shape) {
  constexpr size_t kMaxDims = 8;
  if (shape.size() <= kMaxDims) return absl::StrJoin(shape, ", ");
  return absl::StrCat(absl::StrJoin(shape.begin(), shape.begin() + kMaxDims, ", "), ", ... (",
                      shape.size(), " dims)");
}

// OK when t has an I/O dtype, exactly `expected` as shape and prod(shape)*sizeof(dtype) bytes.
// `expected_names` names each dimension for the error message.
inline absl::Status CheckTensor(absl::string_view name, const TensorView& t,
                                const std::vector<int64_t>& expected,
                                absl::string_view expected_names) {
  if (!IsSupportedIoDType(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".dtype must be FLOAT32, FLOAT16 or BFLOAT16 (got ",
        DTypeSize(t.dtype) > 0 ? std::string(DTypeName(t.dtype))
                               : absl::StrCat(static_cast<int>(t.dtype),
                                              t.dtype == DType::kUnspecified ? " = unset" : ""),
        ")"));
  }
  if (t.shape != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shape must be [", absl::StrJoin(expected, ", "), "] = [",
                     expected_names, "] (got [", ShapeString(t.shape), "])"));
  }
  // The expected dims are bounded by validated config values, so the product cannot overflow.
  int64_t elems = 1;
  for (int64_t d : expected) elems *= d;
  const int64_t want = elems * DTypeSize(t.dtype);
  if (static_cast<int64_t>(t.size_bytes) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".data must hold ", want, " bytes (", elems, " x ", DTypeName(t.dtype),
                     " of ", DTypeSize(t.dtype), " bytes) for shape [",
                     absl::StrJoin(expected, ", "), "] (got ", t.size_bytes, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace pagedattn
