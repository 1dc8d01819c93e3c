#include <cstdio>
#include <cuda_runtime.h>
#include <vector>
#include <set>
__global__ void K(unsigned long long* out) {
  extern __shared__ char s[];
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  unsigned rank; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) { out[blockIdx.x*3]=t; out[blockIdx.x*3+1]=smid; out[blockIdx.x*3+2]=rank; }
  s[threadIdx.x] = 1;
}
int main() {
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  printf("sms %d\n", prop.multiProcessorCount);
  cudaFuncSetAttribute(K, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, 220*1024);
  for (int smem : {96*1024, 160*1024, 200*1024}) for (int c : {8, 11, 12, 14, 15, 16}) {
    cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(c*8); cfg.blockDim = dim3(128); cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute a; a.id = cudaLaunchAttributeClusterDimension; a.val.clusterDim.x = c; a.val.clusterDim.y = 1; a.val.clusterDim.z = 1;
    cfg.attrs = &a; cfg.numAttrs = 1; int n = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&n, K, &cfg);
    printf("smem %dK cluster %d: max active clusters %d (%s)\n", smem/1024, c, n, cudaGetErrorString(e));
  }
  unsigned long long* d; cudaMalloc(&d, 128*3*8);
  for (int rep = 0; rep < 3; ++rep) {
    cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(128); cfg.blockDim = dim3(128); cfg.dynamicSmemBytes = 160*1024;
    cudaLaunchAttribute a; a.id = cudaLaunchAttributeClusterDimension; a.val.clusterDim.x = 16; a.val.clusterDim.y = 1; a.val.clusterDim.z = 1;
    cfg.attrs = &a; cfg.numAttrs = 1;
    cudaError_t e = cudaLaunchKernelEx(&cfg, K, d); cudaError_t e2 = cudaDeviceSynchronize();
    std::vector<unsigned long long> h(128*3); cudaMemcpy(h.data(), d, h.size()*8, cudaMemcpyDeviceToHost);
    unsigned long long t0 = ~0ull, t1 = 0; std::set<unsigned long long> sms;
    for (int b = 0; b < 128; ++b) { t0 = std::min(t0, h[b*3]); t1 = std::max(t1, h[b*3]); sms.insert(h[b*3+1]); }
    printf("launch %s/%s: start spread %.2f us, distinct sms %zu; cluster sms:", cudaGetErrorString(e), cudaGetErrorString(e2), (t1-t0)/1e3, sms.size());
    for (int cl = 0; cl < 8; ++cl) { printf(" ["); for (int r = 0; r < 16; ++r) printf("%llu%s", h[(cl*16+r)*3+1], r<15?",":""); printf("]"); }
    printf("\n");
  }
}
