// pagedattn-pipe-probe: whether an SM's tensor cores (wgmma) and its special function units
// (MUFU: the exponentials of a softmax, a soft-cap's tanh) work at the same time on Hopper.
//
// Attention's tile is a chain of both: per score, 2 * head_dim * 2 FLOPs of matrix products and
// one exponential (two with a soft-cap). At head_dim 64, or 128 with a soft-cap, the two units
// need about as many cycles each, so how fast a tile can run depends on whether they overlap.
// Each case runs one block an SM of two warpgroups on the same work:
//   mma        warpgroup 0 issues m64n128k16 wgmma's (A and B from shared memory, 8 a group,
//              each group waited), warpgroup 1 idles;
//   mufu       warpgroup 1 runs 16 independent chains of ex2 (x <- 2^-x), warpgroup 0 idles;
//   mma+mufu   both at once, each as much as alone;
//   fma, mma+fma   the same with chains of FFMA instead (a control: the FMA pipe);
//   one_wg     warpgroup 0 alone does both: a group issued, then its share of ex2's, then the wait;
//   rs, rs+mufu    the wgmma's A from registers (as P.V's) instead of shared memory (as S's).
// The ex2 work is scaled so that alone it takes as long as the mma's alone. Overlap is
// (t_mma + t_mufu - t_both) / min(t_mma, t_mufu): 1 when they run fully at once, 0 when one waits
// for the other. The accumulators are checked (A = B = 1: each element = 16 x the wgmma's).
//
//   pagedattn-pipe-probe [--groups N] [--reps N] [--json FILE]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/device/ptx.cuh"
#include "kernels/device/wgmma.cuh"

namespace {

using T = __nv_bfloat16;
constexpr int kChains = 16;
constexpr int kMmaPerGroup = 8;
constexpr int kARows = 64, kBRows = 128, kCols = 64;  // K-major, one 128-byte-swizzle slice each
constexpr size_t kTileBytes = (kARows + kBRows) * kCols * sizeof(T);
// Asked for so that one block fits an SM, whatever the block scheduler would do.
constexpr size_t kSmemBytes = 160 * 1024;
static_assert(kTileBytes + 1024 <= kSmemBytes);

// kRs: the wgmma's A from registers (as P.V's), not shared memory (as S's).
enum Mode : int { kMma = 1, kMufu = 2, kFma = 4, kOneWarpgroup = 8, kRs = 16 };

#if PAGEDATTN_WGMMA_DEVICE
using namespace pagedattn::kernels;

__device__ __forceinline__ void MmaGroup(float (&d)[16][4], uint64_t a, uint64_t b,
                                         const uint32_t (&ra)[4], bool rs) {
  WgmmaFence();
  if (rs) {
#pragma unroll
    for (int k = 0; k < kMmaPerGroup; ++k) WgmmaRS<T>(d, ra, Sw128DescPlus(b, (k & 3) * 32));
  } else {
#pragma unroll
    for (int k = 0; k < kMmaPerGroup; ++k) {
      const uint32_t k_in = (k & 3) * 32;  // a k16 step's 32 bytes of a 128-byte row
      WgmmaSS<T>(d, Sw128DescPlus(a, k_in), Sw128DescPlus(b, k_in), 1);
    }
  }
  WgmmaCommit();
}

template <bool kMufuChain>
__device__ __forceinline__ void Chains(float (&x)[kChains], int rounds) {
#pragma unroll 1
  for (int r = 0; r < rounds; ++r) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kMufuChain) {
        x[c] = FastExp2(-x[c]);  // in (0.5, 1]: the negation is the instruction's operand modifier
      } else {
        x[c] = fmaf(x[c], 0.999f, 0.0001f);
      }
    }
  }
}
#endif

