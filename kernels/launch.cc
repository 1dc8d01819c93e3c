// Kernel launches through cached CUDA graphs (one node, or two with a programmatic edge), or
// plain launches where graphs are off or the stream is being captured.
#include "kernels/launch.h"

#include "kernels/submission.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace pagedattn::kernels {
namespace {

// One cached launch: the graph of one kernel node (or of two, the second programmatically
// dependent on the first) and what those nodes were last given.
struct CachedLaunch {
  int device = -1;                   // -1: a created stream (it fixes the device)
  unsigned long long stream_id = 0;  // cudaStreamGetId: never reused, unlike a handle
  int num_nodes = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t nodes[2] = {nullptr, nullptr};
  KernelLaunch launches[2];
  std::vector<unsigned char> params;
  uint64_t last_use = 0;
};

// Few streams launch kernels (one per cache or worker) and each launches a few kernels; past
// this many entries the least recently used one is dropped.
constexpr size_t kMaxCachedLaunches = 64;

LaunchStatus Error(const char* what, const char* step, cudaError_t err) {
  return LaunchStatus::CudaError(std::string(what) + " launch (" + step +
                                 "): " + cudaGetErrorString(err));
}

// A launch without a graph. after_previous: it may start before the stream's previous kernel
// ends (programmatic stream serialization; see Launcher::LaunchPair).
LaunchStatus PlainLaunch(const KernelLaunch& k, cudaStream_t stream, const void* params,
                         const char* what, bool after_previous = false) {
  void* args[] = {const_cast<void*>(params)};
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = k.grid;
  config.blockDim = k.block;
  config.dynamicSmemBytes = k.smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = after_previous ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelExC(&config, k.func, args);
  if (err != cudaSuccess) return Error(what, "cudaLaunchKernelEx", err);
  return LaunchStatus::Ok();
}

cudaKernelNodeParams NodeParams(const KernelLaunch& k, void** args) {
  cudaKernelNodeParams node = {};
  node.func = const_cast<void*>(k.func);
  node.gridDim = k.grid;
  node.blockDim = k.block;
  node.sharedMemBytes = static_cast<unsigned>(k.smem);
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

bool SameKernelLaunch(const KernelLaunch& a, const KernelLaunch& b) {
  return a.func == b.func && SameDim(a.grid, b.grid) && SameDim(a.block, b.block) &&
         a.smem == b.smem;
}

// The helpers below run with the cache's mutex held. k: the launch's kernels (num_nodes of them).
CachedLaunch* Find(std::vector<CachedLaunch>& cache, int device, unsigned long long stream_id,
                   const KernelLaunch* k, int num_nodes) {
  for (CachedLaunch& c : cache) {
    if (c.device != device || c.stream_id != stream_id || c.num_nodes != num_nodes) continue;
    bool same = true;
    for (int i = 0; i < num_nodes; ++i) same = same && c.launches[i].func == k[i].func;
    if (same) return &c;
  }
  return nullptr;
}

bool SameLaunch(const CachedLaunch& c, const KernelLaunch* k, const unsigned char* params,
                size_t params_bytes) {
  for (int i = 0; i < c.num_nodes; ++i) {
    if (!SameKernelLaunch(c.launches[i], k[i])) return false;
  }
  return c.params.size() == params_bytes && std::memcmp(c.params.data(), params, params_bytes) == 0;
}

void Remember(CachedLaunch& c, const KernelLaunch* k, const unsigned char* params,
              size_t params_bytes) {
  for (int i = 0; i < c.num_nodes; ++i) c.launches[i] = k[i];
  c.params.assign(params, params + params_bytes);
}

// Gives c's nodes this launch's grids, shared memory and parameters; false if they cannot.
bool Update(CachedLaunch& c, const KernelLaunch* k, void** args, const unsigned char* params,
            size_t params_bytes) {
  for (int i = 0; i < c.num_nodes; ++i) {
    const cudaKernelNodeParams node = NodeParams(k[i], args);
    if (cudaGraphExecKernelNodeSetParams(c.exec, c.nodes[i], &node) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
  }
  Remember(c, k, params, params_bytes);
  return true;
}

// A new graph for this launch, instantiated (nothing held when it fails): one kernel node, or
// two joined by a programmatic edge (the first's launch_dependents lets the second start).
cudaError_t Build(CachedLaunch& c, const KernelLaunch* k, void** args, const unsigned char* params,
                  size_t params_bytes) {
  cudaError_t err = cudaGraphCreate(&c.graph, 0);
  for (int i = 0; i < c.num_nodes && err == cudaSuccess; ++i) {
    const cudaKernelNodeParams node = NodeParams(k[i], args);
    err = cudaGraphAddKernelNode(&c.nodes[i], c.graph, nullptr, 0, &node);
  }
  if (err == cudaSuccess && c.num_nodes == 2) {
    cudaGraphEdgeData edge = {};
    edge.from_port = cudaGraphKernelNodePortProgrammatic;
    edge.type = cudaGraphDependencyTypeProgrammatic;
    err = cudaGraphAddDependencies(c.graph, &c.nodes[0], &c.nodes[1], &edge, 1);
  }
  if (err == cudaSuccess) err = cudaGraphInstantiate(&c.exec, c.graph, 0);
  if (err != cudaSuccess) {
    Destroy(c);
    return err;
  }
  Remember(c, k, params, params_bytes);
  return cudaSuccess;
}

// Drops an entry (a launch still in flight finishes: the exec is freed after it).
void Forget(std::vector<CachedLaunch>& cache, CachedLaunch* c) {
  Destroy(*c);
  if (c != &cache.back()) *c = std::move(cache.back());
  cache.pop_back();
}

CachedLaunch* LeastRecentlyUsed(std::vector<CachedLaunch>& cache) {
  CachedLaunch* oldest = &cache.front();
  for (CachedLaunch& c : cache) {
    if (c.last_use < oldest->last_use) oldest = &c;
  }
  return oldest;
}

}  // namespace

namespace {

// Whether stream is being captured (then every launch is plain, and the capture records it).
LaunchStatus Capturing(cudaStream_t stream, bool* capturing, const char* what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess) {
    return Error(what, "cudaStreamIsCapturing", err);
  }
  *capturing = capture != cudaStreamCaptureStatusNone;
  return LaunchStatus::Ok();
}

}  // namespace

// A launcher's graphs: one entry per (device, stream, kernels), least recently used dropped.
struct Launcher::GraphCache {
  std::mutex mu;
  std::vector<CachedLaunch> entries;
  uint64_t clock = 0;

