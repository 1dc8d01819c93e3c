// Warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors for the 128-byte swizzle,
// the fence/commit/wait wrappers and the wgmma shapes the Hopper prefill kernel issues (shared
// A and B: n64, n128; A in registers: n64, n128, n192, n256).
//
// Device code exists only when compiled for sm_90a (PAGEDATTN_WGMMA_DEVICE).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PAGEDATTN_WGMMA_DEVICE 1
#else
#define PAGEDATTN_WGMMA_DEVICE 0
#endif

namespace pagedattn::kernels {

// Element offset of (row, 16-byte chunk) in a [R][D] tile in the 128-byte-swizzle layout.
template <int R>
__host__ __device__ __forceinline__ constexpr int Sw128Offset(int row, int chunk) {
  return (chunk >> 3) * (R * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

#if PAGEDATTN_WGMMA_DEVICE

// Shared-memory matrix descriptor, 128-byte swizzle: start address, 1024 bytes between
// consecutive groups of 8 rows (the stride field), and the leading field: for an MN-major
// operand wider than one 64-column slice (P.V at every width above 64), the bytes between slices;
// unused by K-major operands (a k16 step stays inside one 128-byte row).
__device__ __forceinline__ uint64_t Sw128Desc(uint32_t smem_addr, uint32_t leading_bytes = 1024) {
  return uint64_t{(smem_addr & 0x3FFFFu) >> 4} | (uint64_t{leading_bytes >> 4} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// The descriptor of an address `bytes` (a multiple of 16) past desc's: the start address field
// (bits 0-13, in 16-byte units) of a shared-memory address under 256 KiB takes the add without a
// carry out of it, so one 32-bit add on the low word.
__device__ __forceinline__ uint64_t Sw128DescPlus(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma
// issue or wait (the asm statements above do not name the registers the hardware writes).
template <int N>
__device__ __forceinline__ void FenceRegs(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
__device__ __forceinline__ void FenceRegs(uint32_t (&a)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[e])::"memory");
}

// Schedules the instructions producing v (two sums of exponentials, never negative) before
// whatever follows: ptxas does not move a wgmma wait above a shared-memory store, and this is
// one, predicated on v[0] < 0, so it never writes (racecheck sees no access to the slot).
__device__ __forceinline__ void PinBeforeWait(uint32_t slot, const float (&v)[2]) {
  asm volatile(
      "{\n"
      ".reg .pred neg;\n"
      "setp.lt.f32 neg, %1, 0f00000000;\n"
      "@neg st.shared.v2.f32 [%0], {%1, %2};\n"
      "}\n" ::"r"(slot),
      "f"(v[0]), "f"(v[1])
      : "memory");
}

__device__ __forceinline__ void ProxyFenceShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#define PAGEDATTN_WGMMA_D32                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PAGEDATTN_WGMMA_D32_OPERANDS(d)                                                         \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
      "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
      "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
      "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
      "+f"(d[7][2]), "+f"(d[7][3])

#define PAGEDATTN_WGMMA_D64                                                          \
  "{"                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"   \
  "}"
#define PAGEDATTN_WGMMA_D64_OPERANDS(d)                                                           \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),       \
      "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),   \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),   \
      "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),   \
      "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),   \
      "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),   \
      "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
      "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),             \
      "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),             \
      "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]),             \
      "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]),             \
      "+f"(d[15][2]), "+f"(d[15][3])

// The accumulator lists of the wide P.V wgmma's (m64n192, m64n256): registers in runs of 32, and
// their operands, eight n8 tiles of d at a time.
#define PAGEDATTN_WGMMA_R0                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PAGEDATTN_WGMMA_R32                                                               \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
  "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PAGEDATTN_WGMMA_R64                                                               \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, " \
  "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define PAGEDATTN_WGMMA_R96                                                                \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, " \
  "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "   \
  "%125, %126, %127"
#define PAGEDATTN_WGMMA_D96 \
  "{" PAGEDATTN_WGMMA_R0 ", " PAGEDATTN_WGMMA_R32 ", " PAGEDATTN_WGMMA_R64 "}"
#define PAGEDATTN_WGMMA_D128                                               \
  "{" PAGEDATTN_WGMMA_R0 ", " PAGEDATTN_WGMMA_R32 ", " PAGEDATTN_WGMMA_R64 \
  ", " PAGEDATTN_WGMMA_R96 "}"
#define PAGEDATTN_WGMMA_T(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define PAGEDATTN_WGMMA_T8(d, j)                                                             \
  PAGEDATTN_WGMMA_T(d, j), PAGEDATTN_WGMMA_T(d, j + 1), PAGEDATTN_WGMMA_T(d, j + 2),         \
      PAGEDATTN_WGMMA_T(d, j + 3), PAGEDATTN_WGMMA_T(d, j + 4), PAGEDATTN_WGMMA_T(d, j + 5), \
      PAGEDATTN_WGMMA_T(d, j + 6), PAGEDATTN_WGMMA_T(d, j + 7)
#define PAGEDATTN_WGMMA_D96_OPERANDS(d) \
  PAGEDATTN_WGMMA_T8(d, 0), PAGEDATTN_WGMMA_T8(d, 8), PAGEDATTN_WGMMA_T8(d, 16)
#define PAGEDATTN_WGMMA_D128_OPERANDS(d) PAGEDATTN_WGMMA_D96_OPERANDS(d), PAGEDATTN_WGMMA_T8(d, 24)

