// An FP8 cache's decode step: K and V read from the stages straight into float16 mma fragments,
// as a 16-row step (DecodeFp8Math) and transposed for at most 8 rows (DecodeFp8NarrowMath).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "kernels/decode_math.cuh"
#include "kernels/device/dtype.cuh"
#include "kernels/device/ptx.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// The FP8 tiles' arithmetic with K and V read straight from the stages into the mma fragments
// (an FP8 cache's decode tiles); scores and weights as DecodeTileMath's. An ldmatrix of FP8
// rows hands each thread four bytes where a 16-bit fragment takes two values:
// - S = Q.K^T in float16: cvt.rn.f16x2.e4m3x2 turns a thread's four bytes of K (dims 4t..4t + 3
//   of a 16-dim step) into the two pairs its B fragment takes, exactly, one instruction a pair;
//   the sum over head_dim takes dims 4t, 4t + 1 in the first k slots and 4t + 2, 4t + 3 in the
//   second, and Q's fragment is loaded in the same order (LoadQFragment). Q is float16 too,
//   each row scaled by a power of two into float16's range (QToHalf); the scores get it back.
// - O += P.V in float16 too. An ldmatrix.trans of FP8 rows gives a thread two positions of two
//   neighbouring dims; one byte permute and two conversions make them an even and an odd pair
//   (E4m3x4ToHalfPairs). The even dims make one n8 tile of O, the odd dims another, so a
//   thread's O holds dims 16c + 4t .. 16c + 4t + 3 as (o[2c][0], o[2c + 1][0], o[2c][1],
//   o[2c + 1][1]) (rows quad_row; [2], [3] for quad_row + 8): CombineKvWarpsAndWrite reads it
//   that way. V's per-position scales go into P, relative to a reference scale the warp raises
//   lazily (VScales), so that P stays within float16: P <= 2^8 (the lazy softmax base) times a
//   scale at most 2^7 times the reference.
// The scales apply once, in float: K's (and Q's row scales) to the scores, V's to P before P is
// packed, the reference to O at the end. In bfloat16 instead, the conversions took 4.5
// instructions a pair of V and 3.5 of K, the most of a step's: 1.32-1.50x bf16's rate on the
// default shapes against 1.07-1.51x.
// No pass over shared memory and no barrier between the copies and the math: the staging pass
// this replaces cost what FP8's halved bytes save (docs/PERFORMANCE.md#design-decisions).
template <int D>
struct DecodeFp8Math {
  using T = __half;

  // Whether QToHalf leaves Q in fragment order (FragmentWord): each 16-row warp's A fragments
  // one after another, a lane's four registers of a k step in one 16-byte word, so that
  // LoadQFragment is one load into four registers the mma takes as they are. Loaded from pairs of
  // rows, the fragments came in pairs of registers that ptxas moved into place for every mma, a
  // step: 232 of the tile loop's 1818 instructions at head_dim 128. Fragment order: 0.90-0.95x
  // the time at 192, 0.93-0.97x at 256 and 96, 0.96-0.98x at 64 and 80 (b2b); at 128 PER_TOKEN
  // 0.99x, but STATIC 1.02-1.05x on the three longest shapes, so 128 keeps the rows
  // (docs/PERFORMANCE.md#design-decisions).
  static constexpr bool kFragmentOrderQ = D != 128;

