// Host time of the calls on the launch path: runtime vs driver entry points.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#define CK(x) do { auto e_ = (x); if (e_ != 0) { std::printf("fail %s: %d\n", #x, (int)e_); return 1; } } while (0)

__global__ void Work(int* p, int n) {
  if (threadIdx.x == 0 && p) atomicAdd(p + blockIdx.x % n, 1);
}

template <typename F>
double HostUs(cudaStream_t s, F&& f, int reps = 2000) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    f();
    auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(b - a).count());
    if (i % 64 == 63) cudaStreamSynchronize(s);
  }
  cudaStreamSynchronize(s);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <typename F>
double EventUs(cudaStream_t s, F&& f, int reps = 200) {
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s); f(); cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms * 1e3);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  int* buf; CK(cudaMalloc(&buf, 1024 * sizeof(int)));
  int n = 256;
  void* args[] = {&buf, &n};
  cudaGraph_t g; CK(cudaGraphCreate(&g, 0));
  cudaKernelNodeParams kp = {};
  kp.func = (void*)Work; kp.gridDim = dim3(264); kp.blockDim = dim3(128); kp.kernelParams = args;
  cudaGraphNode_t nodes[2];
  CK(cudaGraphAddKernelNode(&nodes[0], g, nullptr, 0, &kp));
  kp.gridDim = dim3(32); kp.blockDim = dim3(256);
  CK(cudaGraphAddKernelNode(&nodes[1], g, nullptr, 0, &kp));
  cudaGraphEdgeData edge = {};
  edge.from_port = cudaGraphKernelNodePortProgrammatic;
  edge.type = cudaGraphDependencyTypeProgrammatic;
  CK(cudaGraphAddDependencies(g, &nodes[0], &nodes[1], &edge, 1));
  cudaGraphExec_t ge; CK(cudaGraphInstantiate(&ge, g, 0));
  // One-node graph.
  cudaGraph_t g1; CK(cudaGraphCreate(&g1, 0));
  kp.gridDim = dim3(264); kp.blockDim = dim3(128);
  cudaGraphNode_t n1; CK(cudaGraphAddKernelNode(&n1, g1, nullptr, 0, &kp));
  cudaGraphExec_t ge1; CK(cudaGraphInstantiate(&ge1, g1, 0));
  CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));

  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamIsCapturing", &fn, 12000, cudaEnableDefault, &q));
  auto cuIsCap = reinterpret_cast<CUresult (*)(CUstream, CUstreamCaptureStatus*)>(fn);
  CK(cudaGetDriverEntryPointByVersion("cuStreamGetId", &fn, 12000, cudaEnableDefault, &q));
  auto cuGetId = reinterpret_cast<CUresult (*)(CUstream, unsigned long long*)>(fn);
  CK(cudaGetDriverEntryPointByVersion("cuGraphLaunch", &fn, 12000, cudaEnableDefault, &q));
  auto cuGLaunch = reinterpret_cast<CUresult (*)(CUgraphExec, CUstream)>(fn);
  CK(cudaGetDriverEntryPointByVersion("cuStreamGetCaptureInfo", &fn, 12030, cudaEnableDefault, &q));

  cudaStreamCaptureStatus cs; CUstreamCaptureStatus dcs; unsigned long long id;
  for (int round = 0; round < 3; ++round) {
    std::printf("round %d host_us: rt_is_capturing %.3f drv_is_capturing %.3f rt_get_id %.3f "
                "drv_get_id %.3f rt_get_device %.3f rt_graph_launch2 %.3f drv_graph_launch2 %.3f "
                "rt_graph_launch1 %.3f drv_graph_launch1 %.3f\n", round,
                HostUs(s, [&] { cudaStreamIsCapturing(s, &cs); }),
                HostUs(s, [&] { cuIsCap((CUstream)s, &dcs); }),
                HostUs(s, [&] { cudaStreamGetId(s, &id); }),
                HostUs(s, [&] { cuGetId((CUstream)s, &id); }),
                HostUs(s, [&] { int d; cudaGetDevice(&d); }),
                HostUs(s, [&] { cudaGraphLaunch(ge, s); }),
                HostUs(s, [&] { cuGLaunch((CUgraphExec)ge, (CUstream)s); }),
                HostUs(s, [&] { cudaGraphLaunch(ge1, s); }),
                HostUs(s, [&] { cuGLaunch((CUgraphExec)ge1, (CUstream)s); }));
    std::printf("round %d event_us: rt_graph2 %.3f drv_graph2 %.3f rt_graph1 %.3f drv_graph1 %.3f "
                "rt_iscap+graph2 %.3f drv_iscap+graph2 %.3f\n", round,
                EventUs(s, [&] { cudaGraphLaunch(ge, s); }),
                EventUs(s, [&] { cuGLaunch((CUgraphExec)ge, (CUstream)s); }),
                EventUs(s, [&] { cudaGraphLaunch(ge1, s); }),
                EventUs(s, [&] { cuGLaunch((CUgraphExec)ge1, (CUstream)s); }),
                EventUs(s, [&] { cudaStreamIsCapturing(s, &cs); cudaStreamGetId(s, &id); cudaGraphLaunch(ge, s); }),
                EventUs(s, [&] { cuIsCap((CUstream)s, &dcs); cuGetId((CUstream)s, &id); cuGLaunch((CUgraphExec)ge, (CUstream)s); }));
  }
  CK(cudaGetLastError());
  return 0;
}
