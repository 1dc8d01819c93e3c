// LaunchStatus: what a kernel launcher returns. Kernel code stays free of absl; the CUDA
// backend maps a failed LaunchStatus to an absl::Status (unsupported -> INVALID_ARGUMENT, out of
// memory -> RESOURCE_EXHAUSTED, a CUDA error -> INTERNAL).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

namespace pagedattn::kernels {

class LaunchStatus {
 public:
  enum class Code { kOk, kUnsupported, kOutOfMemory, kCudaError };

  LaunchStatus() = default;
  static LaunchStatus Ok() { return LaunchStatus(); }
  static LaunchStatus Unsupported(std::string message) {
    return LaunchStatus(Code::kUnsupported, std::move(message));
  }
  static LaunchStatus OutOfMemory(std::string message) {
    return LaunchStatus(Code::kOutOfMemory, std::move(message));
  }
  static LaunchStatus CudaError(std::string message) {
    return LaunchStatus(Code::kCudaError, std::move(message));
  }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  LaunchStatus(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

}  // namespace pagedattn::kernels
