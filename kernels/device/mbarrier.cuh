// Synchronization of a warp-specialized block: shared-memory mbarriers (a producer's copies
// landing, consumers releasing a stage), named barriers (a subset of the block's warps),
// setmaxnreg (registers moved between warpgroups) and TMA copies that land on an mbarrier. The
// Hopper prefill kernel's; named barriers and mbarrier init and arrive exist from sm_80, the
// waits (mbarrier.try_wait), setmaxnreg and TMA on sm_90a only (PAGEDATTN_WGMMA_DEVICE).
#pragma once

#include <cstdint>

#include "kernels/device/ptx.cuh"
#include "kernels/device/wgmma.cuh"

namespace pagedattn::kernels {

// An mbarrier whose phase completes after `count` arrivals. Initialized by one thread, then
// published to the block by a __syncthreads.
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}

// One arrival (release: this thread's earlier writes are visible to whoever waits).
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
          SmemAddr(bar))
      : "memory");
}

// One arrival once every cp.async this thread issued before it has landed; counted in the
// barrier's init count (.noinc).
__device__ __forceinline__ void CpAsyncMbarArrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddr(bar))
               : "memory");
}

// Waits until the phase of the given parity has completed (acquire). A fresh barrier is in
// phase 0: waiting for parity 1 returns at once, as if the phase before it had completed.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// Named barriers: `threads` threads (whole warps) meet at barrier `id` (0 is __syncthreads').
// Sync waits for the others; arrive counts itself and goes on.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#if PAGEDATTN_WGMMA_DEVICE
// Every warp of a warpgroup: its threads' register limit raised or lowered to N.
template <int N>
__device__ __forceinline__ void RaiseRegisters() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void LowerRegisters() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// One arrival that also makes the phase wait for `bytes` more bytes of bulk (TMA) copies.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
          SmemAddr(bar)),
      "r"(bytes)
      : "memory");
}

// A TMA copy of the box at (column, row) of the 2-D tensor map `map` (a __grid_constant__
// param's address) to shared memory at smem_dst; its bytes count down `bar`'s expected ones.
__device__ __forceinline__ void TmaLoad2d(uint32_t smem_dst, const void* map, int column, int row,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(SmemAddr(bar))
      : "memory");
}
#endif  // PAGEDATTN_WGMMA_DEVICE

}  // namespace pagedattn::kernels
