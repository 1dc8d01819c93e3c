#include "kernels/graph_launch.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace pagedattn::kernels {
namespace {

std::atomic<int> g_enabled{-1};  // -1: not yet read from the environment

// One cached launch: the graph of one kernel node and what that node was last given.
struct CachedLaunch {
  int device = -1;  // -1: a created stream (it fixes the device)
  unsigned long long stream_id = 0;  // cudaStreamGetId: never reused, unlike a handle
  const void* func = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t node = nullptr;
  dim3 grid, block;
  size_t smem = 0;
  std::vector<unsigned char> params;
  uint64_t last_use = 0;
};

// Few streams launch kernels (one per cache or worker) and each launches a few kernels; past
// this many entries the least recently used one is dropped.
constexpr size_t kMaxCachedLaunches = 64;

std::mutex g_mu;
std::vector<CachedLaunch>* g_cache = new std::vector<CachedLaunch>();  // never freed: outlives
                                                                       // static destructors
uint64_t g_clock = 0;

LaunchStatus Error(const char* what, const char* step, cudaError_t err) {
  return LaunchStatus::CudaError(std::string(what) + " launch (" + step +
                                 "): " + cudaGetErrorString(err));
}

LaunchStatus PlainLaunch(const void* func, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         const void* params, const char* what) {
  void* args[] = {const_cast<void*>(params)};
  const cudaError_t err = cudaLaunchKernel(func, grid, block, args, smem, stream);
  if (err != cudaSuccess) return Error(what, "cudaLaunchKernel", err);
  return LaunchStatus::Ok();
}

cudaKernelNodeParams NodeParams(const void* func, dim3 grid, dim3 block, size_t smem,
                                void** args) {
  cudaKernelNodeParams node = {};
  node.func = const_cast<void*>(func);
  node.gridDim = grid;
  node.blockDim = block;
  node.sharedMemBytes = static_cast<unsigned>(smem);
  node.kernelParams = args;
  return node;
}

void Destroy(CachedLaunch& c) {
  if (c.exec) cudaGraphExecDestroy(c.exec);
  if (c.graph) cudaGraphDestroy(c.graph);
  c.exec = nullptr;
  c.graph = nullptr;
}

bool SameDim(dim3 a, dim3 b) { return a.x == b.x && a.y == b.y && a.z == b.z; }

}  // namespace

void SetGraphLaunch(bool enabled) { g_enabled.store(enabled ? 1 : 0); }

bool GraphLaunchEnabled() {
  int e = g_enabled.load();
  if (e < 0) {
    const char* env = std::getenv("PAGEDATTN_GRAPH_LAUNCH");
    e = (env != nullptr && std::strcmp(env, "0") == 0) ? 0 : 1;
    int expected = -1;
    g_enabled.compare_exchange_strong(expected, e);
    e = g_enabled.load();
  }
  return e == 1;
}

LaunchStatus LaunchKernelWithParams(const void* func, dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, const void* params, size_t params_bytes,
                                    const char* what) {
  if (!GraphLaunchEnabled()) return PlainLaunch(func, grid, block, smem, stream, params, what);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess) {
    return Error(what, "cudaStreamIsCapturing", err);
  }
  if (capture != cudaStreamCaptureStatusNone) {
    return PlainLaunch(func, grid, block, smem, stream, params, what);
  }
  // The key is the stream's id (a destroyed stream's handle may come back for a stream of
  // another device; its id does not) and the kernel. A created stream belongs to one device; the
  // special handles (0, legacy, per-thread) mean the current device's stream, so for them the
  // device is part of the key.
  unsigned long long stream_id = 0;
  if (cudaError_t err = cudaStreamGetId(stream, &stream_id); err != cudaSuccess) {
    return Error(what, "cudaStreamGetId", err);
  }
  int device = -1;
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
      return Error(what, "cudaGetDevice", err);
    }
  }
  const auto* bytes = static_cast<const unsigned char*>(params);
  void* args[] = {const_cast<void*>(params)};

  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<CachedLaunch>& cache = *g_cache;
  CachedLaunch* hit = nullptr;
  for (CachedLaunch& c : cache) {
    if (c.device == device && c.stream_id == stream_id && c.func == func) {
      hit = &c;
      break;
    }
  }
  if (hit != nullptr) {
    const bool same = SameDim(hit->grid, grid) && SameDim(hit->block, block) &&
                      hit->smem == smem && hit->params.size() == params_bytes &&
                      std::memcmp(hit->params.data(), bytes, params_bytes) == 0;
    if (!same) {
      const cudaKernelNodeParams node = NodeParams(func, grid, block, smem, args);
      if (cudaError_t err = cudaGraphExecKernelNodeSetParams(hit->exec, hit->node, &node);
          err != cudaSuccess) {
        // This node cannot take that update: forget it and build a new graph below.
        (void)cudaGetLastError();
        Destroy(*hit);
        *hit = cache.back();
        cache.pop_back();
        hit = nullptr;
      } else {
        hit->grid = grid;
        hit->block = block;
        hit->smem = smem;
        hit->params.assign(bytes, bytes + params_bytes);
      }
    }
  }
  if (hit == nullptr) {
    if (cache.size() >= kMaxCachedLaunches) {
      size_t oldest = 0;
      for (size_t i = 1; i < cache.size(); ++i) {
        if (cache[i].last_use < cache[oldest].last_use) oldest = i;
      }
      Destroy(cache[oldest]);
      cache[oldest] = cache.back();
      cache.pop_back();
    }
    CachedLaunch c;
    c.device = device;
    c.stream_id = stream_id;
    c.func = func;
    c.grid = grid;
    c.block = block;
    c.smem = smem;
    c.params.assign(bytes, bytes + params_bytes);
    const cudaKernelNodeParams node = NodeParams(func, grid, block, smem, args);
    cudaError_t err = cudaGraphCreate(&c.graph, 0);
    if (err == cudaSuccess) err = cudaGraphAddKernelNode(&c.node, c.graph, nullptr, 0, &node);
    if (err == cudaSuccess) err = cudaGraphInstantiate(&c.exec, c.graph, 0);
    if (err != cudaSuccess) {
      Destroy(c);
      return Error(what, "building its graph", err);
    }
    cache.push_back(std::move(c));
    hit = &cache.back();
  }
  hit->last_use = ++g_clock;
  if (cudaError_t err = cudaGraphLaunch(hit->exec, stream); err != cudaSuccess) {
    return Error(what, "cudaGraphLaunch", err);
  }
  return LaunchStatus::Ok();
}

}  // namespace pagedattn::kernels
