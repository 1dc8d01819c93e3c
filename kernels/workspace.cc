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
// amortized (or `want` alone where the doubled size does not fit); of its contents the first
// `keep` bytes are kept (pinned memory only). Memory that is not there is OutOfMemory, with what
// was asked and, for the device, what it has free.
template <typename T>
LaunchStatus Grow(Memory where, T** buffer, size_t* bytes, size_t want, const char* what,
                  uint64_t* generation, size_t keep = 0) {
  if (want <= *bytes) return LaunchStatus::Ok();
  void* p = nullptr;
  cudaError_t err = cudaErrorMemoryAllocation;
  size_t n = std::max(want, 2 * *bytes);
  for (;;) {
    err = where == kPinned ? cudaMallocHost(&p, n) : cudaMalloc(&p, n);
    if (err != cudaErrorMemoryAllocation || n == want) break;
    cudaGetLastError();  // not sticky: clear it
    n = want;
  }
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
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
  if (err != cudaSuccess) {
    return CudaError(std::string(where == kPinned ? "cudaMallocHost(" : "cudaMalloc(") +
                         std::to_string(n) + " bytes of " + what + ")",
                     err);
  }
  if (*buffer != nullptr) {
    if (where == kPinned && keep > 0) std::memcpy(p, *buffer, std::min(keep, *bytes));
    const cudaError_t free_err = where == kPinned ? cudaFreeHost(*buffer) : cudaFree(*buffer);
    if (free_err != cudaSuccess) {
      if (where == kPinned)
        cudaFreeHost(p);
      else
        cudaFree(p);
      return CudaError(std::string("freeing the ") + what, free_err);
    }
  }
  *buffer = static_cast<T*>(p);
  *bytes = n;
  ++*generation;
  return LaunchStatus::Ok();
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
  if (LaunchStatus s =
          Grow(kPinned, &host_, &host_bytes_, inputs.end, "pinned Forward image", &generation_);
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
  if (LaunchStatus s = Grow(kPinned, &host_, &host_bytes_, st.results_end, "pinned Forward image",
                            &generation_, keep);
      !s.ok()) {
    return s;
  }
  if (LaunchStatus s =
          Grow(kDevice, &device_, &device_bytes_, st.device_bytes, "Forward scratch", &generation_);
      !s.ok()) {
    return s;
  }
  const size_t counter_bytes = st.merge_counters * sizeof(int32_t);
  if (counter_bytes > counter_bytes_) {
    if (LaunchStatus s = Grow(kDevice, &counters_, &counter_bytes_, counter_bytes,
                              "split-KV counters", &generation_);
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