  // Rewrites the block's Q tile (kRows rows, bfloat16) in float16, row r times 2^-e_r, and
  // stores 2^e_r at q_scales[r]. e_r puts the row's largest |q| in [2^14, 2^15): float16 holds
  // every value of the row to 2^-24 of it (below, as good as nothing next to the largest, they
  // flush), with 3 more bits than bfloat16 had. In fragment order (kFragmentOrder) or in place
  // (DecodeFp8NarrowMath's). Once per item, by every thread; a barrier after.
  template <int kRows, int kThreads, bool kFragmentOrder = kFragmentOrderQ>
  __device__ __forceinline__ static void QToHalf(__nv_bfloat16* q, float* q_scales, int tid) {
    constexpr int kRowThreads = kThreads / kRows;  // neighbouring lanes of one warp
    constexpr int kChunks = D / 8;                 // 16-byte chunks a row (some threads one less)
    constexpr int kMine = (kChunks + kRowThreads - 1) / kRowThreads;
    const int r = tid / kRowThreads, first = tid % kRowThreads;
    uint4 v[kMine];  // fragment order: the thread's chunks, kept until every chunk is read
    float m = 0.f;
    if constexpr (kFragmentOrder) {
#pragma unroll
      for (int k = 0; k < kMine; ++k) {
        const int c = first + k * kRowThreads;
        v[k] = c < kChunks ? *reinterpret_cast<const uint4*>(q + DecodeOffset<D>(r, c))
                           : make_uint4(0, 0, 0, 0);
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
    } else {
#pragma unroll
      for (int c = first; c < kChunks; c += kRowThreads) {
        const uint4 x = *reinterpret_cast<const uint4*>(q + DecodeOffset<D>(r, c));
        const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
    }
#pragma unroll
    for (int o = 1; o < kRowThreads; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int ex = 0;
    frexpf(m, &ex);                    // m < 2^ex (0 for 0: the row stays as it is)
    const int e = max(ex - 15, -100);  // 2^-e stays a float for rows of tiny values
    const float down = ldexpf(1.f, -e);
    if constexpr (kFragmentOrder) {
      __syncthreads();  // every chunk read before any is moved
      uint32_t* words = reinterpret_cast<uint32_t*>(q);
#pragma unroll
      for (int k = 0; k < kMine; ++k) {
        const int c = first + k * kRowThreads;
        if (c >= kChunks) continue;
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          const __half2 h = __floats2half2_rn(f.x * down, f.y * down);
          words[FragmentWord(r, 8 * c + 2 * j)] = *reinterpret_cast<const uint32_t*>(&h);
        }
      }
    } else {  // in place
#pragma unroll
      for (int c = first; c < kChunks; c += kRowThreads) {
        uint4* chunk = reinterpret_cast<uint4*>(q + DecodeOffset<D>(r, c));
        const uint4 x = *chunk;
        uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
          const __half2 h = __floats2half2_rn(f.x * down, f.y * down);
          w[j] = *reinterpret_cast<const uint32_t*>(&h);
        }
        *chunk = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    if (first == 0) q_scales[r] = ldexpf(1.f, e);
  }

  // Where fragment order puts dims d, d + 1 (d even) of row r, in 4-byte words: warp r / 16's k
  // step kc = d / 16, lane (r % 8) * 4 + t (t = d % 16 / 4), register (d % 4 / 2) * 2 + r % 16 / 8.
  __host__ __device__ static constexpr int FragmentWord(int r, int d) {
    const int kc = d / 16, t = d % 16 / 4, h = d % 4 / 2;
    const int rr = r % 16;
    return (((r / 16) * (D / 16) + kc) * 32 + (rr % 8) * 4 + t) * 4 + 2 * h + rr / 8;
  }

  // Q's A fragment (float16, from QToHalf) of k step kc: slots 2t, 2t + 1 hold dims
  // 16kc + 4t, + 1; slots 2t + 8, + 9 dims 16kc + 4t + 2, + 3 (the K fragments' order). warp_q:
  // the warp's part of the tile (16 rows' worth).
  __device__ __forceinline__ static void LoadQFragment(const __nv_bfloat16* warp_q, int kc,
                                                       int lane, uint32_t (&a)[4]) {
    if constexpr (kFragmentOrderQ) {
      const uint4 q = reinterpret_cast<const uint4*>(warp_q)[kc * 32 + lane];
      a[0] = q.x;  // row quad_row, dims 4t, 4t + 1
      a[1] = q.y;  // row quad_row + 8
      a[2] = q.z;  // row quad_row, dims 4t + 2, 4t + 3
      a[3] = q.w;  // row quad_row + 8
    } else {
      const int quad_row = lane >> 2, quad_col = lane & 3;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint2 q = *reinterpret_cast<const uint2*>(
            warp_q + DecodeOffset<D>(quad_row + 8 * i, 2 * kc + (quad_col >> 1)) +
            4 * (quad_col & 1));
        a[i] = q.x;      // dims 4t, 4t + 1
        a[2 + i] = q.y;  // dims 4t + 2, 4t + 3
      }
    }
  }

  // Four E4M3 values (bytes of x) as two pairs of float16, exactly: (b0, b1), (b2, b3). From
  // sm_89 one cvt a pair, the high pair's read from the register's upper half as it stands
  // (F2FP's .H1 operand): a shift less every four bytes of K and V, 32 of an FP8 step's
  // instructions at head_dim 128.
  __device__ __forceinline__ static void E4m3x4ToHalf(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
        "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
#else
    static_assert(sizeof(__nv_fp8x2_storage_t) == 2, "two E4M3 values");
    const __half2_raw l =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3);
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), __NV_E4M3);
    lo = *reinterpret_cast<const uint32_t*>(&l);
    hi = *reinterpret_cast<const uint32_t*>(&h);
#endif
  }

  // S = Q K^T over the 16 positions at row0 of the FP8 K tile sk (unscaled, Q's rows in their
  // float16 scale): one ldmatrix per 32 dims, two accumulators up to head_dim 128 as
  // DecodeTileMath::ScoreQK.
  template <typename QFragment>
  __device__ __forceinline__ static void ScoreQK(const QFragment& q_fragment,
                                                 const unsigned char* sk, int row0, int lane,
                                                 float (&s)[2][4]) {
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kc2 = 0; kc2 < D / 32; ++kc2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 32kc2..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4(m, SmemAddr(sk + Fp8TileOffset<D>(r, 2 * kc2 + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        q_fragment(2 * kc2 + j, a);
        uint32_t b[2][2];
        E4m3x4ToHalf(m[2 * j], b[0][0], b[0][1]);
        E4m3x4ToHalf(m[2 * j + 1], b[1][0], b[1][1]);
        float(&acc)[2][4] = (D <= 128 && j) ? s_odd : s;
        Mma16816<__half>(acc[0], a, b[0][0], b[0][1]);
        Mma16816<__half>(acc[1], a, b[1][0], b[1][1]);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      uint32_t m[2];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX2(m, SmemAddr(sk + Fp8TileOffset<D>(r, D / 16 - 1)));
      uint32_t a[4];
      q_fragment(D / 16 - 1, a);
      uint32_t b[2][2];
      E4m3x4ToHalf(m[0], b[0][0], b[0][1]);
      E4m3x4ToHalf(m[1], b[1][0], b[1][1]);
      Mma16816<__half>(s[0], a, b[0][0], b[0][1]);
      Mma16816<__half>(s[1], a, b[1][0], b[1][1]);
    }
    if constexpr (D <= 128) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
      }
    }
  }

  // A thread's scores or weights (columns 2 quad_col, + 1 of each n8 tile) times their
  // positions' scales: row_scales[row0 + 8nt + 2quad_col + e % 2] (the stage's, in shared
  // memory) where per_token (block-uniform), else `one`. Q's row scales join the scores' log2
  // units (DecodeTileMath::MaskAndScale's q_rows).
  __device__ __forceinline__ static void Scale(float (&s)[2][4], const float* row_scales,
                                               bool per_token, float one, int row0,
                                               int quad_col) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float2 f = make_float2(one, one);
      if (per_token) {
        f = *reinterpret_cast<const float2*>(row_scales + row0 + nt * 8 + 2 * quad_col);
        f.x = fminf(f.x, kMaxTileScale);
        f.y = fminf(f.y, kMaxTileScale);
      }
      s[nt][0] *= f.x;
      s[nt][1] *= f.y;
      s[nt][2] *= f.x;
      s[nt][3] *= f.y;
    }
  }

  // V's scale reference of a warp: the weights P (<= 2^8) are multiplied by their positions'
  // V scales over `ref` before they are packed in float16, and O, summed in units of ref, is
  // multiplied by ref at the end. ref starts at float's smallest normal and is raised to a
  // step's largest scale when that is more than 2^7 times ref (O rescaled then), so that the
  // packed weights stay below 2^15. A step's scales are the same for every row: the raise is
  // warp-uniform. Positions whose scales are 2^-24 of ref or less (V values that small beside
  // the step's largest) flush in float16.
  struct VReference {
    float ref = 0x1p-126f;
    float inv = 0x1p126f;

    // Whether a scale passes the reference by more than 2^7: the only case that raises it.
    __device__ __forceinline__ bool Passes(float mx) const { return mx > ref * 0x1p7f; }
    // Whether any lane's scale Passes: the step's largest scale is then found and raised to.
    __device__ __forceinline__ bool AnyPasses(float mx) const {
      return __any_sync(0xffffffffu, Passes(mx));
    }
    // ref raised to mx, the step's largest scale (the same in every lane), where mx Passes it,
    // a thread's O (kN x 4 values) rescaled with it.
    template <int kN>
    __device__ __forceinline__ void RaiseTo(float mx, float (&o)[kN][4]) {
      if (Passes(mx)) {  // warp-uniform
        const float down = ref / mx;
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[n][e] *= down;
        }
        ref = mx;
        inv = 1.f / mx;
      }
    }
    // O back in its own units, once the last step is summed.
    template <int kN>
    __device__ __forceinline__ void Finish(float (&o)[kN][4]) const {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= ref;
      }
    }
  };
  struct VScales : VReference {
    // p times the V scales of the step at row0 (row_scales[row0 + ...] where per_token, else
    // `one`) over ref.
    __device__ __forceinline__ void Apply(float (&p)[2][4], const float* row_scales,
                                          bool per_token, float one, int row0, int quad_col,
                                          DecodeState<D>& st) {
      float2 f[2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        f[nt] = make_float2(one, one);
        if (per_token) {
          f[nt] = *reinterpret_cast<const float2*>(row_scales + row0 + nt * 8 + 2 * quad_col);
          f[nt].x = fminf(f[nt].x, kMaxTileScale);
          f[nt].y = fminf(f[nt].y, kMaxTileScale);
        }
      }
      // The reference rises only where a scale of the step passes it by 2^7 (rare after the
      // first steps): a vote finds that, and the step's largest scale is found only then.
      float mx = fmaxf(fmaxf(f[0].x, f[0].y), fmaxf(f[1].x, f[1].y));
      if (this->AnyPasses(mx)) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        this->RaiseTo(mx, st.o);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float x = f[nt].x * this->inv, y = f[nt].y * this->inv;
        p[nt][0] *= x;
        p[nt][1] *= y;
        p[nt][2] *= x;
        p[nt][3] *= y;
      }
    }
  };

  // Four E4M3 values (bytes of x) as two pairs of float16, exactly: (b0, b2), (b1, b3).
  __device__ __forceinline__ static void E4m3x4ToHalfPairs(uint32_t x, uint32_t& even,
                                                           uint32_t& odd) {
    E4m3x4ToHalf(__byte_perm(x, 0, 0x3120), even, odd);
  }

  // O += P V over the 16 positions at row0 of the FP8 V tile sv; p: the weights times V's
  // scales over the reference (VScales). O's layout as the struct's comment says.
  __device__ __forceinline__ static void AccumulatePV(const float (&p)[2][4],
                                                      const unsigned char* sv, int row0, int lane,
                                                      DecodeState<D>& st) {
    const uint32_t pa[4] = {PackPair<T>(p[0][0], p[0][1]), PackPair<T>(p[0][2], p[0][3]),
                            PackPair<T>(p[1][0], p[1][1]), PackPair<T>(p[1][2], p[1][3])};
#pragma unroll
    for (int c = 0; c + 1 < D / 16; c += 2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 16c..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, c + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t lo[2], hi[2];  // [0]: dim 2 quad_row of the 16 (even), [1]: + 1 (odd)
        E4m3x4ToHalfPairs(m[2 * j], lo[0], lo[1]);
        E4m3x4ToHalfPairs(m[2 * j + 1], hi[0], hi[1]);
        Mma16816<T>(st.o[2 * (c + j)], pa, lo[0], hi[0]);
        Mma16816<T>(st.o[2 * (c + j) + 1], pa, lo[1], hi[1]);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      constexpr int c = D / 16 - 1;
      uint32_t m[2];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX2Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, c)));
      uint32_t lo[2], hi[2];
      E4m3x4ToHalfPairs(m[0], lo[0], lo[1]);
      E4m3x4ToHalfPairs(m[1], hi[0], hi[1]);
      Mma16816<T>(st.o[2 * c], pa, lo[0], hi[0]);
      Mma16816<T>(st.o[2 * c + 1], pa, lo[1], hi[1]);
    }
  }
};

