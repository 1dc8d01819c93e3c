// Backend selection; the only file that knows both backends.
#include "server/core/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "server/core/cpu_backend.h"
#if PAGEDATTN_WITH_CUDA
#include "server/core/cuda_backend.h"
#endif

namespace pagedattn {

bool BuiltWithCuda() { return PAGEDATTN_WITH_CUDA != 0; }

std::vector<std::string> BuiltCudaArchitectures() {
#if PAGEDATTN_WITH_CUDA
  return CudaBuildArchitectures();
#else
  return {};
#endif
}

absl::StatusOr<CreatedBackend> CreateBackend(const BackendOptions& options) {
  CreatedBackend created;
  auto cpu = [&] {
    created.backend = std::make_unique<CpuBackend>(CpuBackendOptions{
        .num_threads = options.cpu_threads, .reserved_bytes = options.cpu_reserved_bytes});
    return std::move(created);
  };
  if (options.backend == BackendChoice::kCpu) return cpu();
#if PAGEDATTN_WITH_CUDA
  std::string no_gpu;
  if (CudaDeviceCount(&no_gpu) == 0) {
    if (options.backend == BackendChoice::kCuda) {
      return absl::FailedPreconditionError(absl::StrCat("--backend=cuda but ", no_gpu));
    }
    created.fallback_reason = std::move(no_gpu);
    return cpu();
  }
  absl::StatusOr<std::unique_ptr<Backend>> cuda =
      CreateCudaBackend({.portable_prefill = options.prefill_kernel == PrefillKernel::kPortable,
                         .graph_launch = options.graph_launch,
                         .forward_graph = options.forward_graph});
  if (cuda.ok()) {
    created.backend = *std::move(cuda);
    return created;
  }
  if (options.backend == BackendChoice::kCuda) return cuda.status();
  created.fallback_reason = std::string(cuda.status().message());
  return cpu();
#else
  if (options.backend == BackendChoice::kCuda) {
    return absl::FailedPreconditionError(
        "--backend=cuda but this binary was built without the CUDA backend (no nvcc at build "
        "time, or configured with -DPAGEDATTN_CUDA=OFF)");
  }
  return cpu();
#endif
}

}  // namespace pagedattn
