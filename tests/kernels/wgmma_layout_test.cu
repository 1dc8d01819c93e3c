// The Hopper prefill kernel's building blocks alone (kernels/device/wgmma.cuh): one warpgroup
// computes S = A.B^T with both operands in swizzle-128 shared memory, and O = P.V with P in
// registers (the mma.sync A fragment) and V in shared memory read MN-major (one 64-column
// slice, and two slices in one m64n128 wgmma), against a float64
// product on the host. When a layout is wrong, the failure names the first wrong element and
// where its value came from. Skips without a compute capability 9.0 GPU or an sm_90a build.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/device/ptx.cuh"
#include "kernels/device/wgmma.cuh"
#include "kernels/dispatch.h"

namespace pagedattn::kernels {
namespace {

constexpr int kM = 64, kN = 64, kD = 128;  // S: M x N over D; O: M x 64 over N positions

__global__ void LayoutProbeKernel(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                  const __nv_bfloat16* p, const __nv_bfloat16* v,
                                  const __nv_bfloat16* v2, float* s_out, float* o_out,
                                  float* o2_out) {
#if PAGEDATTN_WGMMA_DEVICE
  __shared__ __align__(1024) __nv_bfloat16 sa[kM * kD];
  __shared__ __align__(1024) __nv_bfloat16 sb[kN * kD];
  __shared__ __align__(1024) __nv_bfloat16 sv[kN * 64];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int c = tid; c < kM * kD / 8; c += 128) {
    const int r = c / (kD / 8), chunk = c % (kD / 8);
    *reinterpret_cast<uint4*>(sa + Sw128Offset<kM>(r, chunk)) =
        *reinterpret_cast<const uint4*>(a + r * kD + chunk * 8);
    *reinterpret_cast<uint4*>(sb + Sw128Offset<kN>(r, chunk)) =
        *reinterpret_cast<const uint4*>(b + r * kD + chunk * 8);
  }
  for (int c = tid; c < kN * 64 / 8; c += 128) {
    const int r = c / 8, chunk = c % 8;
    *reinterpret_cast<uint4*>(sv + Sw128Offset<kN>(r, chunk)) =
        *reinterpret_cast<const uint4*>(v + r * 64 + chunk * 8);
  }
  ProxyFenceShared();
  __syncthreads();

  float s[8][4];
  WgmmaFence();
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t slice = kk >> 2, k_in = (kk & 3) * 32;
    WgmmaSS<__nv_bfloat16>(s, Sw128Desc(SmemAddr(sa) + slice * kM * 128 + k_in),
                           Sw128Desc(SmemAddr(sb) + slice * kN * 128 + k_in), kk > 0);
  }
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(s);

  const int g = lane / 4, t = lane % 4;
  float o[8][4] = {};
  uint32_t pa[4][4];
  auto pair = [&](int row, int col) {
    __nv_bfloat162 x;
    x.x = p[row * kN + col];
    x.y = p[row * kN + col + 1];
    return *reinterpret_cast<uint32_t*>(&x);
  };
  const int row0 = warp * 16 + g;
  for (int kp = 0; kp < 4; ++kp) {
    pa[kp][0] = pair(row0, 16 * kp + 2 * t);
    pa[kp][1] = pair(row0 + 8, 16 * kp + 2 * t);
    pa[kp][2] = pair(row0, 16 * kp + 8 + 2 * t);
    pa[kp][3] = pair(row0 + 8, 16 * kp + 8 + 2 * t);
    FenceRegs(pa[kp]);
  }
  FenceRegs(o);
  WgmmaFence();
  for (int kp = 0; kp < 4; ++kp)
    WgmmaRS<__nv_bfloat16>(o, pa[kp], Sw128Desc(SmemAddr(sv) + kp * 16 * 128));
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(o);

  // The same P times a 128-column V in one m64n128 wgmma: slices kN * 128 bytes apart (in
  // sa's space, free once S is done: static shared memory stays under 48 KiB).
  __nv_bfloat16* sv2 = sa;
  __syncthreads();
  for (int c = tid; c < kN * 128 / 8; c += 128) {
    const int r = c / 16, chunk = c % 16;
    *reinterpret_cast<uint4*>(sv2 + Sw128Offset<kN>(r, chunk)) =
        *reinterpret_cast<const uint4*>(v2 + r * 128 + chunk * 8);
  }
  ProxyFenceShared();
  __syncthreads();
  float o2[16][4] = {};
  FenceRegs(o2);
  WgmmaFence();
  for (int kp = 0; kp < 4; ++kp)
    WgmmaRS<__nv_bfloat16>(o2, pa[kp], Sw128Desc(SmemAddr(sv2) + kp * 16 * 128, kN * 128));
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(o2);

  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
      s_out[row * kN + col] = s[j][e];
      o_out[row * 64 + col] = o[j][e];
    }
  for (int j = 0; j < 16; ++j)
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
      o2_out[row * 128 + col] = o2[j][e];
    }
