// Per-device facts the launchers keep for the whole process, so that a launch asks the runtime
// nothing it already answered (host time before a launch is the GPU's when the GPU is idle).
#pragma once

#include <cuda_runtime_api.h>

namespace pagedattn::kernels {

// Devices a per-device cache keeps an entry for; a device past these is asked every time.
inline constexpr int kMaxDevices = 64;

// cudaGetDeviceCount, asked once (-1 if it failed).
inline int CudaDeviceCountOnce() {
  static const int count = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : -1;
  }();
  return count;
}

}  // namespace pagedattn::kernels
