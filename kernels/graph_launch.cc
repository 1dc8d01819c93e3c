#include "kernels/graph_launch.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace pagedattn::kernels {
namespace {

std::atomic<bool> g_enabled{true};

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

// The helpers below run with g_mu held.
CachedLaunch* Find(int device, unsigned long long stream_id, const void* func) {
  for (CachedLaunch& c : *g_cache) {
    if (c.device == device && c.stream_id == stream_id && c.func == func) return &c;
  }
  return nullptr;
}

bool SameLaunch(const CachedLaunch& c, dim3 grid, dim3 block, size_t smem,
                const unsigned char* params, size_t params_bytes) {
  return SameDim(c.grid, grid) && SameDim(c.block, block) && c.smem == smem &&
         c.params.size() == params_bytes && std::memcmp(c.params.data(), params, params_bytes) == 0;
}

void Remember(CachedLaunch& c, const cudaKernelNodeParams& node, const unsigned char* params,
              size_t params_bytes) {
  c.grid = node.gridDim;
  c.block = node.blockDim;
  c.smem = node.sharedMemBytes;
  c.params.assign(params, params + params_bytes);
}

// Gives c's node this launch's grid, shared memory and parameters; false if it cannot.
bool Update(CachedLaunch& c, const cudaKernelNodeParams& node, const unsigned char* params,
            size_t params_bytes) {
  if (cudaGraphExecKernelNodeSetParams(c.exec, c.node, &node) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  Remember(c, node, params, params_bytes);
  return true;
}

// A new one-node graph for this launch, instantiated (nothing held when it fails).
cudaError_t Build(CachedLaunch& c, const cudaKernelNodeParams& node, const unsigned char* params,
                  size_t params_bytes) {
  cudaError_t err = cudaGraphCreate(&c.graph, 0);
  if (err == cudaSuccess) err = cudaGraphAddKernelNode(&c.node, c.graph, nullptr, 0, &node);
  if (err == cudaSuccess) err = cudaGraphInstantiate(&c.exec, c.graph, 0);
  if (err != cudaSuccess) {
    Destroy(c);
    return err;
  }
  Remember(c, node, params, params_bytes);
  return cudaSuccess;
}

// Drops an entry (a launch still in flight finishes: the exec is freed after it).
void Forget(CachedLaunch* c) {
  Destroy(*c);
  if (c != &g_cache->back()) *c = std::move(g_cache->back());
  g_cache->pop_back();
}

CachedLaunch* LeastRecentlyUsed() {
  CachedLaunch* oldest = &g_cache->front();
  for (CachedLaunch& c : *g_cache) {
    if (c.last_use < oldest->last_use) oldest = &c;
  }
  return oldest;
}

}  // namespace

void SetGraphLaunch(bool enabled) { g_enabled.store(enabled); }

bool GraphLaunchEnabled() { return g_enabled.load(); }

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
  const cudaKernelNodeParams node = NodeParams(func, grid, block, smem, args);

  std::lock_guard<std::mutex> lock(g_mu);
  CachedLaunch* hit = Find(device, stream_id, func);
  if (hit != nullptr && !SameLaunch(*hit, grid, block, smem, bytes, params_bytes) &&
      !Update(*hit, node, bytes, params_bytes)) {
    Forget(hit);  // this node cannot take the update: a new graph below
    hit = nullptr;
  }
  if (hit == nullptr) {
    CachedLaunch c;
    c.device = device;
    c.stream_id = stream_id;
    c.func = func;
    if (cudaError_t err = Build(c, node, bytes, params_bytes); err != cudaSuccess) {
      return Error(what, "building its graph", err);
    }
    if (g_cache->size() >= kMaxCachedLaunches) Forget(LeastRecentlyUsed());
    g_cache->push_back(std::move(c));
    hit = &g_cache->back();
  }
  hit->last_use = ++g_clock;
  if (cudaError_t err = cudaGraphLaunch(hit->exec, stream); err != cudaSuccess) {
    return Error(what, "cudaGraphLaunch", err);
  }
  return LaunchStatus::Ok();
}

}  // namespace pagedattn::kernels
