// PTX wrappers the tile kernels are built from: mma.sync, ldmatrix, cp.async (with an L2
// policy), ex2, griddepcontrol for programmatically dependent launches, and cluster barriers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pagedattn::kernels {

// x, which every lane of the warp holds alike, as ptxas can see it is: lane 0's value broadcast,
// so that what is computed from it may live in uniform registers (a wgmma's descriptors must).
__device__ __forceinline__ int WarpUniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// c += a * b for one m16n8k16 tile (a row-major 16x16, b col-major 16x8, c f32 16x8).
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);
template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
// Two matrices: lanes 0-15 give the row addresses (r[0] rows of lanes 0-7, r[1] of 8-15).
__device__ __forceinline__ void LdMatrixX2(uint32_t (&r)[2], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr));
}
__device__ __forceinline__ void LdMatrixX2Trans(uint32_t (&r)[2], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr));
}
// An 8x8 matrix of 16-bit values held as ldmatrix leaves it (lane l: row l / 4, columns
// 2 (l % 4), + 1), transposed across the warp: lane l then holds the transpose's row l / 4.
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// 16-byte global -> shared copy; when !valid the destination is zero-filled and src unread.
__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(src),
               "r"(src_size)
               : "memory");
}
// CpAsync16 by predicate: the destination zero-filled and src unread when !valid, for one
// instruction less than the source size's selection.
__device__ __forceinline__ void CpAsync16Or0(uint32_t smem_addr, const void* src, bool valid) {
  asm volatile(
      "{\n"
      ".reg .pred z;\n"
      "setp.eq.b32 z, %2, 0;\n"
      "cp.async.cg.shared.global [%0], [%1], 16, z;\n"
      "}\n" ::"r"(smem_addr),
      "l"(src), "r"(static_cast<int>(valid))
      : "memory");
}
// CpAsync16 with an L2 cache policy (a createpolicy value).
__device__ __forceinline__ void CpAsync16Policy(uint32_t smem_addr, const void* src, bool valid,
                                                uint64_t policy) {
  const int src_size = valid ? 16 : 0;
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr),
      "l"(src), "r"(src_size), "l"(policy)
      : "memory");
}
// 4 bytes (an FP8 row's scale), zero-filled when !valid.
__device__ __forceinline__ void CpAsync4(uint32_t smem_addr, const void* src, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(src),
               "r"(src_size)
               : "memory");
}
// The L2 policy of data read once: its lines are the first evicted.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 2^x on the SFU alone (ex2.approx.ftz: no range fix-up around it); 2^-inf = 0.
// Results below 2^-126 flush to 0: a softmax weight that small adds nothing to a sum that
// holds its row's largest weight (1 when the base was set, up to 2^kRescaleSlack).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// tanh on the special function unit (sm_75 and later): max relative error 2^-11, +-1 at the ends.
__device__ __forceinline__ float FastTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Programmatic dependent launch (sm_90+; no-ops when nothing is launched that way): a kernel
// lets the dependent kernel after it be scheduled, and the dependent waits until the kernel
// before it has completed and its writes are visible.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void WaitForPrerequisiteGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread block clusters (sm_90+; launched only where the device has them): the block's rank in
// its cluster, a barrier of every thread of the cluster whose shared-memory writes before it
// are visible to every block after it, and where an address of this block's shared memory lies
// in block `rank`'s (a generic pointer, read with ordinary loads).
__device__ __forceinline__ unsigned ClusterRank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return __clusterRelativeBlockRank();
#else
  return 0;
#endif
}

__device__ __forceinline__ void ClusterSync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
#else
  __trap();
#endif
}

template <typename T>
__device__ __forceinline__ const T* ClusterPeerPointer(const T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return static_cast<const T*>(__cluster_map_shared_rank(p, rank));
#else
  return rank == 0 ? p : nullptr;
#endif
}

}  // namespace pagedattn::kernels
