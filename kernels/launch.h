// How kernels are launched: through cached CUDA graphs (one kernel node, or two for a dependent
// pair), and with their dynamic shared-memory limit raised once per device.
//
// A plain launch costs about 4 us of host time before the kernel reaches the GPU, a cached graph
// about 1.9 us; when the GPU is idle that time is the GPU's too
// (docs/PERFORMANCE.md#design-decisions).
// So a Launcher keeps, per (device, stream, kernels), a one-node graph of its last launch (per
// kernel pair, a two-node one: LaunchPair): the same grids, shared memory and parameter bytes
// launch the graph as it is; anything else updates the nodes first
// (cudaGraphExecKernelNodeSetParams) and then launches. The kernel runs in full either way; only
// the host's submission path changes. A stream being captured into the caller's own graph gets a
// plain launch (the capture records it).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/launch_status.h"

namespace pagedattn::kernels {

class Submission;

// Devices a per-device cache keeps an entry for; a device past these is asked every time.
inline constexpr int kMaxDevices = 64;

// cudaGetDeviceCount, asked once (-1 if it failed): per-device facts are kept for the whole
// process, so that a launch asks the runtime nothing it already answered.
inline int CudaDeviceCountOnce() {
  static const int count = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : -1;
  }();
  return count;
}

// One kernel of a launch: the __global__ function (taking one parameter, the launch's params
// struct) and its grid, block and dynamic shared memory.
struct KernelLaunch {
  const void* func = nullptr;
  dim3 grid, block;
  size_t smem = 0;
};

// Submits kernels, each taking one parameter (a params struct of params_bytes bytes); `what`
// names the kernel in errors. With graph launches on (the default; the server's
// --graph_launch), through this launcher's cached graphs; otherwise, and on a stream being
// captured, by plain launches. Thread-safe: concurrent Forwards on different streams share one.
// A launcher made over a Submission submits nothing: it records each launch there (the stream
// argument unused), for the caller to submit with the rest of its work (kernels/submission.h).
class Launcher {
 public:
  explicit Launcher(bool graph_launch = true);
  explicit Launcher(Submission* record_into);
  ~Launcher();  // destroys the cached graphs
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  bool graph_launch() const { return graph_launch_; }

  LaunchStatus Launch(const KernelLaunch& kernel, cudaStream_t stream, const void* params,
                      size_t params_bytes, const char* what);
  template <typename Params>
  LaunchStatus Launch(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, const Params& params, const char* what) {
    return Launch({reinterpret_cast<const void*>(kernel), grid, block, smem}, stream, &params,
                  sizeof(Params), what);
  }

  // Launches first, then second, both taking the same parameter, with a programmatic dependency
  // (PDL): second's blocks may be scheduled once every block of first has executed
  // griddepcontrol.launch_dependents (or exited), and second must execute griddepcontrol.wait
  // before it reads anything first wrote (the wait returns once first has completed and its
  // writes are visible). So second's launch and block start-up overlap first's run, and second
  // starts working as soon as first ends. Through a cached two-node graph with a programmatic
  // edge, or, where graph launches are off or the stream is being captured, two launches (the
  // second with cudaLaunchAttributeProgrammaticStreamSerialization).
  LaunchStatus LaunchPair(const KernelLaunch& first, const KernelLaunch& second,
                          cudaStream_t stream, const void* params, size_t params_bytes,
                          const char* what);

  // Submissions so far through a cached graph, and by plain launches (a pair counts once).
  int64_t graph_launches() const { return graph_launches_.load(); }
  int64_t plain_launches() const { return plain_launches_.load(); }

 private:
  struct GraphCache;
  LaunchStatus LaunchKernels(const KernelLaunch* k, int num_nodes, cudaStream_t stream,
                             const void* params, size_t params_bytes, const char* what);

  const bool graph_launch_;
  Submission* const record_into_ = nullptr;
  std::unique_ptr<GraphCache> cache_;
  std::atomic<int64_t> graph_launches_{0};
  std::atomic<int64_t> plain_launches_{0};
};

// One kernel's record of the devices whose shared-memory limit it has raised. Once every
// device has it, a launch asks nothing of the runtime (cudaGetDevice is host time before the
// launch, and the launch's host time is the GPU's when it is idle).
struct SmemLimitFlags {
  std::atomic<bool> device[kMaxDevices] = {};
  std::atomic<int> raised_devices{0};
};

// Raises a kernel's dynamic shared-memory limit to smem, once per device (the limit is a
// per-device attribute; `raised` is the kernel's own flags). `what` names it in errors.
template <typename Kernel>
LaunchStatus RaiseSmemLimitOnce(Kernel kernel, size_t smem, SmemLimitFlags& raised,
                                const char* what) {
  if (raised.raised_devices.load() == CudaDeviceCountOnce()) return LaunchStatus::Ok();
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess && (device >= kMaxDevices || !raised.device[device].load())) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err == cudaSuccess && device < kMaxDevices && !raised.device[device].exchange(true)) {
      raised.raised_devices.fetch_add(1);
    }
  }
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("cudaFuncSetAttribute(") + what +
                                   "): " + cudaGetErrorString(err));
  }
  return LaunchStatus::Ok();
}

// The dynamic shared memory a launch of blocks that need `smem` bytes asks for so that at most
// blocks_per_sm of them fit an SM of the current device: smem, or enough more that one block
// more would not fit (AttentionWork::decode_blocks_per_sm).
LaunchStatus SmemForBlocksPerSm(size_t smem, int blocks_per_sm, size_t* padded);

}  // namespace pagedattn::kernels