// The wgmma's this kernel issues, as one asm statement each. TY is the PTX element type
// (bf16, f16); DLIST the accumulator register list, DOPS the macro naming the accumulator
// operands of d; the operand numbers after them follow.
// A and B from shared memory (both K-major); the predicate scales D by 0 (first k step) or 1.
#define PAGEDATTN_WGMMA_SS(SHAPE, TY, DLIST, DOPS, NA, NB, NP)                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" NP                                             \
               ", 0;\n"                                                                            \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " DLIST ", %" NA ", %" NB \
               ", p, 1, 1, 0, 0;\n}\n"                                                             \
               : DOPS(d)                                                                           \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
// A from registers (the mma.sync A fragment of the warp's 16 rows), B from shared memory read
// MN-major (transpose bit); D accumulates.
#define PAGEDATTN_WGMMA_RS(SHAPE, TY, DLIST, DOPS, NA, NB, NP)                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" NP                                     \
               ", 0;\n"                                                                    \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " DLIST ", {%" NA \
               "}, %" NB ", p, 1, 1, 1;\n}\n"                                              \
               : DOPS(d)                                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
// OP for T's PTX element type (the caller's template parameter T).
#define PAGEDATTN_WGMMA_TYPED(OP, SHAPE, ...) \
  if constexpr (kIsBf16<T>) {                 \
    OP(SHAPE, "bf16", __VA_ARGS__);           \
  } else {                                    \
    OP(SHAPE, "f16", __VA_ARGS__);            \
  }

template <typename T>
inline constexpr bool kIsBf16 = std::is_same_v<T, __nv_bfloat16>;

// d (64 x 64, f32) = [d +] A (64 x 16) * B (16 x 64).
template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                        int accumulate) {
  PAGEDATTN_WGMMA_TYPED(PAGEDATTN_WGMMA_SS, "m64n64k16", PAGEDATTN_WGMMA_D32,
                        PAGEDATTN_WGMMA_D32_OPERANDS, "32", "33", "34")
}

// d (64 x 128, f32) = [d +] A (64 x 16) * B (16 x 128).
template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                        int accumulate) {
  PAGEDATTN_WGMMA_TYPED(PAGEDATTN_WGMMA_SS, "m64n128k16", PAGEDATTN_WGMMA_D64,
                        PAGEDATTN_WGMMA_D64_OPERANDS, "64", "65", "66")
}

// d (64 x 64, f32) += A (64 x 16, registers) * B (16 x 64, MN-major).
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  PAGEDATTN_WGMMA_TYPED(PAGEDATTN_WGMMA_RS, "m64n64k16", PAGEDATTN_WGMMA_D32,
                        PAGEDATTN_WGMMA_D32_OPERANDS, "32, %33, %34, %35", "36", "37")
}

// d (64 x 128, f32) += A (64 x 16, registers) * B (16 x 128, MN-major: two 64-column slices,
// the descriptor's leading byte offset apart).
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[16][4], const uint32_t (&a)[4],
                                        uint64_t desc_b) {
  PAGEDATTN_WGMMA_TYPED(PAGEDATTN_WGMMA_RS, "m64n128k16", PAGEDATTN_WGMMA_D64,
                        PAGEDATTN_WGMMA_D64_OPERANDS, "64, %65, %66, %67", "68", "69")
}

// d (64 x 192 or 64 x 256, f32) += A (64 x 16, registers) * B (16 x 192 or 256, MN-major: three
// or four 64-column slices, the descriptor's leading byte offset apart).
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[24][4], const uint32_t (&a)[4],
                                        uint64_t desc_b) {
  PAGEDATTN_WGMMA_TYPED(PAGEDATTN_WGMMA_RS, "m64n192k16", PAGEDATTN_WGMMA_D96,
                        PAGEDATTN_WGMMA_D96_OPERANDS, "96, %97, %98, %99", "100", "101")
}
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[32][4], const uint32_t (&a)[4],
                                        uint64_t desc_b) {
  PAGEDATTN_WGMMA_TYPED(PAGEDATTN_WGMMA_RS, "m64n256k16", PAGEDATTN_WGMMA_D128,
                        PAGEDATTN_WGMMA_D128_OPERANDS, "128, %129, %130, %131", "132", "133")
}

#undef PAGEDATTN_WGMMA_TYPED
#undef PAGEDATTN_WGMMA_SS
#undef PAGEDATTN_WGMMA_RS
#undef PAGEDATTN_WGMMA_D32
#undef PAGEDATTN_WGMMA_D32_OPERANDS
#undef PAGEDATTN_WGMMA_D64
#undef PAGEDATTN_WGMMA_D64_OPERANDS
#undef PAGEDATTN_WGMMA_R0
#undef PAGEDATTN_WGMMA_R32
#undef PAGEDATTN_WGMMA_R64
#undef PAGEDATTN_WGMMA_R96
#undef PAGEDATTN_WGMMA_T
#undef PAGEDATTN_WGMMA_T8
#undef PAGEDATTN_WGMMA_D96
#undef PAGEDATTN_WGMMA_D96_OPERANDS
#undef PAGEDATTN_WGMMA_D128
#undef PAGEDATTN_WGMMA_D128_OPERANDS

#endif  // PAGEDATTN_WGMMA_DEVICE

}  // namespace pagedattn::kernels