#endif
}

bool HopperBuildAndDevice(std::string* why) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    *why = "no CUDA GPU visible";
    return false;
  }
  if (!HopperPrefillAvailable()) {
    *why = "needs an sm_90a build (PAGEDATTN_CUDA_ARCHS with 90a) and a compute 9.0 GPU";
    return false;
  }
  return true;
}

std::vector<__nv_bfloat16> RandomBf16(size_t n, std::mt19937& rng, std::vector<double>* exact) {
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<__nv_bfloat16> out(n);
  exact->resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = __float2bfloat16_rn(uni(rng));
    (*exact)[i] = __bfloat162float(out[i]);
  }
  return out;
}

template <typename V>
V* Upload(const std::vector<V>& h) {
  V* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, h.size() * sizeof(V)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(V), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

// Checks got (rows x cols) against want; on the first miss, names the element and the position
// of the reference value it equals, if any (what a wrong layout produces).
void ExpectProduct(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                   int rows, int cols) {
  int bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const double w = want[r * cols + c], x = got[r * cols + c];
      if (std::fabs(w - x) <= 1e-3 * (1.0 + std::fabs(w))) continue;
      if (bad++ == 0) {
        std::string from = "no reference element";
        for (int i = 0; i < rows * cols; ++i)
          if (std::fabs(want[i] - x) <= 1e-3 * (1.0 + std::fabs(x))) {
            from = "reference (" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + ")";
            break;
          }
        ADD_FAILURE() << what << ": (" << r << ", " << c << ") is " << x << ", want " << w
                      << "; the value is " << from;
      }
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << rows * cols << " elements wrong";
}

TEST(WgmmaLayout, SharedAndRegisterOperands) {
  std::string why;
  if (!HopperBuildAndDevice(&why)) GTEST_SKIP() << why;
  std::mt19937 rng(7);
  std::vector<double> a, b, p, v;
  auto ha = RandomBf16(kM * kD, rng, &a), hb = RandomBf16(kN * kD, rng, &b),
       hp = RandomBf16(kM * kN, rng, &p), hv = RandomBf16(kN * 64, rng, &v);
  std::vector<double> v2;
  auto hv2 = RandomBf16(kN * 128, rng, &v2);
  auto *da = Upload(ha), *db = Upload(hb), *dp = Upload(hp), *dv = Upload(hv), *dv2 = Upload(hv2);
  float *ds = nullptr, *dout = nullptr, *dout2 = nullptr;
  ASSERT_EQ(cudaMalloc(&ds, kM * kN * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, kM * 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout2, kM * 128 * sizeof(float)), cudaSuccess);
  LayoutProbeKernel<<<1, 128>>>(da, db, dp, dv, dv2, ds, dout, dout2);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> s(kM * kN), o(kM * 64), o2(kM * 128);
  ASSERT_EQ(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(o2.data(), dout2, o2.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);

  std::vector<double> want_s(kM * kN, 0.0), want_o(kM * 64, 0.0);
  for (int r = 0; r < kM; ++r)
    for (int c = 0; c < kN; ++c)
      for (int k = 0; k < kD; ++k) want_s[r * kN + c] += a[r * kD + k] * b[c * kD + k];
  for (int r = 0; r < kM; ++r)
    for (int c = 0; c < 64; ++c)
      for (int k = 0; k < kN; ++k) want_o[r * 64 + c] += p[r * kN + k] * v[k * 64 + c];
  ExpectProduct("S = A.B^T (both K-major)", s, want_s, kM, kN);
  ExpectProduct("O = P.V (P in registers, V MN-major)", o, want_o, kM, 64);
  std::vector<double> want_o2(kM * 128, 0.0);
  for (int r = 0; r < kM; ++r)
    for (int c = 0; c < 128; ++c)
      for (int k = 0; k < kN; ++k) want_o2[r * 128 + c] += p[r * kN + k] * v2[k * 128 + c];
  ExpectProduct("O = P.V over two slices (m64n128, leading byte offset)", o2, want_o2, kM, 128);
  for (void* ptr : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dp),
                    static_cast<void*>(dv), static_cast<void*>(dv2), static_cast<void*>(ds),
                    static_cast<void*>(dout), static_cast<void*>(dout2)})
    cudaFree(ptr);
}

}  // namespace
}  // namespace pagedattn::kernels
