// pagedattn-bench: times the paged attention kernels alone (no server) on random data with pages
// scattered in random order, checks the output against the float64 reference before and after
// timing, and prints one JSON row per case with the keys of ../shared/device/peers.py.
//
//   --suite decode (default): one query per sequence; "B,C" = B sequences of C positions.
//   --suite prefill: causal prefill, every position a query; "B,L" = B sequences of L tokens
//     (default: peers.py's prefill shapes); tflops counts 4*B*Hq*L*L*D/2 as peers.py does.
//
//   pagedattn-bench [--suite decode|prefill] [--cases "1,32768 16,4096"] [--ragged 4096,100,7000]
//                   [--q-heads 32]
//                   [--kv-heads 8] [--head-dim 128] [--page-size 16] [--dtype bfloat16|float16]
//                   [--warmup 10] [--reps 50] [--check-seqs 2] [--json FILE]
//                   [--prefill-path auto|portable] [--no-read-roofline]
//                   [--no-flush-l2]  time without first evicting the pools from L2 (by
//                     default a buffer of 4x the L2 is read before timing: lines of the pools
//                     left at normal priority by the setup and the check would hit on every
//                     launch, as the kernels read K and V evict-first); rows: l2_flushed
//                   [--merge planned|separate|in-kernel]   where split-KV tiles are merged (the
//                     plan's choice, the separate merge kernel, or the tile kernel's last split)
//                   [--launch graph|plain]  how kernels are submitted (kernels/launch.h);
//                     the row's "launch" says which
//                   [--first-pages on|off]  decode items carry their first page ids
//                     (AttachFirstPages; off: every page id from the page table)
//   Exploration only: [--blocks-scale F] [--min-chunk N]
//                     [--flush-l2-dirty] (the flush writes its buffer instead of reading it)
//                     [--rotate N] [--trials K]  (K: after timing, the per-launch median again
//                     on K fresh pool allocations and on K fresh streams, one "trial" row each)
//                     [--prefill-blocks N]  persistent Hopper prefill blocks (default: as many
//                     as the GPU holds at once; a number >= jobs gives one block per job)
//
//   Decode rows also carry read_us / read_tbps: a plain streaming read of the same K and V bytes
//   (contiguous), timed the same way: the fastest this shape's bytes can be read in one launch.
//   Prefill rows name the kernel that ran ("wgmma" on sm_90a builds on a 9.0 GPU, "mma.sync").
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/reference.h"
#include "kernels/dispatch.h"
#include "kernels/paged_attention.h"

namespace pagedattn::kernels {
namespace {

#define BENCH_CHECK_CUDA(expr)                                                                   \
  do {                                                                                           \
    cudaError_t _e = (expr);                                                                     \
    if (_e != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_e)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

void CheckLaunch(const LaunchStatus& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    std::exit(1);
  }
}

struct Config {
  std::vector<std::vector<int>> cases;  // per case: context length of each sequence
  int q_heads = 32, kv_heads = 8, head_dim = 128, page_size = 16;
  DType dtype = DType::kBFloat16;
  int warmup = 10, reps = 50, check_seqs = 2;
  double blocks_scale = 1.0;  // exploration only: scales the planner's two block counts
  int min_chunk = kDefaultMinChunk;
  int prefill_blocks = 0;  // exploration only: persistent prefill blocks (0: what the GPU holds)
  std::string merge = "planned";  // --merge separate|in-kernel: override the plan's choice
  int rotate = 0;        // pool copies to rotate among; 0: as many as keep the reads out of L2
  int trials = 0;        // exploration only: per-launch medians on fresh pools and fresh streams
  bool prefill = false;  // --suite prefill: every position of each sequence is a query
  PrefillPath prefill_path = PrefillPath::kAuto;  // --prefill-path portable: the mma.sync kernel
  bool read_roofline = true;  // decode rows: also time a plain read of the same bytes
  // Before timing, read a buffer of four times the L2 so that no line of the pools stays there
  // from their setup or the correctness check (the kernels read K and V evict-first, so lines
  // left at normal priority would hit on every timed launch).
  bool flush_l2 = true;
  bool flush_l2_dirty = false;  // exploration: the flush writes its buffer (dirty lines left)
  bool graph_launch = true;     // --launch plain: every kernel by a plain launch (launch.h)
  bool first_pages = true;      // --first-pages off: decode items without their first page ids
  std::string json;
};

__device__ __forceinline__ float HashUniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
}

template <typename T>
__global__ void FillRandom(T* data, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float f = HashUniform(seed, i);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      data[i] = __float2bfloat16_rn(f);
    } else {
      data[i] = __float2half_rn(f);
    }
  }
}

