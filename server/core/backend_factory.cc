// Backend selection; the only file that knows both backends.
#include "server/core/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "server/core/cpu_backend.h"
#if PAGEDATTN_WITH_CUDA
#include "server/core/cuda_backend.h"
#endif

namespace pagedattn {

bool BuiltWithCuda() { return PAGEDATTN_WITH_CUDA != 0; }

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options) {
  const std::string& choice = options.backend;
  if (options.prefill_kernel != "auto" && options.prefill_kernel != "portable") {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_kernel must be one of auto, portable (got '", options.prefill_kernel, "')"));
  }
  if (choice == "cpu") return std::make_unique<CpuBackend>(options.cpu_threads);
  if (choice != "auto" && choice != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend must be one of auto, cuda, cpu (got '", choice, "')"));
  }
#if PAGEDATTN_WITH_CUDA
  if (CudaDeviceCount() > 0) {
    return CreateCudaBackend({.portable_prefill = options.prefill_kernel == "portable",
                              .graph_launch = options.graph_launch});
  }
  if (choice == "cuda") {
    return absl::FailedPreconditionError(
        "--backend=cuda but no CUDA GPU is visible to this process");
  }
#else
  if (choice == "cuda") {
    return absl::FailedPreconditionError(
        "--backend=cuda but this binary was built without CUDA (no nvcc at build time)");
  }
#endif
  return std::make_unique<CpuBackend>(options.cpu_threads);
}

}  // namespace pagedattn
