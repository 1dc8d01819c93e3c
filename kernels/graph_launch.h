// Kernel launches through cached CUDA graphs (one kernel node, or two for a dependent pair).
//
// A plain launch costs about 4 us of host time before the kernel reaches the GPU, a cached graph
// about 1.9 us; when the GPU is idle that time is the GPU's too (docs/PERFORMANCE.md#graph-launch).
// So each launcher here keeps, per (device, stream, kernel), a one-node graph
// of its last launch (per kernel pair, a two-node one: LaunchKernelPairWithParams): the same
// grids, shared memory and parameter bytes launch the graph as it is; anything else updates the
// nodes first (cudaGraphExecKernelNodeSetParams) and then launches.
// The kernel runs in full either way; only the host's submission path changes.
//
// A stream being captured into the caller's own graph gets a plain launch (the capture records
// it). SetGraphLaunch(false) makes every launch plain (the server's --graph_launch=false).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/launch_status.h"

namespace pagedattn::kernels {

// Whether launches go through cached graphs (default: yes). For the whole process.
void SetGraphLaunch(bool enabled);
bool GraphLaunchEnabled();

// Launches func (a __global__ function taking one parameter of params_bytes bytes) on stream.
// what names the kernel in errors.
LaunchStatus LaunchKernelWithParams(const void* func, dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, const void* params, size_t params_bytes,
                                    const char* what);

template <typename Params>
LaunchStatus LaunchKernelWithParams(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, const Params& params, const char* what) {
  return LaunchKernelWithParams(reinterpret_cast<const void*>(kernel), grid, block, smem, stream,
                                &params, sizeof(Params), what);
}

// One kernel of LaunchKernelPairWithParams.
struct KernelLaunch {
  const void* func = nullptr;
  dim3 grid, block;
  size_t smem = 0;
};

// Launches first, then second, both taking the same parameter, with a programmatic dependency
// (PDL): second's blocks may be scheduled once every block of first has executed
// griddepcontrol.launch_dependents (or exited), and second must execute griddepcontrol.wait
// before it reads anything first wrote (the wait returns once first has completed and its
// writes are visible). So second's launch and block start-up overlap first's run, and second
// starts working as soon as first ends. Through a cached two-node graph with a programmatic
// edge, or, where graph launches are off or the stream is being captured, two launches (the
// second with cudaLaunchAttributeProgrammaticStreamSerialization).
LaunchStatus LaunchKernelPairWithParams(const KernelLaunch& first, const KernelLaunch& second,
                                        cudaStream_t stream, const void* params,
                                        size_t params_bytes, const char* what);

}  // namespace pagedattn::kernels
