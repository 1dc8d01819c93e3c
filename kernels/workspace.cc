// ForwardWorkspace: pinned and device buffers that grow to the largest Forward, and the one
// upload and one download of each Forward.
#include "kernels/workspace.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace pagedattn::kernels {
namespace {

LaunchStatus CudaError(const std::string& what, cudaError_t err) {
  return LaunchStatus::CudaError(what + ": " + cudaGetErrorName(err) + " (" +
                                 cudaGetErrorString(err) + ")");
}

enum Memory { kPinned, kDevice };

// Grows *buffer (*bytes of it) to hold `want` bytes, at least doubling so that growth is
// amortized; its contents are not kept.
template <typename T>
LaunchStatus Grow(Memory where, T** buffer, size_t* bytes, size_t want, const char* what) {
  if (want <= *bytes) return LaunchStatus::Ok();
  const size_t n = std::max(want, 2 * *bytes);
  if (*buffer != nullptr) {
    const cudaError_t err = where == kPinned ? cudaFreeHost(*buffer) : cudaFree(*buffer);
    if (err != cudaSuccess) return CudaError(std::string("freeing the ") + what, err);
  }
  *buffer = nullptr;
  *bytes = 0;
  void* p = nullptr;
  const cudaError_t err = where == kPinned ? cudaMallocHost(&p, n) : cudaMalloc(&p, n);
  if (err != cudaSuccess) {
    return CudaError(std::string(where == kPinned ? "cudaMallocHost(" : "cudaMalloc(") +
                         std::to_string(n) + " bytes of " + what + ")",
                     err);
  }
  *buffer = static_cast<T*>(p);
  *bytes = n;
  return LaunchStatus::Ok();
}

}  // namespace

ForwardWorkspace::~ForwardWorkspace() {
  if (host_) cudaFreeHost(host_);
  if (device_) cudaFree(device_);
  if (counters_) cudaFree(counters_);
}

LaunchStatus ForwardWorkspace::Reserve(const AttentionPlan& plan, cudaStream_t stream) {
  const ForwardStaging& st = plan.staging();
  if (LaunchStatus s = Grow(kPinned, &host_, &host_bytes_, st.results_end, "pinned Forward image");
      !s.ok()) {
    return s;
  }
  if (LaunchStatus s = Grow(kDevice, &device_, &device_bytes_, st.device_bytes, "Forward scratch");
      !s.ok()) {
    return s;
  }
  const size_t counter_bytes = st.merge_counters * sizeof(int32_t);
  if (counter_bytes > counter_bytes_) {
    if (LaunchStatus s =
            Grow(kDevice, &counters_, &counter_bytes_, counter_bytes, "split-KV counters");
        !s.ok()) {
      return s;
    }
    if (cudaError_t err = cudaMemsetAsync(counters_, 0, counter_bytes_, stream);
        err != cudaSuccess) {
      return CudaError("cudaMemsetAsync(split-KV counters)", err);
    }
  }
  return LaunchStatus::Ok();
}

LaunchStatus ForwardWorkspace::Upload(const AttentionPlan& plan, cudaStream_t stream) {
  if (cudaError_t err = cudaMemcpyAsync(device_, host_, plan.staging().upload_bytes,
                                        cudaMemcpyHostToDevice, stream);
      err != cudaSuccess) {
    return CudaError("cudaMemcpyAsync(Forward inputs)", err);
  }
  return LaunchStatus::Ok();
}

LaunchStatus ForwardWorkspace::Download(const AttentionPlan& plan, cudaStream_t stream) {
  const ForwardStaging& st = plan.staging();
  if (st.out_bytes == 0) return LaunchStatus::Ok();
  const size_t bytes = (st.lse_bytes > 0 ? st.lse + st.lse_bytes : st.out + st.out_bytes) - st.out;
  if (cudaError_t err =
          cudaMemcpyAsync(host_ + st.out, device_ + st.out, bytes, cudaMemcpyDeviceToHost, stream);
      err != cudaSuccess) {
    return CudaError("cudaMemcpyAsync(Forward results)", err);
  }
  return LaunchStatus::Ok();
}

void ForwardWorkspace::ReadResults(const AttentionPlan& plan, void* out, float* lse) const {
  const ForwardStaging& st = plan.staging();
  if (st.out_bytes > 0) std::memcpy(out, host_ + st.out, st.out_bytes);
  if (st.lse_bytes > 0 && lse != nullptr) std::memcpy(lse, host_ + st.lse, st.lse_bytes);
}

}  // namespace pagedattn::kernels