__global__ void __launch_bounds__(256, 1)
    Probe(int mode, int groups, int rounds, float* acc_out, float* chain_out) {
#if PAGEDATTN_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = SmemAddr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  T* tiles = reinterpret_cast<T*>(smem_raw + (base - raw));
  for (int i = threadIdx.x; i < (kARows + kBRows) * kCols; i += blockDim.x) {
    tiles[i] = __float2bfloat16(1.f);
  }
  ProxyFenceShared();
  __syncthreads();
  const uint64_t a = Sw128Desc(base);
  const uint64_t b = Sw128Desc(base + kARows * kCols * sizeof(T));
  const int wg = threadIdx.x / 128;
  float x[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) x[c] = 0.5f + 0.01f * c + 1e-6f * threadIdx.x;
  if (wg == 0 && (mode & kMma)) {
    float d[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
    const int per_group = (mode & kOneWarpgroup) ? rounds / groups : 0;
    const uint32_t one2 = 0x3F803F80u;  // two bfloat16 ones
    const uint32_t ra[4] = {one2, one2, one2, one2};
    const bool rs = mode & kRs;
#pragma unroll 1
    for (int g = 0; g < groups; ++g) {
      MmaGroup(d, a, b, ra, rs);
      if (mode & kOneWarpgroup) Chains<true>(x, per_group);
      WgmmaWait<0>();
      FenceRegs(d);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *acc_out = d[0][0];
  }
  if (wg == 1 && (mode & kMufu)) Chains<true>(x, rounds);
  if (wg == 1 && (mode & kFma)) Chains<false>(x, rounds);
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) sum += x[c];
  if (sum == 12345.f) *chain_out = sum;  // keeps the chains; never true for these values
#endif
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "pagedattn-pipe-probe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int groups = 4000, reps = 7;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "pagedattn-pipe-probe: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--groups") {
      groups = std::atoi(value().c_str());
    } else if (arg == "--reps") {
      reps = std::atoi(value().c_str());
    } else if (arg == "--json") {
      json = value();
    } else {
      std::fprintf(stderr,
                   "usage: pagedattn-pipe-probe [--groups N] [--reps N] [--json FILE]\n"
                   "  whether wgmma and the special function unit's ex2 overlap on one SM "
                   "(kernels/bench/pipe_probe.cu)\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
  if (groups < 1 || reps < 1) {
    std::fprintf(stderr, "pagedattn-pipe-probe: --groups and --reps must be at least 1\n");
    return 2;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (prop.major != 9) {
    std::fprintf(stderr, "pagedattn-pipe-probe: needs a Hopper GPU (sm_90), found %s (sm_%d%d)\n",
                 prop.name, prop.major, prop.minor);
    return 1;
  }
  Check(cudaFuncSetAttribute(Probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kSmemBytes)),
        "cudaFuncSetAttribute");
  float *acc = nullptr, *chain = nullptr;
  Check(cudaMalloc(&acc, sizeof(float)), "cudaMalloc");
  Check(cudaMalloc(&chain, sizeof(float)), "cudaMalloc");
  cudaEvent_t e0, e1;
  Check(cudaEventCreate(&e0), "cudaEventCreate");
  Check(cudaEventCreate(&e1), "cudaEventCreate");
  const int blocks = prop.multiProcessorCount;
  // Median of reps launches after one warm-up, in microseconds.
  auto time = [&](int mode, int rounds) {
    std::vector<float> ms;
    for (int r = 0; r <= reps; ++r) {
      Check(cudaEventRecord(e0), "cudaEventRecord");
      Probe<<<blocks, 256, kSmemBytes>>>(mode, groups, rounds, acc, chain);
      Check(cudaEventRecord(e1), "cudaEventRecord");
      Check(cudaEventSynchronize(e1), "probe");
      float t = 0;
      Check(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
      if (r > 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return 1e3 * ms[ms.size() / 2];
  };
  const double t_mma = time(kMma, 0);
  float got = 0;
  Check(cudaMemcpy(&got, acc, sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  const float want = 16.f * kMmaPerGroup * groups;
  if (got != want) {
    std::fprintf(stderr, "pagedattn-pipe-probe: accumulator %g, expected %g\n", got, want);
    return 1;
  }
  // ex2 rounds that alone take about as long as the mma's alone.
  const int probe_rounds = 20000;
  const double t_probe = time(kMufu, probe_rounds);
  const int rounds = std::max(1, static_cast<int>(probe_rounds * t_mma / t_probe));
  const double t_mufu = time(kMufu, rounds);
  const double t_both = time(kMma | kMufu, rounds);
  const double t_fma = time(kFma, rounds);
  const double t_mma_fma = time(kMma | kFma, rounds);
  const double t_one = time(kMma | kOneWarpgroup, rounds);
  const double t_rs = time(kMma | kRs, 0);
  Check(cudaMemcpy(&got, acc, sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  if (got != want) {
    std::fprintf(stderr, "pagedattn-pipe-probe: accumulator (A in registers) %g, expected %g\n",
                 got, want);
    return 1;
  }
  const double t_rs_mufu = time(kMma | kRs | kMufu, rounds);
  const double flops = 2.0 * 64 * 128 * 16 * kMmaPerGroup * groups * blocks;
  const double ex2s = 128.0 * kChains * rounds * blocks;
  auto overlap = [](double a, double b, double both) { return (a + b - both) / std::min(a, b); };
  char line[1024];
  std::snprintf(
      line, sizeof(line),
      "{\"device\": \"%s\", \"sms\": %d, \"groups\": %d, \"ex2_rounds\": %d, "
      "\"mma_us\": %.1f, \"mma_tflops\": %.1f, \"mufu_us\": %.1f, \"ex2_per_ns\": %.1f, "
      "\"mma_mufu_us\": %.1f, \"overlap_mufu\": %.3f, \"fma_us\": %.1f, \"mma_fma_us\": %.1f, "
      "\"overlap_fma\": %.3f, \"one_wg_us\": %.1f, \"overlap_one_wg\": %.3f, \"rs_us\": %.1f, "
      "\"rs_mufu_us\": %.1f, \"overlap_rs_mufu\": %.3f}",
      prop.name, blocks, groups, rounds, t_mma, flops / t_mma * 1e-6, t_mufu, ex2s / t_mufu * 1e-3,
      t_both, overlap(t_mma, t_mufu, t_both), t_fma, t_mma_fma, overlap(t_mma, t_fma, t_mma_fma),
      t_one, overlap(t_mma, t_mufu, t_one), t_rs, t_rs_mufu, overlap(t_rs, t_mufu, t_rs_mufu));
  std::printf("%s\n", line);
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "pagedattn-pipe-probe: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "%s\n", line);
    std::fclose(f);
  }
  return 0;
}