// An FP8 tile's step where a warp has at most 8 live rows (GQA groups up to 8 in decode):
// transposed, S^T = K.Q^T and O^T = V^T.P^T, so that the 8 rows are the mma's n8 and K and V
// its m16 (16 positions, 16 dims). The 16-row step computes 16 rows of which such a warp keeps
// 4 or 8; this one half of its mma's, O in half the registers (D / 4, not D / 2), Q^T's
// fragments in 2 registers a k step (one 8-byte load of a row, no moves) and 4 scores a thread.
// Per lane (g = lane / 4, t = lane % 4):
// - K's A fragment: a non-transposed ldmatrix gives position g (and g + 8) dims 4t .. 4t + 3 of
//   a 16-dim step, converted as DecodeFp8Math's (the sum ordered around the bytes); Q^T's B
//   fragment: row g, dims 4t .. 4t + 3, in float16 in place (QToHalf unordered).
// - S^T's accumulator: s[0][0], [1]: position g, rows 2t, 2t + 1; [2], [3]: position g + 8.
//   Each row's softmax reduces across the 8 lanes of its t (xor 4, 8, 16).
// - P^T as the B operand: the weights packed as S^T lies, each 8x8 half transposed
//   (MovMatrixTrans) to row g, positions 2t, 2t + 1 (and + 8).
// - V^T's A fragment: an ldmatrix.trans gives positions 2t, 2t + 1 of dims 2g, 2g + 1, one
//   byte permute and two conversions make the even dim's pair and the odd's (E4m3x4ToHalfPairs);
//   m tile i takes dims 16i + 2g (m = g) and 16i + 2g + 1 (m = g + 8).
// - O^T: o[i][0], [1]: dim 16i + 2g, rows 2t, 2t + 1; [2], [3]: dim 16i + 2g + 1.
// Scales as DecodeFp8Math's: K's on the scores, V's in P against a lazily raised reference.
template <int D>
struct DecodeFp8NarrowMath {
  using Fp8 = DecodeFp8Math<D>;
  static constexpr int kRows = 8;

