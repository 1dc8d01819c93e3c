// Picks and creates the backend: CUDA, CPU, or auto (CUDA when this build has it and every
// visible GPU can run its kernels, CPU otherwise, saying why).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/backend.h"

namespace pagedattn {

// True when this binary was built with the CUDA backend.
bool BuiltWithCuda();
// The GPU code this binary carries ("sm_80", "compute_80", "sm_90a", ...; machine code and PTX
// the driver compiles for newer GPUs); empty without CUDA. Whatever backend runs.
std::vector<std::string> BuiltCudaArchitectures();

enum class BackendChoice { kAuto, kCuda, kCpu };
// Which CUDA prefill kernel runs: kAuto (the Hopper wgmma kernel where the build and the GPU
// have it, the portable one elsewhere) or kPortable (always the portable one).
enum class PrefillKernel { kAuto, kPortable };

struct BackendOptions {
  // kCuda fails with FAILED_PRECONDITION (saying why) when the build has no CUDA, no GPU is
  // visible, or a visible GPU cannot run this build's kernels.
  BackendChoice backend = BackendChoice::kAuto;
  int cpu_threads = 0;             // CPU backend workers (0: one per hardware thread).
  int64_t cpu_reserved_bytes = 0;  // CPU backend: host memory kept out of pools.
  PrefillKernel prefill_kernel = PrefillKernel::kAuto;  // CUDA only.
  bool graph_launch = true;                             // CUDA only: CudaBackendOptions.
  bool forward_graph = true;                            // CUDA only: CudaBackendOptions.
};

struct CreatedBackend {
  std::unique_ptr<Backend> backend;
  // Set when kAuto fell back to the CPU although the build has CUDA: why (for a warning).
  std::string fallback_reason;
};

absl::StatusOr<CreatedBackend> CreateBackend(const BackendOptions& options);

}  // namespace pagedattn
