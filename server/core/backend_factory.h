// Picks and creates the backend: "cuda", "cpu", or "auto" (CUDA when this build has it and a
// GPU is visible, CPU otherwise).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/core/backend.h"

namespace pagedattn {

// True when this binary was built with the CUDA backend.
bool BuiltWithCuda();

struct BackendOptions {
  // "auto", "cuda" or "cpu". "cuda" fails with FAILED_PRECONDITION (saying why) when the build
  // has no CUDA or no GPU is visible.
  std::string backend = "auto";
  int cpu_threads = 0;  // CPU backend workers (0: one per hardware thread)
  // CUDA only: "auto" (the Hopper wgmma kernel where the build and the GPU have it, the
  // portable one elsewhere) or "portable"; anything else is INVALID_ARGUMENT.
  std::string prefill_kernel = "auto";
  bool graph_launch = true;  // CUDA only: CudaBackendOptions::graph_launch
};

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options);

}  // namespace pagedattn