  struct State {
    float o[D / 16][4];
    float row_max[2];  // rows 2t, 2t + 1 (log2 units)
    float row_sum[2];  // the lane's part; StoreRows sums the 8 lanes of a row

    __device__ __forceinline__ void Start() {
#pragma unroll
      for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
      row_max[0] = row_max[1] = -INFINITY;
      row_sum[0] = row_sum[1] = 0.f;
    }
  };

  // Q^T's B fragments from the warp's Q rows (float16 in place, QToHalf unordered): k step kc,
  // row g, dims 16kc + 4t, + 1 (q[kc][0]) and + 2, + 3 (q[kc][1]).
  __device__ __forceinline__ static void LoadQ(const __nv_bfloat16* warp_q, int lane,
                                               uint32_t (&q)[D / 16][2]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      const uint2 v = *reinterpret_cast<const uint2*>(
          warp_q + DecodeOffset<D>(g, 2 * kc + (t >> 1)) + 4 * (t & 1));
      q[kc][0] = v.x;
      q[kc][1] = v.y;
    }
  }

  // S^T = K Q^T over the 16 positions at row0 of the FP8 K tile sk (unscaled; Q's rows in their
  // float16 scale), in two accumulators (even and odd k steps) so that the chain is D / 32 deep.
  __device__ __forceinline__ static void ScoreKQ(const uint32_t (&q)[D / 16][2],
                                                 const unsigned char* sk, int row0, int lane,
                                                 float (&s)[1][4]) {
    float s_odd[4] = {0.f, 0.f, 0.f, 0.f};
    const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kc2 = 0; kc2 < D / 32; ++kc2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 32kc2..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      LdMatrixX4(m, SmemAddr(sk + Fp8TileOffset<D>(r, 2 * kc2 + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        Fp8::E4m3x4ToHalf(m[2 * j], a[0], a[2]);
        Fp8::E4m3x4ToHalf(m[2 * j + 1], a[1], a[3]);
        Mma16816<__half>(j ? s_odd : s[0], a, q[2 * kc2 + j][0], q[2 * kc2 + j][1]);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      uint32_t m[2];
      LdMatrixX2(m, SmemAddr(sk + Fp8TileOffset<D>(r, D / 16 - 1)));
      uint32_t a[4];
      Fp8::E4m3x4ToHalf(m[0], a[0], a[2]);
      Fp8::E4m3x4ToHalf(m[1], a[1], a[3]);
      Mma16816<__half>(s[0], a, q[D / 16 - 1][0], q[D / 16 - 1][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][e] += s_odd[e];
  }

  // The scale of each of the lane's two positions (row0 + g, + 8): row_scales' (the stage's, in
  // shared memory) where per_token (block-uniform), else `one`.
  __device__ __forceinline__ static float2 PositionScales(const float* row_scales, bool per_token,
                                                          float one, int row0, int g) {
    if (!per_token) return make_float2(one, one);
    return make_float2(fminf(row_scales[row0 + g], kMaxTileScale),
                       fminf(row_scales[row0 + g + 8], kMaxTileScale));
  }

  // S^T times K's scales of the lane's positions.
  __device__ __forceinline__ static void ScaleK(float (&s)[1][4], const float* row_scales,
                                                bool per_token, float one, int row0, int g) {
    const float2 f = PositionScales(row_scales, per_token, one, row0, g);
    s[0][0] *= f.x;
    s[0][1] *= f.x;
    s[0][2] *= f.y;
    s[0][3] *= f.y;
  }

  // As DecodeTileMath::MaskAndScale, for S^T's layout: rows.q_pos / first_pos are rows 2t and
  // 2t + 1 (DecodeRowsOf with row_step 1).
  __device__ __forceinline__ static void MaskAndScale(float (&s)[1][4], int pos0, int kv_end,
                                                      const DecodeRows& rows, int g,
                                                      const Softcap& softcap, float scale_log2,
                                                      const float (&q_rows)[2]) {
    float unit[2] = {q_rows[0] * scale_log2, q_rows[1] * scale_log2};
    if (softcap.on) {  // block-uniform: the cap takes the score itself
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][e] *= q_rows[e & 1];
      softcap.Apply(s);
      unit[0] = unit[1] = scale_log2;
    }
    if (pos0 + 15 < kv_end && pos0 + 15 <= rows.all_see_last && pos0 >= rows.all_see_first) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][e] = SaturatedScore(s[0][e] * unit[e & 1]);
      return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = pos0 + g + 8 * (e >> 1), i = e & 1;
      const bool visible = pos < kv_end && pos <= rows.q_pos[i] && pos >= rows.first_pos[i];
      s[0][e] = visible ? SaturatedScore(s[0][e] * unit[i]) : -INFINITY;
    }
  }

  // DecodeTileMath::OnlineSoftmax's lazy base, each row's max found across its 8 lanes.
  __device__ __forceinline__ static void OnlineSoftmax(float (&s)[1][4], State& st) {
    float mx[2];
    bool raise = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(s[0][i], s[0][2 + i]);
      raise = raise || mx[i] > st.row_max[i] + kRescaleSlack;
    }
    if (!LazyRescale(D) || __any_sync(0xffffffffu, raise)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int x = 4; x < 32; x *= 2) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], x));
        const float new_max = fmaxf(st.row_max[i], mx[i]);
        const float alpha = FastExp2(st.row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
        st.row_max[i] = new_max;
        st.row_sum[i] *= alpha;
#pragma unroll
        for (int d = 0; d < D / 16; ++d) {
          st.o[d][i] *= alpha;
          st.o[d][2 + i] *= alpha;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float base = st.row_max[i] == -INFINITY ? 0.f : st.row_max[i];
      s[0][i] = FastExp2(s[0][i] - base);
      s[0][2 + i] = FastExp2(s[0][2 + i] - base);
      st.row_sum[i] += s[0][i] + s[0][2 + i];
    }
  }

  // DecodeFp8Math::VScales for S^T's layout: a lane's two positions, the step's largest scale
  // found across the lanes of its positions (xor 4, 8, 16).
  struct VScales : Fp8::VReference {
    __device__ __forceinline__ void Apply(float (&p)[1][4], const float* row_scales,
                                          bool per_token, float one, int row0, int g, State& st) {
      const float2 f = PositionScales(row_scales, per_token, one, row0, g);
      float mx = fmaxf(f.x, f.y);
      if (this->AnyPasses(mx)) {  // as DecodeFp8Math::VScales
#pragma unroll
        for (int x = 4; x < 32; x *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
        this->RaiseTo(mx, st.o);
      }
      const float x = f.x * this->inv, y = f.y * this->inv;
      p[0][0] *= x;
      p[0][1] *= x;
      p[0][2] *= y;
      p[0][3] *= y;
    }
  };

  // O^T += V^T P^T over the 16 positions at row0 of the FP8 V tile sv; p: the weights times V's
  // scales over the reference (VScales).
  __device__ __forceinline__ static void AccumulatePV(const float (&p)[1][4],
                                                      const unsigned char* sv, int row0, int lane,
                                                      State& st) {
    const uint32_t b0 = MovMatrixTrans(PackPair<__half>(p[0][0], p[0][1]));  // positions 0-7
    const uint32_t b1 = MovMatrixTrans(PackPair<__half>(p[0][2], p[0][3]));  // 8-15
    const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int c = 0; c + 1 < D / 16; c += 2) {
      // m[0], m[1]: positions 0-7, 8-15 of dims 16c..+15; m[2], m[3]: of the next 16 dims.
      uint32_t m[4];
      LdMatrixX4Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, c + (lane >> 4))));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        Fp8::E4m3x4ToHalfPairs(m[2 * j], a[0], a[1]);
        Fp8::E4m3x4ToHalfPairs(m[2 * j + 1], a[2], a[3]);
        Mma16816<__half>(st.o[c + j], a, b0, b1);
      }
    }
    if constexpr (D % 32 != 0) {  // head_dim 80: its last 16 dims from two matrices
      uint32_t m[2];
      LdMatrixX2Trans(m, SmemAddr(sv + Fp8TileOffset<D>(r, D / 16 - 1)));
      uint32_t a[4];
      Fp8::E4m3x4ToHalfPairs(m[0], a[0], a[1]);
      Fp8::E4m3x4ToHalfPairs(m[1], a[2], a[3]);
      Mma16816<__half>(st.o[D / 16 - 1], a, b0, b1);
    }
  }

  // The warp's rows into the combine's shared arrays (CombineKvWarpsAndWrite's layout): each
  // row's sum across its 8 lanes, then its max and sum from lane t, its O from the 8 lanes.
  __device__ __forceinline__ static void StoreRows(State& st, float* red_o, float* red_max,
                                                   float* red_sum, int red_stride, int row_offset,
                                                   int live_rows, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int x = 4; x < 32; x *= 2) st.row_sum[i] += __shfl_xor_sync(0xffffffffu, st.row_sum[i], x);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 2 * t + i;
      if (r >= live_rows) continue;
      if (g == 0) {
        red_max[row_offset + r] = st.row_max[i];
        red_sum[row_offset + r] = st.row_sum[i];
      }
      float* red_row = red_o + (row_offset + r) * red_stride;
#pragma unroll
      for (int d = 0; d < D / 16; ++d) {
        *reinterpret_cast<float2*>(red_row + 16 * d + 2 * g) = make_float2(st.o[d][i], st.o[d][2 + i]);
      }
    }
  }
};

}  // namespace pagedattn::kernels