  ~GraphCache() {
    for (CachedLaunch& c : entries) Destroy(c);
  }

  // Launches the cached graph of these num_nodes kernels on stream, building or updating it
  // first when this launch differs from its last one.
  LaunchStatus Launch(const KernelLaunch* k, int num_nodes, cudaStream_t stream, const void* params,
                      size_t params_bytes, const char* what);
};

LaunchStatus Launcher::GraphCache::Launch(const KernelLaunch* k, int num_nodes, cudaStream_t stream,
                                          const void* params, size_t params_bytes,
                                          const char* what) {
  // The key is the stream's id (a destroyed stream's handle may come back for a stream of
  // another device; its id does not) and the kernels. A created stream belongs to one device;
  // the special handles (0, legacy, per-thread) mean the current device's stream, so for them
  // the device is part of the key.
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

  std::lock_guard<std::mutex> lock(mu);
  CachedLaunch* hit = Find(entries, device, stream_id, k, num_nodes);
  if (hit != nullptr && !SameLaunch(*hit, k, bytes, params_bytes) &&
      !Update(*hit, k, args, bytes, params_bytes)) {
    Forget(entries, hit);  // these nodes cannot take the update: a new graph below
    hit = nullptr;
  }
  if (hit == nullptr) {
    CachedLaunch c;
    c.device = device;
    c.stream_id = stream_id;
    c.num_nodes = num_nodes;
    if (cudaError_t err = Build(c, k, args, bytes, params_bytes); err != cudaSuccess) {
      return Error(what, "building its graph", err);
    }
    if (entries.size() >= kMaxCachedLaunches) Forget(entries, LeastRecentlyUsed(entries));
    entries.push_back(std::move(c));
    hit = &entries.back();
  }
  hit->last_use = ++clock;
  if (cudaError_t err = cudaGraphLaunch(hit->exec, stream); err != cudaSuccess) {
    return Error(what, "cudaGraphLaunch", err);
  }
  return LaunchStatus::Ok();
}

Launcher::Launcher(bool graph_launch)
    : graph_launch_(graph_launch), cache_(std::make_unique<GraphCache>()) {}

Launcher::Launcher(Submission* record_into) : graph_launch_(false), record_into_(record_into) {}

Launcher::~Launcher() = default;

// num_nodes kernels (1 or 2) as one launch, each after the one before it (programmatically for
// the second: LaunchPair): through their cached graph, or plain launches when graph launches are
// off or the stream is being captured (a capture records them as kernel nodes in plain stream
// order, the second's wait then a no-op).
LaunchStatus Launcher::LaunchKernels(const KernelLaunch* k, int num_nodes, cudaStream_t stream,
                                     const void* params, size_t params_bytes, const char* what) {
  if (record_into_ != nullptr) {
    for (int i = 0; i < num_nodes; ++i) record_into_->Kernel(k[i], params, params_bytes, i > 0);
    return LaunchStatus::Ok();
  }
  bool capturing = false;
  if (graph_launch_) {
    if (LaunchStatus st = Capturing(stream, &capturing, what); !st.ok()) return st;
    if (!capturing) {
      LaunchStatus st = cache_->Launch(k, num_nodes, stream, params, params_bytes, what);
      if (st.ok()) graph_launches_.fetch_add(1, std::memory_order_relaxed);
      return st;
    }
  }
  for (int i = 0; i < num_nodes; ++i) {
    const bool after_previous = i > 0 && !capturing;
    if (LaunchStatus st = PlainLaunch(k[i], stream, params, what, after_previous); !st.ok()) {
      return st;
    }
  }
  plain_launches_.fetch_add(1, std::memory_order_relaxed);
  return LaunchStatus::Ok();
}

LaunchStatus Launcher::Launch(const KernelLaunch& kernel, cudaStream_t stream, const void* params,
                              size_t params_bytes, const char* what) {
  return LaunchKernels(&kernel, 1, stream, params, params_bytes, what);
}

LaunchStatus Launcher::LaunchPair(const KernelLaunch& first, const KernelLaunch& second,
                                  cudaStream_t stream, const void* params, size_t params_bytes,
                                  const char* what) {
  const KernelLaunch k[2] = {first, second};
  return LaunchKernels(k, 2, stream, params, params_bytes, what);
}

LaunchStatus SmemForBlocksPerSm(size_t smem, int blocks_per_sm, size_t* padded) {
  int device = 0, per_sm = 0, reserved = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  }
  if (err != cudaSuccess) {
    return LaunchStatus::CudaError(std::string("shared memory per SM: ") +
                                   cudaGetErrorString(err));
  }
  // blocks_per_sm + 1 blocks of (asked + reserved) bytes each pass the SM's shared memory;
  // blocks_per_sm of them fit (asked rounded up to 128 bytes, as the SM allocates it).
  const size_t more = static_cast<size_t>(per_sm) / (blocks_per_sm + 1) + 1;
  const size_t asked = more > static_cast<size_t>(reserved)
                           ? (more - static_cast<size_t>(reserved) + 127) / 128 * 128
                           : 0;
  *padded = std::max(smem, asked);
  return LaunchStatus::Ok();
}

}  // namespace pagedattn::kernels
