// DeviceRegion over the CUDA runtime.
#include "client/device_region.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace pagedattn {
namespace {

absl::Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::Status InRange(size_t offset, size_t n, size_t size) {
  if (offset > size || n > size - offset) {
    return absl::OutOfRangeError(
        absl::StrCat(n, " bytes at offset ", offset, " run past the region's ", size, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRegion>> DeviceRegion::Allocate(int device, size_t bytes) {
  if (absl::Status s = Cuda(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  void* data = nullptr;
  if (absl::Status s = Cuda(cudaMalloc(&data, bytes), "cudaMalloc"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  if (absl::Status s = Cuda(cudaIpcGetMemHandle(&handle, data), "cudaIpcGetMemHandle"); !s.ok()) {
    cudaFree(data);
    return s;
  }
  return std::unique_ptr<DeviceRegion>(
      new DeviceRegion(device, static_cast<char*>(data), bytes,
                       std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
}

DeviceRegion::~DeviceRegion() {
  cudaSetDevice(device_);
  cudaFree(data_);
}

absl::Status DeviceRegion::Write(size_t offset, const void* src, size_t n) {
  if (absl::Status s = InRange(offset, n, size_); !s.ok()) return s;
  return Cuda(cudaMemcpy(data_ + offset, src, n, cudaMemcpyHostToDevice), "cudaMemcpy(write)");
}

absl::Status DeviceRegion::Read(size_t offset, void* dst, size_t n) const {
  if (absl::Status s = InRange(offset, n, size_); !s.ok()) return s;
  return Cuda(cudaMemcpy(dst, data_ + offset, n, cudaMemcpyDeviceToHost), "cudaMemcpy(read)");
}

absl::Status DeviceRegion::Fill(size_t offset, int byte, size_t n) {
  if (absl::Status s = InRange(offset, n, size_); !s.ok()) return s;
  if (absl::Status s = Cuda(cudaMemset(data_ + offset, byte, n), "cudaMemset"); !s.ok()) return s;
  return Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

absl::StatusOr<std::unique_ptr<IpcEvent>> IpcEvent::Create(int device) {
  if (absl::Status s = Cuda(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  cudaEvent_t event = nullptr;
  if (absl::Status s =
          Cuda(cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
               "cudaEventCreate");
      !s.ok()) {
    return s;
  }
  cudaIpcEventHandle_t handle;
  if (absl::Status s = Cuda(cudaIpcGetEventHandle(&handle, event), "cudaIpcGetEventHandle");
      !s.ok()) {
    cudaEventDestroy(event);
    return s;
  }
  return std::unique_ptr<IpcEvent>(
      new IpcEvent(event, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
}

IpcEvent::~IpcEvent() { cudaEventDestroy(static_cast<cudaEvent_t>(event_)); }

absl::Status IpcEvent::Record(void* stream) {
  return Cuda(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)),
              "cudaEventRecord");
}

absl::Status IpcEvent::Synchronize() const {
  return Cuda(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "cudaEventSynchronize");
}

absl::Status IpcEvent::StreamWait(void* stream) const {
  return Cuda(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0),
      "cudaStreamWaitEvent");
}

absl::Status DeviceRegion::Synchronize() const {
  if (absl::Status s = Cuda(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  return Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace pagedattn