// --flush-l2's read: every 16-byte word of a buffer loaded at normal L2 priority, so that the
// L2 ends up holding clean lines of it and nothing of the pools.
__global__ void __launch_bounds__(512) TouchRead(const uint4* a, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 x = a[i];
    acc ^= x.x ^ x.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

// The roofline of a decode row: read n 16-byte words once (what the kernel must read, but
// contiguous and with nothing else to do). The sum goes out only if it is an impossible value,
// so the reads cannot be optimized away.
__global__ void __launch_bounds__(512)
    StreamRead(const uint4* a, const uint4* b, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 x[4], y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      x[u] = __ldcs(a + i + u * stride);
      y[u] = __ldcs(b + i + u * stride);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w ^ y[u].x ^ y[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 x = __ldcs(a + i), y = __ldcs(b + i);
    acc ^= x.x ^ x.w ^ y.x ^ y.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

float HostToFloat(DType t, uint16_t bits) {
  if (t == DType::kBFloat16) {
    uint32_t u = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
float RoundHost(DType t, float f) {
  uint16_t bits;
  if (t == DType::kBFloat16) {
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    std::memcpy(&bits, &b, 2);
  } else {
    __half h = __float2half_rn(f);
    std::memcpy(&bits, &h, 2);
  }
  return HostToFloat(t, bits);
}

std::vector<int> ParseInts(const std::string& s, char sep) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) v.push_back(std::atoi(item.c_str()));
  }
  return v;
}

// "B,C B,C": B sequences of C positions each.
std::vector<std::vector<int>> ParseCases(const std::string& s) {
  std::vector<std::vector<int>> out;
  std::stringstream ss(s);
  std::string item;
  while (ss >> item) {
    const std::vector<int> bc = ParseInts(item, ',');
    if (bc.size() != 2 || bc[0] <= 0 || bc[1] <= 0) {
      std::fprintf(stderr, "bad case '%s' (want B,C)\n", item.c_str());
      std::exit(2);
    }
    out.push_back(std::vector<int>(bc[0], bc[1]));
  }
  return out;
}

Config ParseFlags(int argc, char** argv) {
  Config c;
  std::string cases;
  std::string ragged;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    // A flag of two values: false for the first, true for the second, exit 2 for anything else.
    auto second_of = [&](const char* first, const char* second) {
      const std::string v = next();
      if (v != first && v != second) {
        std::fprintf(stderr, "%s must be %s or %s (got %s)\n", a.c_str(), first, second, v.c_str());
        std::exit(2);
      }
      return v == second;
    };
    if (a == "--cases")
      cases = next();
    else if (a == "--suite")
      c.prefill = second_of("decode", "prefill");
    else if (a == "--ragged")
      ragged = next();
    else if (a == "--q-heads")
      c.q_heads = std::atoi(next().c_str());
    else if (a == "--kv-heads")
      c.kv_heads = std::atoi(next().c_str());
    else if (a == "--head-dim")
      c.head_dim = std::atoi(next().c_str());
    else if (a == "--page-size")
      c.page_size = std::atoi(next().c_str());
    else if (a == "--dtype")
      c.dtype = second_of("bfloat16", "float16") ? DType::kFloat16 : DType::kBFloat16;
    else if (a == "--warmup")
      c.warmup = std::atoi(next().c_str());
    else if (a == "--reps")
      c.reps = std::atoi(next().c_str());
    else if (a == "--check-seqs")
      c.check_seqs = std::atoi(next().c_str());
    else if (a == "--json")
      c.json = next();
    else if (a == "--blocks-scale")
      c.blocks_scale = std::atof(next().c_str());
    else if (a == "--min-chunk")
      c.min_chunk = std::atoi(next().c_str());
    else if (a == "--prefill-blocks")
      c.prefill_blocks = std::atoi(next().c_str());
    else if (a == "--rotate")
      c.rotate = std::atoi(next().c_str());
    else if (a == "--trials")
      c.trials = std::atoi(next().c_str());
    else if (a == "--prefill-path")
      c.prefill_path = second_of("auto", "portable") ? PrefillPath::kPortable : PrefillPath::kAuto;
    else if (a == "--merge") {
      const std::string v = next();
      if (v != "planned" && v != "separate" && v != "in-kernel") {
        std::fprintf(stderr, "--merge must be planned, separate or in-kernel (got %s)\n",
                     v.c_str());
        std::exit(2);
      }
      c.merge = v;
    } else if (a == "--launch")
      c.graph_launch = !second_of("graph", "plain");
    else if (a == "--first-pages")
      c.first_pages = !second_of("on", "off");
    else if (a == "--no-read-roofline")
      c.read_roofline = false;
    else if (a == "--no-flush-l2")
      c.flush_l2 = false;
    else if (a == "--flush-l2-dirty")
      c.flush_l2_dirty = true;
    else {
      std::fprintf(stderr, "unknown flag %s (see the header of kernels/bench/bench.cu)\n",
                   a.c_str());
      std::exit(2);
    }
  }
  // peers.py's default shapes for the suite.
  if (cases.empty()) {
    cases = c.prefill ? "4,4096 2,8192 1,16384" : "1,32768 16,4096 64,4096 256,2048 128,8192";
  }
  if (cases != "none") c.cases = ParseCases(cases);
  if (!ragged.empty()) c.cases.push_back(ParseInts(ragged, ','));
  return c;
}

LaunchStatus Launch(const PagedAttentionParams& p, cudaStream_t stream) {
  return LaunchPagedAttention(p, stream);
}

// Milliseconds between two events recorded around launch() on stream (the host waits for the
// second): one launch's time as peers.py takes it, or back-to-back launches' when launch()
// issues several.
template <typename Launcher>
float EventMs(cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, Launcher&& launch) {
  BENCH_CHECK_CUDA(cudaEventRecord(start, stream));
  launch();
  BENCH_CHECK_CUDA(cudaEventRecord(stop, stream));
  BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return ms;
}

std::string RunCase(const Config& cfg, const std::vector<int>& ctx, int case_index) {
  const int B = static_cast<int>(ctx.size());
  const int Hq = cfg.q_heads, Hkv = cfg.kv_heads, D = cfg.head_dim, ps = cfg.page_size;
  const int esize = DTypeSize(cfg.dtype);
  std::mt19937 rng(1234 + case_index);

  // Pages: each sequence's pages drawn from one random permutation of the pool.
  std::vector<int64_t> page_offset(B + 1, 0);
  for (int b = 0; b < B; ++b) page_offset[b + 1] = page_offset[b] + (ctx[b] + ps - 1) / ps;
  const int64_t num_pages = page_offset[B];
  std::vector<int32_t> table(num_pages);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const int64_t pool_elems = num_pages * Hkv * ps * D;
  const int64_t pool_bytes = pool_elems * esize;

  // Inputs that fit in L2 are rotated among copies so that timed reads come from HBM: enough
  // copies that the bytes one pass reads are at least twice the L2. Pools larger than the L2
  // (every default shape) are read from one copy, as peers.py reads its tensors.
  int device = 0;
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDevice(&device));
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  const int64_t l2 = prop.l2CacheSize;
  int copies = static_cast<int>(
      std::min<int64_t>(8, std::max<int64_t>(1, (2 * l2 + 2 * pool_bytes - 1) / (2 * pool_bytes))));
  if (2 * pool_bytes > 2 * l2) copies = 1;
  if (cfg.rotate > 0) copies = cfg.rotate;
  std::vector<void*> k_pools(copies), v_pools(copies);
  for (int r = 0; r < copies; ++r) {
    BENCH_CHECK_CUDA(cudaMalloc(&k_pools[r], pool_bytes));
    BENCH_CHECK_CUDA(cudaMalloc(&v_pools[r], pool_bytes));
    const int grid = 4096;
    if (cfg.dtype == DType::kBFloat16) {
      FillRandom<<<grid, 256>>>(static_cast<__nv_bfloat16*>(k_pools[r]), pool_elems, 2 * r + 1);
      FillRandom<<<grid, 256>>>(static_cast<__nv_bfloat16*>(v_pools[r]), pool_elems, 2 * r + 2);
    } else {
      FillRandom<<<grid, 256>>>(static_cast<__half*>(k_pools[r]), pool_elems, 2 * r + 1);
      FillRandom<<<grid, 256>>>(static_cast<__half*>(v_pools[r]), pool_elems, 2 * r + 2);
    }
    BENCH_CHECK_CUDA(cudaGetLastError());
  }

  // Queries: one per sequence (decode) or one per position (prefill), representable in the
  // cache dtype. q_offset[b] is sequence b's first query row.
  std::vector<int64_t> q_offset(B + 1, 0);
  for (int b = 0; b < B; ++b) q_offset[b + 1] = q_offset[b] + (cfg.prefill ? ctx[b] : 1);
  const int64_t total_q = q_offset[B];
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  std::vector<float> q(total_q * Hq * D);
  for (float& x : q) x = RoundHost(cfg.dtype, uni(rng));
  std::vector<AttentionSpan> spans(B);
  for (int b = 0; b < B; ++b) {
    const int32_t nq = static_cast<int32_t>(q_offset[b + 1] - q_offset[b]);
    spans[b] = {q_offset[b], page_offset[b], nq, ctx[b]};
  }

  int target_blocks = 0, unsplit_blocks = 0;
  CheckLaunch(AttentionTargetBlocks(cfg.dtype, D, &target_blocks, &unsplit_blocks), "occupancy");
  AttentionWork work;
  target_blocks = std::max(1, static_cast<int>(target_blocks * cfg.blocks_scale));
  unsplit_blocks = std::max(1, static_cast<int>(unsplit_blocks * cfg.blocks_scale));
  PlanAttentionWork(spans.data(), B, Hq, Hkv, /*causal=*/true,
                    {.target_blocks = target_blocks,
                     .unsplit_blocks = unsplit_blocks,
                     .min_chunk = cfg.min_chunk},
                    &work);
  if (cfg.merge != "planned") work.separate_merge = cfg.merge == "separate";
  int prefill_blocks = 0;
  CheckLaunch(PrefillScheduleBlocks(cfg.dtype, D, cfg.prefill_path, &prefill_blocks),
              "prefill occupancy");
  if (prefill_blocks > 0 && cfg.prefill_blocks > 0) prefill_blocks = cfg.prefill_blocks;
  SchedulePrefillJobs(Hkv, prefill_blocks, &work);
  if (cfg.first_pages) AttachFirstPages(table.data(), ps, &work);

  auto upload = [](const void* src, size_t bytes) {
    void* d = nullptr;
    BENCH_CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(bytes, 16)));
    if (bytes) BENCH_CHECK_CUDA(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  PagedAttentionParams p;
  p.kv_dtype = cfg.dtype;
  p.prefill_path = cfg.prefill_path;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.causal = true;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(D));
  p.page_table = static_cast<const int32_t*>(upload(table.data(), table.size() * 4));
  p.q = static_cast<const float*>(upload(q.data(), q.size() * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&p.out, q.size() * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&p.lse, total_q * Hq * 4));
  p.decode_items = static_cast<const AttentionWorkItem*>(
      upload(work.decode_items.data(), work.decode_items.size() * sizeof(AttentionWorkItem)));
  if (!work.decode_first_pages.empty()) {
    p.decode_first_pages = static_cast<const ItemFirstPages*>(upload(
        work.decode_first_pages.data(), work.decode_first_pages.size() * sizeof(ItemFirstPages)));
  }
  p.num_decode_items = static_cast<int32_t>(work.decode_items.size());
  p.decode_wide_items = static_cast<const AttentionWorkItem*>(upload(
      work.decode_wide_items.data(), work.decode_wide_items.size() * sizeof(AttentionWorkItem)));
  p.num_decode_wide_items = static_cast<int32_t>(work.decode_wide_items.size());
  if (!work.decode_wide_first_pages.empty()) {
    p.decode_wide_first_pages = static_cast<const ItemFirstPages*>(
        upload(work.decode_wide_first_pages.data(),
               work.decode_wide_first_pages.size() * sizeof(ItemFirstPages)));
  }
  p.prefill_items = static_cast<const AttentionWorkItem*>(
      upload(work.prefill_items.data(), work.prefill_items.size() * sizeof(AttentionWorkItem)));
  p.num_prefill_items = static_cast<int32_t>(work.prefill_items.size());
  p.prefill_jobs = static_cast<const AttentionPrefillJob*>(
      upload(work.prefill_jobs.data(), work.prefill_jobs.size() * sizeof(AttentionPrefillJob)));
  p.prefill_job_start = static_cast<const int32_t*>(
      upload(work.prefill_job_start.data(), work.prefill_job_start.size() * sizeof(int32_t)));
  p.num_prefill_blocks = work.num_prefill_blocks();
  p.merge_tasks = static_cast<const AttentionMergeTask*>(
      upload(work.merge_tasks.data(), work.merge_tasks.size() * sizeof(AttentionMergeTask)));
  p.num_merge_tasks = static_cast<int32_t>(work.merge_tasks.size());
  p.separate_merge = work.separate_merge;
  p.merge_rows = work.merge_rows;
  BENCH_CHECK_CUDA(
      cudaMalloc(&p.partial_out, std::max<int64_t>(1, work.partial_rows * Hkv * D) * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&p.partial_lse, std::max<int64_t>(1, work.partial_rows * Hkv) * 4));
  p.partial_rows = work.partial_rows;
  const int64_t num_counters = static_cast<int64_t>(work.merge_tasks.size()) * Hkv;
  BENCH_CHECK_CUDA(cudaMalloc(&p.merge_counters, std::max<int64_t>(1, num_counters) * 4));
  BENCH_CHECK_CUDA(cudaMemset(p.merge_counters, 0, std::max<int64_t>(1, num_counters) * 4));
  cudaStream_t stream;
  BENCH_CHECK_CUDA(cudaStreamCreate(&stream));

  // Correctness first: poison, run on copy 0, compare sampled sequences with the reference.
  // Once before timing and once after it (check_output below), each time also checking that the
  // launch left the split counters at zero (a launch that left one behind would show in the
  // second check).
  std::vector<float> out(q.size());
  auto run_on_copy0 = [&] {
    BENCH_CHECK_CUDA(cudaMemset(p.out, 0xff, q.size() * 4));
    p.k_cache = k_pools[0];
    p.v_cache = v_pools[0];
    CheckLaunch(Launch(p, stream), "paged attention");
    BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
    BENCH_CHECK_CUDA(cudaMemcpy(out.data(), p.out, out.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<int32_t> counters(num_counters);
    BENCH_CHECK_CUDA(
        cudaMemcpy(counters.data(), p.merge_counters, num_counters * 4, cudaMemcpyDeviceToHost));
    if (std::any_of(counters.begin(), counters.end(), [](int32_t c) { return c != 0; })) {
      std::fprintf(stderr, "case %d: a split counter is not zero after a launch\n", case_index);
      std::exit(1);
    }
  };
  // The float64 reference of each checked query row: its row in out, then its Hq * D values.
  std::vector<std::pair<int64_t, std::vector<double>>> refs;
  std::vector<int> check;
  for (int i = 0; i < std::min(cfg.check_seqs, B); ++i) {
    check.push_back(
        cfg.check_seqs <= 1 ? 0 : static_cast<int>(int64_t{i} * (B - 1) / (cfg.check_seqs - 1)));
  }
  check.erase(std::unique(check.begin(), check.end()), check.end());
  for (int b : check) {
    const int L = ctx[b];
    std::vector<float> k(int64_t{L} * Hkv * D), v(k.size());
    std::vector<uint16_t> page(int64_t{Hkv} * ps * D);
    for (int64_t j = 0; j < page_offset[b + 1] - page_offset[b]; ++j) {
      const int64_t pg = table[page_offset[b] + j];
      for (int kv = 0; kv < 2; ++kv) {
        const char* src =
            static_cast<const char*>(kv == 0 ? k_pools[0] : v_pools[0]) + pg * Hkv * ps * D * esize;
        BENCH_CHECK_CUDA(cudaMemcpy(page.data(), src, page.size() * 2, cudaMemcpyDeviceToHost));
        for (int h = 0; h < Hkv; ++h) {
          for (int r = 0; r < ps; ++r) {
            const int64_t pos = j * ps + r;
            if (pos >= L) break;
            for (int d = 0; d < D; ++d) {
              (kv == 0 ? k : v)[(pos * Hkv + h) * D + d] =
                  HostToFloat(cfg.dtype, page[(int64_t{h} * ps + r) * D + d]);
            }
          }
        }
      }
    }
    // Decode: the sequence's one query. Prefill: a sample of query positions (first, last,
    // tile edges and between), each checked as the causal query at that position.
    std::vector<int> check_pos = {L - 1};
    if (cfg.prefill) {
      check_pos = {0, 1, 63, 64, L / 3, L / 2 + 17, L - 65, L - 1};
      for (int& x : check_pos) x = std::clamp(x, 0, L - 1);
    }
    for (int pos : check_pos) {
      const int64_t row = cfg.prefill ? q_offset[b] + pos : q_offset[b];
      std::vector<double> ref(int64_t{Hq} * D), ref_lse(Hq);
      testing::ReferenceAttention(q.data() + row * Hq * D, k.data(), v.data(), 1, pos + 1, Hq, Hkv,
                                  D, true, p.sm_scale, ref.data(), ref_lse.data());
      refs.emplace_back(row, std::move(ref));
    }
  }
  // The largest relative error of out's checked rows (infinite where one holds a NaN).
  auto max_error = [&] {
    double worst = 0;
    for (const auto& [row, ref] : refs) {
      std::vector<double> got(ref.size());
      int64_t nans = 0;
      for (size_t e = 0; e < ref.size(); ++e) {
        got[e] = out[row * Hq * D + e];
        nans += std::isnan(got[e]);
      }
      worst = std::max(
          worst, nans ? INFINITY : testing::RelativeError(got.data(), ref.data(), ref.size()));
    }
    return worst;
  };
  // A run on copy 0 against the reference: worst_err is the worst so far, and a kernel over the
  // tolerance is neither timed nor reported.
  const double tol = cfg.dtype == DType::kFloat16 ? 2e-3 : 1e-2;
  double worst_err = 0;
  auto check_output = [&](const char* when) {
    run_on_copy0();
    worst_err = std::max(worst_err, max_error());
    if (!(worst_err <= tol)) {
      std::fprintf(stderr, "case %d: relative error %.3g %s exceeds %.1g\n", case_index, worst_err,
                   when, tol);
      std::exit(1);
    }
  };
  check_output("before timing");

  // Time: median of per-launch CUDA events after warm-up, rotating the pool copies; the L2
  // holds no line of the pools at normal priority first (--no-flush-l2: as the setup left it).
  void* l2_scratch = nullptr;
  const size_t l2_scratch_bytes = 4 * static_cast<size_t>(l2);
  // The buffer is written once, then read: the L2 is left with clean lines (no write-backs
  // for the timed launches to pay), as a server's L2 holds other layers' K and V lines.
  unsigned* l2_sink = nullptr;
  auto flush_l2 = [&] {
    if (!cfg.flush_l2) return;
    if (l2_scratch == nullptr) {
      BENCH_CHECK_CUDA(cudaMalloc(&l2_scratch, l2_scratch_bytes));
      BENCH_CHECK_CUDA(cudaMalloc(&l2_sink, sizeof(unsigned)));
      BENCH_CHECK_CUDA(cudaMemsetAsync(l2_scratch, 0x5a, l2_scratch_bytes, stream));
    }
    if (cfg.flush_l2_dirty) {
      BENCH_CHECK_CUDA(cudaMemsetAsync(l2_scratch, 0x5a, l2_scratch_bytes, stream));
    } else {
      TouchRead<<<prop.multiProcessorCount * 4, 512, 0, stream>>>(
          static_cast<const uint4*>(l2_scratch), static_cast<int64_t>(l2_scratch_bytes / 16),
          l2_sink);
      BENCH_CHECK_CUDA(cudaGetLastError());
    }
    BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  };
  flush_l2();
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int it = 0; it < cfg.warmup + cfg.reps; ++it) {
    p.k_cache = k_pools[it % copies];
    p.v_cache = v_pools[it % copies];
    const float ms =
        EventMs(stream, start, stop, [&] { CheckLaunch(Launch(p, stream), "paged attention"); });
    if (it >= cfg.warmup) times.push_back(ms);
  }
  // Also back to back (no host gap between launches): the kernels' own time, for diagnosis.
  constexpr int kBackToBack = 20;
  const float b2b_ms = EventMs(stream, start, stop, [&] {
    for (int it = 0; it < kBackToBack; ++it) {
      p.k_cache = k_pools[it % copies];
      p.v_cache = v_pools[it % copies];
      CheckLaunch(Launch(p, stream), "paged attention");
    }
  });
  std::sort(times.begin(), times.end());
  const double t = times[times.size() / 2] * 1e-3;
  // --trials: is the per-launch time a property of the pool's allocation or of the stream (its
  // cached graph)? The same launch timed on fresh pools (every other trial's kept until the
  // end, so that the next lands elsewhere) and on fresh streams, one line each.
  std::vector<void*> kept_pools;
  if (cfg.trials > 0 && (cfg.prefill || copies != 1)) {
    std::fprintf(stderr, "case %d: --trials runs for decode cases read from one pool copy only\n",
                 case_index);
  }
  for (int trial = 0; trial < cfg.trials && !cfg.prefill && copies == 1; ++trial) {
    auto median_us = [&](cudaStream_t s, int n, bool b2b) {
      std::vector<float> ts;
      for (int it = 0; it < cfg.warmup + n; ++it) {
        const float ms = EventMs(s, start, stop, [&] {
          for (int j = 0; j < (b2b ? kBackToBack : 1); ++j) {
            CheckLaunch(Launch(p, s), "paged attention");
          }
        });
        if (it >= cfg.warmup) ts.push_back(ms * 1e3f / (b2b ? kBackToBack : 1));
      }
      std::sort(ts.begin(), ts.end());
      return ts[ts.size() / 2];
    };
    void* k_new = nullptr;
    void* v_new = nullptr;
    BENCH_CHECK_CUDA(cudaMalloc(&k_new, pool_bytes));
    BENCH_CHECK_CUDA(cudaMalloc(&v_new, pool_bytes));
    BENCH_CHECK_CUDA(cudaMemcpy(k_new, k_pools[0], pool_bytes, cudaMemcpyDeviceToDevice));
    BENCH_CHECK_CUDA(cudaMemcpy(v_new, v_pools[0], pool_bytes, cudaMemcpyDeviceToDevice));
    flush_l2();
    p.k_cache = k_new;
    p.v_cache = v_new;
    const float pool_launch = median_us(stream, cfg.reps, false);
    const float pool_b2b = median_us(stream, 5, true);
    p.k_cache = k_pools[0];
    p.v_cache = v_pools[0];
    cudaStream_t fresh;
    BENCH_CHECK_CUDA(cudaStreamCreate(&fresh));
    const float stream_launch = median_us(fresh, cfg.reps, false);
    const float stream_b2b = median_us(fresh, 5, true);
    const float again = median_us(stream, cfg.reps, false);
    std::printf(
        "{\"trial\": %d, \"case\": %d, \"first_us\": %.2f, \"new_pool_us\": %.2f, "
        "\"new_pool_b2b_us\": %.2f, \"new_stream_us\": %.2f, \"new_stream_b2b_us\": %.2f, "
        "\"first_again_us\": %.2f}\n",
        trial, case_index, t * 1e6, pool_launch, pool_b2b, stream_launch, stream_b2b, again);
    std::fflush(stdout);
    BENCH_CHECK_CUDA(cudaStreamDestroy(fresh));
    if (trial % 2 == 1) {  // every other trial frees its pools: the next may reuse the space
      BENCH_CHECK_CUDA(cudaFree(k_new));
      BENCH_CHECK_CUDA(cudaFree(v_new));
    } else {
      kept_pools.push_back(k_new);
      kept_pools.push_back(v_new);
    }
  }
  for (void* pool : kept_pools) BENCH_CHECK_CUDA(cudaFree(pool));
  check_output("after timing");

  // Decode: the same K and V bytes read by StreamRead, timed the same way; the best of a few
  // grid sizes (blocks of 512 threads per SM), so the row carries the shape's own roofline.
  double read_t = 0;
  int read_blocks_per_sm = 0;
  if (!cfg.prefill && cfg.read_roofline) {
    flush_l2();  // after the check's reads of the pool
    unsigned* sink = nullptr;
    BENCH_CHECK_CUDA(cudaMalloc(&sink, sizeof(unsigned)));
    const int64_t words = pool_bytes / 16;
    for (int per_sm : {1, 2, 4}) {
      std::vector<float> rt;
      for (int it = 0; it < cfg.warmup + cfg.reps; ++it) {
        const float ms = EventMs(stream, start, stop, [&] {
          StreamRead<<<prop.multiProcessorCount * per_sm, 512, 0, stream>>>(
              static_cast<const uint4*>(k_pools[it % copies]),
              static_cast<const uint4*>(v_pools[it % copies]), words, sink);
        });
        if (it >= cfg.warmup) rt.push_back(ms);
      }
      std::sort(rt.begin(), rt.end());
      const double med = rt[rt.size() / 2] * 1e-3;
      if (read_t == 0 || med < read_t) {
        read_t = med;
        read_blocks_per_sm = per_sm;
      }
    }
    cudaFree(sink);
  }
  int64_t positions = 0;
  for (int c : ctx) positions += c;
  const double kv_bytes = 2.0 * positions * Hkv * D * esize;

  char row[768];
  // The error as a JSON value (JSON has no number for NaN or infinity).
  char err_field[32] = "null";
  if (std::isfinite(worst_err)) std::snprintf(err_field, sizeof(err_field), "%.3g", worst_err);
  // Blocks launched: one per decode item and kv head, and the prefill kernel's (one per
  // schedule entry when persistent, one per item and kv head otherwise).
  const size_t blocks = (work.decode_items.size() + work.decode_wide_items.size()) * Hkv +
                        (p.num_prefill_blocks > 0 ? static_cast<size_t>(p.num_prefill_blocks)
                                                  : work.prefill_items.size() * Hkv);
  if (cfg.prefill) {
    double flops = 0;
    for (int c : ctx) flops += 4.0 * Hq * double(c) * c * D * 0.5;  // causal: half the square
    std::snprintf(
        row, sizeof(row),
        "{\"suite\": \"prefill\", \"batch\": %d, \"seqlen\": %d, \"q_heads\": %d, "
        "\"kv_heads\": %d, \"head_dim\": %d, \"causal\": true, \"dtype\": \"%s\", "
        "\"peer\": \"pagedattn\", \"time_us\": %.3f, \"tflops\": %.2f, "
        "\"page_size\": %d, \"b2b_time_us\": %.3f, \"max_rel_err\": %s, "
        "\"blocks\": %zu, \"kernel\": \"%s\", \"launch\": \"%s\", "
        "\"l2_flushed\": %s}",
        B, ctx[0], Hq, Hkv, D, cfg.dtype == DType::kBFloat16 ? "bfloat16" : "float16", t * 1e6,
        flops / t / 1e12, ps, b2b_ms * 1e3 / kBackToBack, err_field, blocks,
        cfg.prefill_path == PrefillPath::kAuto && HopperPrefillAvailable() ? "wgmma" : "mma.sync",
        cfg.graph_launch ? "graph" : "plain", cfg.flush_l2 ? "true" : "false");
  } else {
    const bool uniform = std::all_of(ctx.begin(), ctx.end(), [&](int c) { return c == ctx[0]; });
    std::string ctx_field = uniform ? std::to_string(ctx[0]) : "\"ragged\"";
    std::snprintf(
        row, sizeof(row),
        "{\"suite\": \"decode\", \"batch\": %d, \"ctx\": %s, \"q_heads\": %d, \"kv_heads\": %d, "
        "\"head_dim\": %d, \"page_size\": %d, \"dtype\": \"%s\", \"peer\": \"pagedattn\", "
        "\"time_us\": %.3f, \"tbps\": %.4f, \"b2b_time_us\": %.3f, \"max_rel_err\": %s, "
        "\"kv_chunk\": %d, \"merge\": \"%s\", \"launch\": \"%s\", "
        "\"blocks\": %zu, \"pool_copies\": %d, \"positions\": %lld, \"stages\": %d, "
        "\"read_us\": %.3f, \"read_tbps\": %.4f, \"read_blocks_per_sm\": %d, "
        "\"l2_flushed\": %s}",
        B, ctx_field.c_str(), Hq, Hkv, D, ps,
        cfg.dtype == DType::kBFloat16 ? "bfloat16" : "float16", t * 1e6, kv_bytes / t / 1e12,
        b2b_ms * 1e3 / kBackToBack, err_field, work.kv_chunk,
        work.merge_tasks.empty() ? "none" : (work.separate_merge ? "separate" : "in-kernel"),
        cfg.graph_launch ? "graph" : "plain", blocks, copies, static_cast<long long>(positions), 0,
        read_t * 1e6, read_t > 0 ? kv_bytes / read_t / 1e12 : 0.0, read_blocks_per_sm,
        cfg.flush_l2 ? "true" : "false");
  }

  if (l2_scratch != nullptr) cudaFree(l2_scratch);
  if (l2_sink != nullptr) cudaFree(l2_sink);
  for (int r = 0; r < copies; ++r) {
    cudaFree(k_pools[r]);
    cudaFree(v_pools[r]);
  }
  cudaFree(const_cast<int32_t*>(p.page_table));
  cudaFree(const_cast<float*>(p.q));
  cudaFree(p.out);
  cudaFree(p.lse);
  cudaFree(const_cast<AttentionWorkItem*>(p.decode_items));
  cudaFree(const_cast<AttentionWorkItem*>(p.decode_wide_items));
  cudaFree(const_cast<AttentionWorkItem*>(p.prefill_items));
  cudaFree(const_cast<AttentionPrefillJob*>(p.prefill_jobs));
  cudaFree(const_cast<int32_t*>(p.prefill_job_start));
  cudaFree(const_cast<AttentionMergeTask*>(p.merge_tasks));
  cudaFree(p.partial_out);
  cudaFree(p.partial_lse);
  cudaFree(p.merge_counters);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return row;
}

}  // namespace
}  // namespace pagedattn::kernels

int main(int argc, char** argv) {
  using namespace pagedattn::kernels;
  const Config cfg = ParseFlags(argc, argv);
  SetGraphLaunch(cfg.graph_launch);
  std::vector<std::string> rows;
  for (size_t i = 0; i < cfg.cases.size(); ++i) {
    rows.push_back(RunCase(cfg, cfg.cases[i], static_cast<int>(i)));
    std::printf("%s\n", rows.back().c_str());
    std::fflush(stdout);
  }
  if (!cfg.json.empty()) {
    FILE* f = std::fopen(cfg.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", cfg.json.c_str());
      return 1;
    }
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f, " %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
