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
// amortized; of its contents the first `keep` bytes are kept (pinned memory only). Device memory
// keeps nothing: the old buffer goes before the new one is allocated (a peak of the new size,
// not both), and where the doubled size does not fit, `want` alone is tried. Memory that is not
// there is OutOfMemory, with what was asked and what the device has free.
template <typename T>
LaunchStatus Grow(Memory where, T** buffer, size_t* bytes, size_t want, const char* what,
                  size_t keep = 0) {
  if (want <= *bytes) return LaunchStatus::Ok();
  const size_t grown = std::max(want, 2 * *bytes);
  if (where == kDevice && *buffer != nullptr) {
    if (const cudaError_t err = cudaFree(*buffer); err != cudaSuccess) {
      return CudaError(std::string("freeing the ") + what, err);
    }
    *buffer = nullptr;
    *bytes = 0;
  }
  void* p = nullptr;
  cudaError_t err = cudaErrorMemoryAllocation;
  for (const size_t n : {grown, want}) {
    err = where == kPinned ? cudaMallocHost(&p, n) : cudaMalloc(&p, n);
    if (err == cudaSuccess) {
      if (*buffer != nullptr) {  // pinned: its kept bytes, then the old buffer goes
        if (keep > 0) std::memcpy(p, *buffer, std::min(keep, *bytes));
        if (const cudaError_t free_err = cudaFreeHost(*buffer); free_err != cudaSuccess) {
          cudaFreeHost(p);
          return CudaError(std::string("freeing the ") + what, free_err);
        }
      }
      *buffer = static_cast<T*>(p);
      *bytes = n;
      return LaunchStatus::Ok();
    }
    if (err != cudaErrorMemoryAllocation) break;
    cudaGetLastError();  // not sticky: clear it
    if (n == want) break;
  }
  if (err == cudaErrorMemoryAllocation) {
    size_t free_bytes = 0, total_bytes = 0;
    if (where == kDevice) cudaMemGetInfo(&free_bytes, &total_bytes);
    return LaunchStatus::OutOfMemory(
        where == kPinned
            ? "this Forward needs " + std::to_string(want) + " bytes of pinned host memory (" +
                  what + ") and the host has not that much to pin: send fewer tokens a Forward"
            : "this Forward needs " + std::to_string(want) + " bytes of GPU scratch (" + what +
                  ") and the GPU has " + std::to_string(free_bytes) +
                  " bytes free: send fewer tokens a Forward, or leave memory beside the "
                  "caches' pools (a pool of default capacity takes 90% of what is free)");
  }
  return CudaError(std::string(where == kPinned ? "cudaMallocHost(" : "cudaMalloc(") +
                       std::to_string(want) + " bytes of " + what + ")",
                   err);
}

}  // namespace

ForwardWorkspace::~ForwardWorkspace() {
  if (host_) cudaFreeHost(host_);
  if (device_) cudaFree(device_);
  if (counters_) cudaFree(counters_);
  for (cudaEvent_t e : marks_) {
    if (e) cudaEventDestroy(e);
  }
}

LaunchStatus ForwardWorkspace::ReserveInputs(const InputsLayout& inputs) {
  inputs_bytes_ = 0;
  if (LaunchStatus s = Grow(kPinned, &host_, &host_bytes_, inputs.end, "pinned Forward image");
      !s.ok()) {
    return s;
  }
  inputs_bytes_ = inputs.end;
  return LaunchStatus::Ok();
}

LaunchStatus ForwardWorkspace::Reserve(const AttentionPlan& plan, cudaStream_t stream) {
  const ForwardStaging& st = plan.staging();
  const size_t keep = inputs_bytes_;
  inputs_bytes_ = 0;  // one Forward's: the next starts afresh
  if (LaunchStatus s =
          Grow(kPinned, &host_, &host_bytes_, st.results_end, "pinned Forward image", keep);
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

void ForwardWorkspace::Download(const AttentionPlan& plan, Submission& s) const {
  const ForwardStaging& st = plan.staging();
  if (st.out_bytes == 0) return;
  const size_t bytes = (st.lse_bytes > 0 ? st.lse + st.lse_bytes : st.out + st.out_bytes) - st.out;
  s.Copy(host_ + st.out, device_ + st.out, bytes, cudaMemcpyDeviceToHost);
}

LaunchStatus ForwardWorkspace::Mark(MarkPoint point, Submission& s) {
  if (marks_[point] == nullptr) {
    if (cudaError_t err = cudaEventCreate(&marks_[point]); err != cudaSuccess) {
      return CudaError("cudaEventCreate(mark)", err);
    }
  }
  s.Record(marks_[point]);
  return LaunchStatus::Ok();
}

float ForwardWorkspace::Elapsed(MarkPoint from, MarkPoint to) const {
  float ms = 0.f;
  if (marks_[from] == nullptr || marks_[to] == nullptr ||
      cudaEventElapsedTime(&ms, marks_[from], marks_[to]) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0.f;
  }
  return ms;
}

void ForwardWorkspace::ReadResults(const AttentionPlan& plan, void* out, float* lse) const {
  const ForwardStaging& st = plan.staging();
  if (st.out_bytes > 0) std::memcpy(out, host_ + st.out, st.out_bytes);
  if (st.lse_bytes > 0 && lse != nullptr) std::memcpy(lse, host_ + st.lse, st.lse_bytes);
}

}  // namespace pagedattn::kernels
