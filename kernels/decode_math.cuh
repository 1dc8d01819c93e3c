// One decode warp's 16 rows: the positions they see (DecodeRows), their softmax state
// (DecodeState) and the arithmetic of a 16-position step on a 16-bit cache (DecodeTileMath).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "kernels/decode_config.cuh"
#include "kernels/device/dtype.cuh"
#include "kernels/device/ptx.cuh"
#include "kernels/device/tile_io.cuh"
#include "kernels/device/variant.cuh"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {

// The decode tile's softmax base is lazy (kRescaleSlack) from head_dim 80 on, where the skipped
// rescale of O is D/2 multiplies a step; at 64 the vote costs more than it saves
// (docs/PERFORMANCE.md#tried).
constexpr bool LazyRescale(int head_dim) { return head_dim >= 80; }

// The positions a thread's two rows (quad_row and quad_row + 8 of its warp's 16) may see.
struct DecodeRows {
  int q_pos[2];        // last position each row sees; -1 past the span
  int first_pos[2];    // first position each row sees (a sliding window's; INT32_MIN: all)
  int warp_max_pos;    // last position any row of the warp sees (-1: no rows): steps past it skip
  int warp_min_first;  // first position any row of the warp sees: steps before it skip
  int all_see_last;    // every live row of the warp sees the positions from all_see_first
  int all_see_first;   // to all_see_last: a step inside them needs no mask
};

// Rows span_row = row_start + row_warp * 16 + first_row (+ row_step) of a span whose first query
// is at position first_q_pos and whose rows end at span_rows: a 16-row step's quad_row and
// quad_row + 8, a narrow FP8 step's 2 quad_col and 2 quad_col + 1.
__device__ __forceinline__ DecodeRows DecodeRowsOf(const PagedAttentionParams& p,
                                                   const AttentionWorkItem& item, int group,
                                                   int span_rows, int first_q_pos, int row_warp,
                                                   int first_row, int row_step) {
  DecodeRows rows;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int span_row = item.row_start + row_warp * 16 + first_row + row_step * i;
    rows.q_pos[i] =
        span_row >= span_rows ? -1 : (p.causal ? first_q_pos + span_row / group : INT32_MAX);
    rows.first_pos[i] = WindowFirst(p, first_q_pos + span_row / group);
  }
  const int warp_first_row = item.row_start + row_warp * 16;
  const int warp_last_row = min(warp_first_row + 15, span_rows - 1);
  rows.warp_max_pos = warp_last_row < warp_first_row
                          ? -1
                          : (p.causal ? first_q_pos + warp_last_row / group : INT32_MAX);
  rows.warp_min_first = WindowFirst(p, first_q_pos + warp_first_row / group);
  // A row's last and first visible positions grow with the row (its query's position).
  rows.all_see_last = p.causal ? first_q_pos + warp_first_row / group : INT32_MAX;
  rows.all_see_first = WindowFirst(p, first_q_pos + warp_last_row / group);
  return rows;
}

// A thread's part of its rows' online softmax: columns 2*quad_col..+1 of each 8-wide n tile of
// O, and the rows' running max (log2 units) and sum.
template <int D>
struct DecodeState {
  float o[D / 8][4];
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ void Start() {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }
};

