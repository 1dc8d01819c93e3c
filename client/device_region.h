// DeviceRegion: a device allocation of the client's process that a pagedattn server on the same
// node reads q/k/v from and writes out/lse into, in place (RegisterMemory, CUDA IPC). The
// caller's own kernels write and read it like any device memory; Write/Read are for tests and
// tools. Built only with CUDA (pagedattn_client_cuda).
//
//   auto region = *DeviceRegion::Allocate(/*device=*/0, 64 << 20);
//   auto registered = *client->RegisterMemory(cache_id, region->ipc_handle(), region->size());
//   call.q = TensorArg::Device(v1::BFLOAT16, {n, 32, 128}, registered.region_id(), q_offset);
//   ... call.k, call.v, call.out (and call.lse) likewise; then client->ForwardTensors(call, {}).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pagedattn {

class DeviceRegion {
 public:
  // cudaMalloc of `bytes` on `device`.
  static absl::StatusOr<std::unique_ptr<DeviceRegion>> Allocate(int device, size_t bytes);
  ~DeviceRegion();  // cudaFree: unregister it first (or let the server's lease release it)
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  // The cudaIpcMemHandle_t of the allocation, as RegisterMemory takes it.
  const std::string& ipc_handle() const { return handle_; }

  // Synchronous copies between host memory and [offset, offset + n) of the region.
  absl::Status Write(size_t offset, const void* src, size_t n);
  absl::Status Read(size_t offset, void* dst, size_t n) const;
  // Sets [offset, offset + n) to `byte`.
  absl::Status Fill(size_t offset, int byte, size_t n);
  // Waits for the device's work: what a caller does after its kernels wrote q/k/v and before
  // the Forward that reads them.
  absl::Status Synchronize() const;

 private:
  DeviceRegion(int device, char* data, size_t size, std::string handle)
      : device_(device), data_(data), size_(size), handle_(std::move(handle)) {}
  int device_;
  char* data_;
  size_t size_;
  std::string handle_;
};

// An event of the client's process the server can wait on and record (DeviceSync): created
// with cudaEventInterprocess | cudaEventDisableTiming; register its ipc_handle() with the memory.
class IpcEvent {
 public:
  static absl::StatusOr<std::unique_ptr<IpcEvent>> Create(int device);
  ~IpcEvent();
  IpcEvent(const IpcEvent&) = delete;
  IpcEvent& operator=(const IpcEvent&) = delete;

  const std::string& ipc_handle() const { return handle_; }
  void* event() const { return event_; }  // the cudaEvent_t
  // Records it on `stream` (a cudaStream_t; null: the legacy default stream).
  absl::Status Record(void* stream = nullptr);
  // Waits on the host until the work it was last recorded after (by either side) is done.
  absl::Status Synchronize() const;
  // Makes `stream`'s later work wait for it (null: the legacy default stream).
  absl::Status StreamWait(void* stream = nullptr) const;

 private:
  IpcEvent(void* event, std::string handle) : event_(event), handle_(std::move(handle)) {}
  void* event_;
  std::string handle_;
};

}  // namespace pagedattn
