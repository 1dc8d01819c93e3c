// The CUDA backend: K/V pools in device memory (plain cudaMalloc), Forward through the
// kernels in kernels/ (append, paged attention), staged through pinned buffers on a stream.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/backend.h"

namespace pagedattn {
namespace kernels {
class Launcher;
}  // namespace kernels

// GPUs visible to this process; 0 when there is no driver or no GPU, and then, where why is
// given, the CUDA runtime's reason (and CUDA_VISIBLE_DEVICES, when set). Never throws or aborts.
int CudaDeviceCount(std::string* why = nullptr);

struct CudaBackendOptions {
  // Prefill tiles always run on the portable (mma.sync) kernel, never the Hopper (wgmma) one.
  bool portable_prefill = false;
  // false: every kernel by a plain launch instead of through a cached CUDA graph
  // (kernels/launch.h), and no Forward as one graph. Each backend has its own kernels::Launcher
  // with this setting.
  bool graph_launch = true;
  // A Forward's upload, and then its kernels, download and event records, as two cached CUDA
  // graphs (kernels/submission.h), not a runtime call each. Needs graph_launch.
  bool forward_graph = true;
};

// "major.minor" of a device ("9.0"); empty when it cannot be read.
std::string ComputeCapability(int device);
// The GPU code this build carries: "sm_80", "compute_80", "sm_90a", ...
std::vector<std::string> CudaBuildArchitectures();

// The CUDA backend over every visible GPU (a cache picks one through CacheGeometry::device).
// FAILED_PRECONDITION when no GPU is visible.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options = {});

// The kernel launcher of a backend CreateCudaBackend made (its graph setting and launch counts,
// for tests); null for any other backend.
const kernels::Launcher* CudaLauncherOf(const Backend& backend);
// Forwards a backend CreateCudaBackend made submitted as one graph (for tests); -1 for any other.
int64_t CudaForwardGraphsOf(const Backend& backend);

}  // namespace pagedattn