// The arithmetic of one 16-position step of one warp: S = Q.K^T, mask and scale, the online
// softmax update, O += P.V. s holds the step's scores, then its weights P.
// DV: the columns of V and O a block holds (DecodeTileConfig::kDv).
template <typename T, int D, int DV = D>
struct DecodeTileMath {
  // S = Q K^T over the 16 positions at row0 of the K tile sk: two n8 tiles, each summed over
  // head_dim in two accumulators (even and odd k chunks) up to head_dim 128 and at 512, so that
  // the dependent mma chain before the softmax is D/32 deep rather than D/16 (at 192 and 256 the
  // registers are spent).
  static constexpr bool kTwoChains = D <= 128 || DV < D;
  template <typename QFragment>
  __device__ __forceinline__ static void ScoreQK(const QFragment& q_fragment, const T* sk, int row0,
                                                 int lane, float (&s)[2][4]) {
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t a[4];
      q_fragment(kc, a);
      uint32_t b[4];
      const int r = row0 + (lane & 7) + 8 * (lane >> 4);
      LdMatrixX4(b, SmemAddr(sk + DecodeOffset<D>(r, 2 * kc + ((lane >> 3) & 1))));
      float(&acc)[2][4] = (kTwoChains && (kc & 1)) ? s_odd : s;
      Mma16816<T>(acc[0], a, b[0], b[1]);
      Mma16816<T>(acc[1], a, b[2], b[3]);
    }
    if constexpr (kTwoChains) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
      }
    }
  }

  // Soft-caps the scores (when the layer has a cap), masks the positions past the split's end,
  // past a row's last (causal) or before its first (window), and scales the rest to log2 units.
  // A step that every live row of the warp sees whole (all but a range's last, in decode) skips
  // the per-score tests (a warp-uniform branch); rows past the span are not written. q_rows: a
  // factor of each of the thread's rows still to apply (an FP8 tile's power-of-two Q row scales;
  // 1 otherwise), folded into the rows' log2 units where there is no cap (a power of two times
  // scale_log2, exact), so that it costs no multiply a score.
  __device__ __forceinline__ static void MaskAndScale(float (&s)[2][4], int pos0, int kv_end,
                                                      const DecodeRows& rows, int quad_col,
                                                      const Softcap& softcap, float scale_log2,
                                                      const float (&q_rows)[2] = {1.f, 1.f}) {
    float unit[2] = {q_rows[0] * scale_log2, q_rows[1] * scale_log2};
    if (softcap.on) {  // block-uniform: the cap takes the score itself
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= q_rows[e >> 1];
      }
      softcap.Apply(s);
      unit[0] = unit[1] = scale_log2;
    }
    if (pos0 + 15 < kv_end && pos0 + 15 <= rows.all_see_last && pos0 >= rows.all_see_first) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = SaturatedScore(s[nt][e] * unit[e >> 1]);
      }
      return;
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos0 + nt * 8 + 2 * quad_col + (e & 1);
        const bool visible =
            pos < kv_end && pos <= rows.q_pos[e >> 1] && pos >= rows.first_pos[e >> 1];
        s[nt][e] = visible ? SaturatedScore(s[nt][e] * unit[e >> 1]) : -INFINITY;
      }
    }
  }

  // P = 2^(s - base), the running sums, and O rescaled when the base moves. With LazyRescale(D)
  // the base (row_max) is raised to the row's max only when some row of the warp has a score
  // more than kRescaleSlack above its base; otherwise P stays below 2^kRescaleSlack, well within
  // f32 and the P operand's exponent range, and the common step (the max settles after the
  // first tiles) skips the rescale of O. Without it, every step raises the base and rescales.
  // Each thread tests its own scores (some score of a row is over the bar exactly when the row's
  // max is), so the row's max across its quad is found only when the base is raised.
  __device__ __forceinline__ static void OnlineSoftmax(float (&s)[2][4], DecodeState<DV>& st) {
    float mx[2];
    bool raise = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(fmaxf(s[0][2 * i], s[0][2 * i + 1]), fmaxf(s[1][2 * i], s[1][2 * i + 1]));
      raise = raise || mx[i] > st.row_max[i] + kRescaleSlack;
    }
    if (!LazyRescale(D) || __any_sync(0xffffffffu, raise)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float new_max = fmaxf(st.row_max[i], mx[i]);
        const float alpha = FastExp2(st.row_max[i] - (new_max == -INFINITY ? 0.f : new_max));
        st.row_max[i] = new_max;
        st.row_sum[i] *= alpha;
#pragma unroll
        for (int dt = 0; dt < DV / 8; ++dt) {
          st.o[dt][2 * i] *= alpha;
          st.o[dt][2 * i + 1] *= alpha;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float base = st.row_max[i] == -INFINITY ? 0.f : st.row_max[i];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        s[nt][2 * i] = FastExp2(s[nt][2 * i] - base);
        s[nt][2 * i + 1] = FastExp2(s[nt][2 * i + 1] - base);
      }
      st.row_sum[i] += s[0][2 * i] + s[0][2 * i + 1] + s[1][2 * i] + s[1][2 * i + 1];
    }
  }

  // O += P V over the 16 positions at row0 of the V tile sv: P's accumulator layout is the A
  // operand layout of the next mma.
  __device__ __forceinline__ static void AccumulatePV(const float (&s)[2][4], const T* sv, int row0,
                                                      int lane, DecodeState<DV>& st) {
    const uint32_t pa[4] = {PackPair<T>(s[0][0], s[0][1]), PackPair<T>(s[0][2], s[0][3]),
                            PackPair<T>(s[1][0], s[1][1]), PackPair<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int dt = 0; dt < DV / 8; dt += 2) {
      uint32_t b[4];
      const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
      LdMatrixX4Trans(b, SmemAddr(sv + DecodeOffset<DV>(r, dt + (lane >> 4))));
      Mma16816<T>(st.o[dt], pa, b[0], b[1]);
      Mma16816<T>(st.o[dt + 1], pa, b[2], b[3]);
    }
  }
};

}  // namespace pagedattn::kernels
