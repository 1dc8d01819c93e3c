// pagedattn-bench: times the paged attention kernels alone (no server) on random data with pages
// scattered in random order, checks the output against the float64 reference before and after
// timing, and prints one JSON row per case with the keys of kernels/bench/peers.py.
//
//   --suite decode (default): one query per sequence; "B,C" = B sequences of C positions.
//   --suite prefill: every position a query; "B,L" = B sequences of L tokens (default:
//     peers.py's prefill shapes); tflops counts 4*B*Hq*L*L*D (halved when causal) as peers.py.
//
// Flags: `pagedattn-bench --help` (kUsage below).
//
// Timing is the median of per-launch CUDA events after warm-up (and, as b2b_time_us, back-to-back
// launches), each case's pools first evicted from L2 by reading a buffer of 4x the L2 (the kernels
// read K and V evict-first, so lines the setup left would hit:
// docs/PERFORMANCE.md#design-decisions).
// Pools smaller than the L2 are rotated among copies so that the timed reads come from HBM, each
// copy through a launcher (a cached graph) of its own.
// Decode rows also carry read_us / read_tbps: a plain streaming read of the same K and V bytes,
// timed the same way, the fastest this shape's bytes can be read in one launch. Prefill rows name
// the kernel that ran ("wgmma" on sm_90a builds on a 9.0 GPU, "mma.sync" elsewhere or with
// --prefill-path portable).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/reference.h"
#include "kernels/attention_plan.h"
#include "kernels/device/dtype.cuh"
#include "kernels/bench/profile_json.h"
#include "kernels/device/profile_layout.h"
#include "kernels/dispatch.h"
#include "kernels/launch.h"
#include "kernels/paged_attention.h"
#include "kernels/workspace.h"

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

// ---- Flags ----------------------------------------------------------------------------------

struct Config {
  std::vector<std::vector<int>> cases;  // per case: context length of each sequence
  int q_heads = 32, kv_heads = 8, head_dim = 128, page_size = 16;
  DType dtype = DType::kBFloat16;
  bool static_scales = false;           // an FP8 cache's: STATIC rather than PER_TOKEN
  DType q_dtype = DType::kUnspecified;  // kUnspecified: the cache's (its tiles')
  bool causal = true;
  int32_t window = 0;  // the layer attention variant (PagedAttentionParams::window, softcap, sinks)
  float softcap = 0.f;
  bool sinks = false;
  int warmup = 10, reps = 50;
  std::string merge = "planned";  // --merge separate|in-kernel: override the plan's choice
  bool prefill = false;           // --suite prefill: every position of each sequence is a query
  PrefillPath prefill_path = PrefillPath::kAuto;  // --prefill-path portable: the mma.sync kernel
  bool graph_launch = true;  // --launch plain: every kernel by a plain launch (launch.h)
  std::string json;
  std::string profile;  // --profile FILE: each case's phase stamps (a profile build's)
};

constexpr int kCheckSeqs = 2;    // sequences checked against the reference (first and last)
constexpr int kBackToBack = 20;  // launches of the back-to-back timing
constexpr int kMaxPoolCopies = 8;

const char* DTypeKey(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
    default:
      return "bfloat16";
  }
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

// --help's text, and what an unknown flag prints after its error.
constexpr const char* kUsage =
    "pagedattn-bench: times the paged attention kernels alone on random data, each output checked\n"
    "against the float64 reference; one JSON row per case (kernels/bench/peers.py's keys).\n"
    "\n"
    "  --suite decode|prefill   decode (default): one query per sequence; prefill: every\n"
    "                           position a query\n"
    "  --cases \"B,N ...\"        B sequences of N positions (decode) or tokens (prefill);\n"
    "                           default \"1,32768 16,4096 64,4096 256,2048 128,8192\" (decode),\n"
    "                           \"4,4096 2,8192 1,16384\" (prefill); \"none\" for none\n"
    "  --ragged N,N,...         one more case: a batch of sequences of these lengths\n"
    "  --q-heads 32 --kv-heads 8 --head-dim 128 --page-size 16\n"
    "  --dtype bfloat16|float16|float8_e4m3   the cache's (default bfloat16)\n"
    "  --kv-scaling per-token|static          an FP8 cache's scales (default per-token)\n"
    "  --q-dtype float32|bfloat16|float16     q's and out's (default the cache's; bfloat16 for\n"
    "                                         an FP8 cache, whose tiles compute in it)\n"
    "  --causal | --non-causal                (default causal)\n"
    "  --window W  --softcap C  --sinks       a layer variant: a sliding window (decode rows then\n"
    "                                         count only the window's bytes), a logit soft-cap,\n"
    "                                         sinks (1 + h/4 for q head h)\n"
    "  --warmup 10 --reps 50 --json FILE      timing; the rows also written to FILE\n"
    "  --prefill-path auto|portable           the Hopper (wgmma) or the mma.sync prefill kernel\n"
    "  --launch graph|plain                   how kernels are submitted (kernels/launch.h)\n"
    "  --merge planned|separate|in-kernel     where split-KV tiles are merged: the plan's choice,\n"
    "                                         the merge kernel, or the tile kernel's last split\n"
    "                                         (not by pairs of blocks: AttentionWork::pair_merge)\n"
    "  --profile FILE                         a profile build's (cmake -DPAGEDATTN_PROFILE=ON)\n"
    "                                         phase stamps of each case's last back-to-back\n"
    "                                         launch: each decode tile, merge block and prefill\n"
    "                                         job's start, first tile, loop end, exit (JSON, one\n"
    "                                         object a case; a summary a kernel on stderr)\n";

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
    // A flag of a few values: the index of the one given, exit 2 for anything else.
    auto one_of = [&](std::initializer_list<const char*> values) {
      const std::string v = next();
      int index = 0;
      for (const char* value : values) {
        if (v == value) return index;
        ++index;
      }
      std::string valid;
      for (const char* value : values) valid += std::string(valid.empty() ? "" : ", ") + value;
      std::fprintf(stderr, "%s must be one of %s (got %s)\n", a.c_str(), valid.c_str(), v.c_str());
      std::exit(2);
    };
    constexpr DType kDTypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
    constexpr const char* kMerges[] = {"planned", "separate", "in-kernel"};
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--cases")
      cases = next();
    else if (a == "--suite")
      c.prefill = one_of({"decode", "prefill"}) == 1;
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
      c.dtype = std::array<DType, 3>{DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}
          [one_of({"bfloat16", "float16", "float8_e4m3"})];
    else if (a == "--kv-scaling")
      c.static_scales = one_of({"per-token", "static"}) == 1;
    else if (a == "--q-dtype")
      c.q_dtype = kDTypes[one_of({"bfloat16", "float16", "float32"})];
    else if (a == "--causal")
      c.causal = true;
    else if (a == "--non-causal")
      c.causal = false;
    else if (a == "--window")
      c.window = std::atoi(next().c_str());
    else if (a == "--softcap")
      c.softcap = static_cast<float>(std::atof(next().c_str()));
    else if (a == "--sinks")
      c.sinks = true;
    else if (a == "--warmup")
      c.warmup = std::atoi(next().c_str());
    else if (a == "--reps")
      c.reps = std::max(1, std::atoi(next().c_str()));
    else if (a == "--json")
      c.json = next();
    else if (a == "--prefill-path")
      c.prefill_path =
          one_of({"auto", "portable"}) == 1 ? PrefillPath::kPortable : PrefillPath::kAuto;
    else if (a == "--merge")
      c.merge = kMerges[one_of({"planned", "separate", "in-kernel"})];
    else if (a == "--launch")
      c.graph_launch = one_of({"graph", "plain"}) == 0;
    else if (a == "--profile")
      c.profile = next();
    else {
      std::fprintf(stderr, "unknown flag %s\n\n%s", a.c_str(), kUsage);
      std::exit(2);
    }
  }
  if (c.q_dtype == DType::kUnspecified) c.q_dtype = TileKvDType(c.dtype);
#ifndef PAGEDATTN_PROFILE
  if (!c.profile.empty()) {
    std::fprintf(stderr,
                 "--profile needs a profile build: this one has no phase stamps (configure with "
                 "-DPAGEDATTN_PROFILE=ON, e.g. PAGEDATTN_CMAKE_ARGS=-DPAGEDATTN_PROFILE=ON "
                 "scripts/build.sh BUILD_DIR pagedattn-bench)\n");
    std::exit(2);
  }
#endif
  // peers.py's default shapes for the suite.
  if (cases.empty()) {
    cases = c.prefill ? "4,4096 2,8192 1,16384" : "1,32768 16,4096 64,4096 256,2048 128,8192";
  }
  if (cases != "none") c.cases = ParseCases(cases);
  if (!ragged.empty()) c.cases.push_back(ParseInts(ragged, ','));
  return c;
}

// ---- Device helpers -------------------------------------------------------------------------

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

// An FP8 pool: E4M3 codes of values uniform in [-448, 448); PER_TOKEN row scales uniform in
// [0.5, 1.5) / 448, so that K and V read back about as the 16-bit pools' values.
__global__ void FillRandomFp8(uint8_t* data, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = QuantizeE4m3(448.f * HashUniform(seed, i));
  }
}
__global__ void FillRowScales(float* scales, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    scales[i] = (1.f + 0.5f * HashUniform(seed, i)) / 448.f;
  }
}

// The L2 flush's read: every 16-byte word of a buffer loaded at normal L2 priority, so that the
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

// Milliseconds between two events recorded around launch() on stream (the host waits for the
// second): one launch's time as peers.py takes it, or back-to-back launches' when launch()
// issues several.
template <typename Launch>
float EventMs(cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, Launch&& launch) {
  BENCH_CHECK_CUDA(cudaEventRecord(start, stream));
  launch();
  BENCH_CHECK_CUDA(cudaEventRecord(stop, stream));
  BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return ms;
}

// ---- One case ---------------------------------------------------------------------------------

// A case on the device: pools (copies of them, for small ones), the staged plan, its bound launch.
struct BenchCase {
  int index = 0;
  std::vector<int> ctx;                        // context length of each sequence
  std::vector<int64_t> page_offset, q_offset;  // per sequence, and the totals at [B]
  std::vector<int32_t> table;                  // the page table, pages in random pool order
  std::vector<ForwardSpan> spans;
  std::vector<float> q;  // [total_queries][Hq][D], the values staged (exact in q's dtype)
  int64_t pool_bytes = 0;
  int copies = 1;
  int copy = 0;  // the copy the bound launch reads (UseCopy)
  std::vector<void*> k_pools, v_pools;
  // With graph launches and several copies, a launcher each: each keeps its copy's graph, so
  // that rotating the copies updates no graph between timed launches. An update is host work
  // that the per-launch event times would count, and that a launch on one copy (every default
  // shape but FP8's 1 x 32768) never pays.
  std::vector<std::unique_ptr<Launcher>> copy_launchers;
  std::vector<KvScales> scales;  // an FP8 cache's, per copy
  AttentionPlan plan;
  ForwardWorkspace ws;
  ForwardLaunch launch;
  cudaStream_t stream = nullptr;
  int sms = 0;
  int64_t l2_bytes = 0;
  void* l2_scratch = nullptr;
  unsigned* sink = nullptr;
  std::vector<float> sinks;           // --sinks: one logit per q head
  float* sinks_device = nullptr;

  ~BenchCase() {
    for (void* p : k_pools) cudaFree(p);
    for (void* p : v_pools) cudaFree(p);
    for (const KvScales& s : scales) {
      cudaFree(s.k_rows);
      cudaFree(s.v_rows);
    }
    if (sinks_device) cudaFree(sinks_device);
    if (l2_scratch) cudaFree(l2_scratch);
    if (sink) cudaFree(sink);
    if (stream) cudaStreamDestroy(stream);
  }
  int64_t total_queries() const { return q_offset.back(); }
  // Points the bound launch at pool copy `c`.
  void UseCopy(int c) {
    copy = c % copies;
    launch.attention.k_cache = k_pools[copy];
    launch.attention.v_cache = v_pools[copy];
    if (!scales.empty()) launch.attention.scales = scales[copy];
  }
};

// Random pools and queries, the plan of the case through the kernel library (AttentionPlan),
// staged and uploaded by a ForwardWorkspace, bound, and --merge applied.
std::unique_ptr<BenchCase> MakeCase(const Config& cfg, const std::vector<int>& ctx, int index) {
  auto c = std::make_unique<BenchCase>();
  c->index = index;
  c->ctx = ctx;
  const int B = static_cast<int>(ctx.size());
  const int Hq = cfg.q_heads, Hkv = cfg.kv_heads, D = cfg.head_dim, ps = cfg.page_size;
  std::mt19937 rng(1234 + index);
  BENCH_CHECK_CUDA(cudaStreamCreate(&c->stream));
  int device = 0;
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDevice(&device));
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  c->sms = prop.multiProcessorCount;
  c->l2_bytes = prop.l2CacheSize;

  // Pages: each sequence's pages drawn from one random permutation of the pool.
  c->page_offset.assign(B + 1, 0);
  for (int b = 0; b < B; ++b) c->page_offset[b + 1] = c->page_offset[b] + (ctx[b] + ps - 1) / ps;
  c->table.resize(c->page_offset[B]);
  std::iota(c->table.begin(), c->table.end(), 0);
  std::shuffle(c->table.begin(), c->table.end(), rng);
  const int64_t pool_elems = c->page_offset[B] * Hkv * ps * D;
  c->pool_bytes = pool_elems * DTypeSize(cfg.dtype);

  // Pools that fit in L2 are rotated among copies so that timed reads come from HBM: enough
  // copies that the bytes one pass reads are at least twice the L2. Larger pools (every default
  // shape) are read from one copy, as peers.py reads its tensors.
  c->copies =
      2 * c->pool_bytes > 2 * c->l2_bytes
          ? 1
          : static_cast<int>(std::min<int64_t>(
                kMaxPoolCopies, std::max<int64_t>(1, (2 * c->l2_bytes + 2 * c->pool_bytes - 1) /
                                                         (2 * c->pool_bytes))));
  if (cfg.graph_launch && c->copies > 1) {
    for (int r = 0; r < c->copies; ++r) c->copy_launchers.push_back(std::make_unique<Launcher>());
  }
  for (int r = 0; r < c->copies; ++r) {
    void *k = nullptr, *v = nullptr;
    BENCH_CHECK_CUDA(cudaMalloc(&k, c->pool_bytes));
    BENCH_CHECK_CUDA(cudaMalloc(&v, c->pool_bytes));
    c->k_pools.push_back(k);
    c->v_pools.push_back(v);
    if (cfg.dtype == DType::kFloat8E4M3) {
      FillRandomFp8<<<4096, 256>>>(static_cast<uint8_t*>(k), pool_elems, 2 * r + 1);
      FillRandomFp8<<<4096, 256>>>(static_cast<uint8_t*>(v), pool_elems, 2 * r + 2);
      KvScales sc;
      sc.k = sc.v = 1.f / 448.f;  // STATIC
      if (!cfg.static_scales) {
        const int64_t rows = pool_elems / D;
        BENCH_CHECK_CUDA(cudaMalloc(&sc.k_rows, rows * sizeof(float)));
        BENCH_CHECK_CUDA(cudaMalloc(&sc.v_rows, rows * sizeof(float)));
        FillRowScales<<<1024, 256>>>(sc.k_rows, rows, 2 * r + 101);
        FillRowScales<<<1024, 256>>>(sc.v_rows, rows, 2 * r + 102);
      }
      c->scales.push_back(sc);
    } else if (cfg.dtype == DType::kBFloat16) {
      FillRandom<<<4096, 256>>>(static_cast<__nv_bfloat16*>(k), pool_elems, 2 * r + 1);
      FillRandom<<<4096, 256>>>(static_cast<__nv_bfloat16*>(v), pool_elems, 2 * r + 2);
    } else {
      FillRandom<<<4096, 256>>>(static_cast<__half*>(k), pool_elems, 2 * r + 1);
      FillRandom<<<4096, 256>>>(static_cast<__half*>(v), pool_elems, 2 * r + 2);
    }
    BENCH_CHECK_CUDA(cudaGetLastError());
  }

  // Queries: one per sequence (decode) or one per position (prefill), representable in the cache
  // dtype and in q's, so that every q dtype attends with the same values.
  c->q_offset.assign(B + 1, 0);
  for (int b = 0; b < B; ++b) c->q_offset[b + 1] = c->q_offset[b] + (cfg.prefill ? ctx[b] : 1);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  c->q.resize(c->total_queries() * Hq * D);
  std::vector<char> q_wire(c->q.size() * DTypeSize(cfg.q_dtype));
  for (size_t i = 0; i < c->q.size(); ++i) {
    char buf[4];
    StoreFromFloat(TileKvDType(cfg.dtype), buf, 0, uni(rng));
    c->q[i] = LoadAsFloat(TileKvDType(cfg.dtype), buf, 0);
    StoreFromFloat(cfg.q_dtype, q_wire.data(), static_cast<int64_t>(i), c->q[i]);
    c->q[i] = LoadAsFloat(cfg.q_dtype, q_wire.data(), static_cast<int64_t>(i));  // as staged
  }
  c->spans.resize(B);
  for (int b = 0; b < B; ++b) {
    c->spans[b] = {.q_offset = c->q_offset[b],
                   .page_table_offset = c->page_offset[b],
                   .first_new_position = ctx[b],
                   .num_queries = static_cast<int32_t>(c->q_offset[b + 1] - c->q_offset[b]),
                   .kv_len = ctx[b]};
  }

  AttentionPlanLimits limits;
  CheckLaunch(QueryPlanLimits(cfg.dtype, D, cfg.prefill_path, &limits), "plan limits");
  if (cfg.sinks) {
    for (int h = 0; h < Hq; ++h) c->sinks.push_back(1.f + 0.25f * h);
    BENCH_CHECK_CUDA(cudaMalloc(&c->sinks_device, c->sinks.size() * sizeof(float)));
    BENCH_CHECK_CUDA(cudaMemcpy(c->sinks_device, c->sinks.data(), c->sinks.size() * sizeof(float),
                                cudaMemcpyHostToDevice));
  }
  const ForwardBatch batch = {.spans = c->spans,
                              .page_table = c->table,
                              .total_queries = c->total_queries(),
                              .num_q_heads = Hq,
                              .num_kv_heads = Hkv,
                              .head_dim = D,
                              .page_size = ps,
                              .kv_dtype = cfg.dtype,
                              .q_dtype = cfg.q_dtype,
                              .kv_wire_dtype = cfg.dtype,
                              .causal = cfg.causal,
                              .sm_scale = 1.f / std::sqrt(static_cast<float>(D)),
                              .return_lse = true,
                              .window = cfg.window,
                              .softcap = cfg.softcap,
                              .sinks = c->sinks_device,
                              .kv_scales = c->scales.empty() ? KvScales{} : c->scales[0]};
  c->plan = AttentionPlan::Make(batch, limits);
  CheckLaunch(c->ws.Reserve(c->plan, c->stream), "workspace");
  c->ws.StageInputs(c->plan, q_wire.data(), nullptr, nullptr);
  CheckLaunch(c->ws.Upload(c->plan, c->stream), "upload");
  c->launch = c->ws.Bind(c->plan, c->k_pools[0], c->v_pools[0]);
  if (cfg.merge != "planned") {
    c->launch.attention.separate_merge = cfg.merge == "separate";
    c->launch.attention.pair_merge = false;  // in-kernel: the last split's merge
  }
  BENCH_CHECK_CUDA(cudaStreamSynchronize(c->stream));
  return c;
}

// The bound launch on the current copy, through that copy's launcher where it has one.
LaunchStatus Launch(BenchCase& c, Launcher& launcher) {
  Launcher& l = c.copy_launchers.empty() ? launcher : *c.copy_launchers[c.copy];
  return LaunchForwardAttention(c.launch, c.stream, l);
}

// Runs the case on pool copy 0 with its outputs poisoned, and returns the largest relative error
// of sampled rows against the float64 reference (infinite where one holds a NaN). Exits when the
// launch left a split counter non-zero (the next launch would merge wrongly).
double CheckAgainstReference(const Config& cfg, BenchCase& c, Launcher& launcher) {
  const int B = static_cast<int>(c.ctx.size());
  const int Hq = cfg.q_heads, Hkv = cfg.kv_heads, D = cfg.head_dim, ps = cfg.page_size;
  const ForwardStaging& st = c.plan.staging();
  BENCH_CHECK_CUDA(cudaMemsetAsync(static_cast<char*>(c.ws.device()) + st.out, 0xff,
                                   st.results_end - st.out, c.stream));
  c.UseCopy(0);
  CheckLaunch(Launch(c, launcher), "paged attention");
  CheckLaunch(c.ws.Download(c.plan, c.stream), "download");
  BENCH_CHECK_CUDA(cudaStreamSynchronize(c.stream));
  std::vector<int32_t> counters(st.merge_counters);
  BENCH_CHECK_CUDA(cudaMemcpy(counters.data(), c.ws.merge_counters(), counters.size() * 4,
                              cudaMemcpyDeviceToHost));
  if (std::any_of(counters.begin(), counters.end(), [](int32_t x) { return x != 0; })) {
    std::fprintf(stderr, "case %d: a split counter is not zero after a launch\n", c.index);
    std::exit(1);
  }
  const char* out = static_cast<const char*>(c.ws.host()) + st.out;

  double worst = 0;
  std::vector<int> check;
  for (int i = 0; i < std::min(kCheckSeqs, B); ++i) {
    check.push_back(static_cast<int>(int64_t{i} * (B - 1) / (kCheckSeqs - 1)));
  }
  check.erase(std::unique(check.begin(), check.end()), check.end());
  for (int b : check) {
    // The sequence's K and V from pool copy 0, page by page.
    const int L = c.ctx[b];
    // An FP8 pool's values read back as float(code) * their row's scale (or the static one).
    std::vector<float> k(int64_t{L} * Hkv * D), v(k.size());
    std::vector<uint16_t> page(int64_t{Hkv} * ps * D);
    std::vector<float> row_scales(int64_t{Hkv} * ps, 1.f);
    const size_t elem = DTypeSize(cfg.dtype);
    for (int64_t j = 0; j < c.page_offset[b + 1] - c.page_offset[b]; ++j) {
      const int64_t pg = c.table[c.page_offset[b] + j];
      for (int kv = 0; kv < 2; ++kv) {
        const char* src = static_cast<const char*>(kv == 0 ? c.k_pools[0] : c.v_pools[0]) +
                          pg * Hkv * ps * D * elem;
        BENCH_CHECK_CUDA(
            cudaMemcpy(page.data(), src, page.size() * elem, cudaMemcpyDeviceToHost));
        if (!c.scales.empty()) {
          const KvScales& sc = c.scales[0];
          const float* rows = kv == 0 ? sc.k_rows : sc.v_rows;
          if (rows != nullptr) {
            BENCH_CHECK_CUDA(cudaMemcpy(row_scales.data(), rows + pg * Hkv * ps,
                                        row_scales.size() * sizeof(float),
                                        cudaMemcpyDeviceToHost));
          } else {
            std::fill(row_scales.begin(), row_scales.end(), kv == 0 ? sc.k : sc.v);
          }
        }
        for (int h = 0; h < Hkv; ++h) {
          for (int r = 0; r < ps && j * ps + r < L; ++r) {
            for (int d = 0; d < D; ++d) {
              (kv == 0 ? k : v)[((j * ps + r) * Hkv + h) * D + d] =
                  LoadAsFloat(cfg.dtype, page.data(), (int64_t{h} * ps + r) * D + d) *
                  row_scales[int64_t{h} * ps + r];
            }
          }
        }
      }
    }
    // Decode: the sequence's one query. Prefill: a sample of query positions (first, last, tile
    // edges and between).
    std::vector<int> check_pos = {L - 1};
    if (cfg.prefill) {
      check_pos = {0, 1, 63, 64, L / 3, L / 2 + 17, L - 65, L - 1};
      for (int& x : check_pos) x = std::clamp(x, 0, L - 1);
    }
    for (int pos : check_pos) {
      const int64_t row = cfg.prefill ? c.q_offset[b] + pos : c.q_offset[b];
      std::vector<double> ref(int64_t{Hq} * D), ref_lse(Hq), got(ref.size());
      // The query at pos sees positions 0..pos (causal) or all L.
      testing::ReferenceVariant variant;
      variant.window = cfg.window;
      variant.softcap = cfg.softcap;
      variant.sinks.assign(c.sinks.begin(), c.sinks.end());
      testing::ReferenceAttention(c.q.data() + row * Hq * D, k.data(), v.data(), 1,
                                  cfg.causal ? pos + 1 : L, Hq, Hkv, D, cfg.causal,
                                  c.launch.attention.sm_scale, ref.data(), ref_lse.data(),
                                  variant);
      int64_t nans = 0;
      for (size_t e = 0; e < ref.size(); ++e) {
        got[e] = LoadAsFloat(cfg.q_dtype, out, row * Hq * D + static_cast<int64_t>(e));
        nans += std::isnan(got[e]) ? 1 : 0;
      }
      worst = std::max(
          worst, nans ? INFINITY : testing::RelativeError(got.data(), ref.data(), ref.size()));
    }
  }
  return worst;
}

// Evicts the pools from L2: a buffer of 4x the L2, written once, read (clean lines left, no
// write-backs for the timed launches to pay), as a server's L2 holds other layers' K and V.
void FlushL2(BenchCase& c) {
  const size_t bytes = 4 * static_cast<size_t>(c.l2_bytes);
  if (c.l2_scratch == nullptr) {
    BENCH_CHECK_CUDA(cudaMalloc(&c.l2_scratch, bytes));
    BENCH_CHECK_CUDA(cudaMalloc(&c.sink, sizeof(unsigned)));
    BENCH_CHECK_CUDA(cudaMemsetAsync(c.l2_scratch, 0x5a, bytes, c.stream));
  }
  TouchRead<<<c.sms * 4, 512, 0, c.stream>>>(static_cast<const uint4*>(c.l2_scratch),
                                             static_cast<int64_t>(bytes / 16), c.sink);
  BENCH_CHECK_CUDA(cudaGetLastError());
  BENCH_CHECK_CUDA(cudaStreamSynchronize(c.stream));
}

struct Timing {
  double launch_us = 0;  // median of per-launch event times
  double b2b_us = 0;     // kBackToBack launches back to back, per launch
};

// The case's launches timed after warm-up, rotating the pool copies, from an L2 without them.
Timing TimeLaunches(const Config& cfg, BenchCase& c, Launcher& launcher) {
  FlushL2(c);
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int it = 0; it < cfg.warmup + cfg.reps; ++it) {
    c.UseCopy(it);
    const float ms = EventMs(c.stream, start, stop,
                             [&] { CheckLaunch(Launch(c, launcher), "paged attention"); });
    if (it >= cfg.warmup) times.push_back(ms);
  }
  // Also back to back (no host gap between launches): the kernels' own time, for diagnosis.
  const float b2b_ms = EventMs(c.stream, start, stop, [&] {
    for (int it = 0; it < kBackToBack; ++it) {
      c.UseCopy(it);
      CheckLaunch(Launch(c, launcher), "paged attention");
    }
  });
  std::sort(times.begin(), times.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return {times[times.size() / 2] * 1e3, b2b_ms * 1e3 / kBackToBack};
}

struct Roofline {
  double read_us = 0;
  int blocks_per_sm = 0;
};

// The same K and V bytes read by StreamRead, timed the same way: the best of a few grid sizes
// (blocks of 512 threads per SM), so a decode row carries its shape's own roofline.
Roofline ReadRoofline(const Config& cfg, BenchCase& c) {
  FlushL2(c);  // after the check's reads of the pool
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  Roofline best;
  for (int per_sm : {1, 2, 4}) {
    std::vector<float> rt;
    for (int it = 0; it < cfg.warmup + cfg.reps; ++it) {
      const float ms = EventMs(c.stream, start, stop, [&] {
        StreamRead<<<c.sms * per_sm, 512, 0, c.stream>>>(
            static_cast<const uint4*>(c.k_pools[it % c.copies]),
            static_cast<const uint4*>(c.v_pools[it % c.copies]), c.pool_bytes / 16, c.sink);
      });
      if (it >= cfg.warmup) rt.push_back(ms);
    }
    BENCH_CHECK_CUDA(cudaGetLastError());
    std::sort(rt.begin(), rt.end());
    const double us = rt[rt.size() / 2] * 1e3;
    if (best.read_us == 0 || us < best.read_us) best = {us, per_sm};
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// The case's JSON row: peers.py's keys (suite, batch, ctx / seqlen, heads, head_dim, dtype,
// peer, time_us, tbps / tflops) and the bench's own.
std::string Row(const Config& cfg, const BenchCase& c, const Timing& t, const Roofline& read,
                double max_err) {
  const int B = static_cast<int>(c.ctx.size());
  const int Hq = cfg.q_heads, Hkv = cfg.kv_heads, D = cfg.head_dim;
  const AttentionWork& work = c.plan.work();
  const PagedAttentionParams& p = c.launch.attention;
  char err[32] = "null";  // JSON has no number for NaN or infinity
  if (std::isfinite(max_err)) std::snprintf(err, sizeof(err), "%.3g", max_err);
  // Blocks launched: one per decode item and kv head, and the prefill kernel's (one per
  // schedule entry when persistent, one per item and kv head otherwise).
  const size_t blocks = (work.decode_items.size() + work.decode_wide_items.size()) * Hkv +
                        (p.num_prefill_blocks > 0 ? static_cast<size_t>(p.num_prefill_blocks)
                                                  : work.prefill_items.size() * Hkv);
  const char* causal = cfg.causal ? "true" : "false";
  char row[1024];
  // A layer attention variant, when one is set: its keys before the row's closing brace.
  auto with_variant = [&](const char* r) {
    std::string out = r;
    if (cfg.window > 0 || cfg.softcap > 0.f || cfg.sinks) {
      char keys[128];
      std::snprintf(keys, sizeof(keys), ", \"window\": %d, \"softcap\": %g, \"sinks\": %s",
                    cfg.window, cfg.softcap, cfg.sinks ? "true" : "false");
      out.insert(out.size() - 1, keys);
    }
    return out;
  };
  if (cfg.prefill) {
    double flops = 0;
    for (int len : c.ctx) flops += 4.0 * Hq * double(len) * len * D * (cfg.causal ? 0.5 : 1.0);
    std::snprintf(
        row, sizeof(row),
        "{\"suite\": \"prefill\", \"batch\": %d, \"seqlen\": %d, \"q_heads\": %d, "
        "\"kv_heads\": %d, \"head_dim\": %d, \"causal\": %s, \"dtype\": \"%s\", "
        "\"q_dtype\": \"%s\", \"peer\": \"pagedattn\", \"time_us\": %.3f, \"tflops\": %.2f, "
        "\"page_size\": %d, \"b2b_time_us\": %.3f, \"max_rel_err\": %s, \"blocks\": %zu, "
        "\"kernel\": \"%s\", \"launch\": \"%s\", \"l2_flushed\": true}",
        B, c.ctx[0], Hq, Hkv, D, causal, DTypeKey(cfg.dtype), DTypeKey(cfg.q_dtype), t.launch_us,
        flops / t.launch_us / 1e6, cfg.page_size, t.b2b_us, err, blocks,
        PrefillRunsOnWgmma(cfg.prefill_path, D) ? "wgmma" : "mma.sync",
        cfg.graph_launch ? "graph" : "plain");
    return with_variant(row);
  }
  int64_t positions = 0;  // read: a window's positions only
  for (int len : c.ctx) positions += cfg.window > 0 ? std::min(len, cfg.window) : len;
  // An FP8 cache's PER_TOKEN rows carry a 4-byte scale each.
  const double row_bytes = static_cast<double>(D) * DTypeSize(cfg.dtype) +
                           (cfg.dtype == DType::kFloat8E4M3 && !cfg.static_scales ? 4 : 0);
  const double kv_bytes = 2.0 * positions * Hkv * row_bytes;
  const bool uniform =
      std::all_of(c.ctx.begin(), c.ctx.end(), [&](int x) { return x == c.ctx[0]; });
  const std::string ctx = uniform ? std::to_string(c.ctx[0]) : "\"ragged\"";
  const char* merge = work.merge_tasks.empty()              ? "none"
                      : p.separate_merge                    ? "separate"
                      : p.pair_merge && RunsNarrowDecode(p) ? "pairs"
                                                            : "in-kernel";
  std::snprintf(
      row, sizeof(row),
      "{\"suite\": \"decode\", \"batch\": %d, \"ctx\": %s, \"q_heads\": %d, \"kv_heads\": %d, "
      "\"head_dim\": %d, \"page_size\": %d, \"dtype\": \"%s\", \"q_dtype\": \"%s\", "
      "\"causal\": %s, \"peer\": \"pagedattn\", \"time_us\": %.3f, \"tbps\": %.4f, "
      "\"b2b_time_us\": %.3f, \"max_rel_err\": %s, \"kv_chunk\": %d, \"merge\": \"%s\", "
      "\"launch\": \"%s\", \"blocks\": %zu, \"blocks_per_sm\": %d, \"narrow_tile\": %s, "
      "\"pool_copies\": %d, "
      "\"positions\": %lld, "
      "\"stages\": %d, \"read_us\": %.3f, \"read_tbps\": %.4f, \"read_blocks_per_sm\": %d, "
      "\"l2_flushed\": true}",
      B, ctx.c_str(), Hq, Hkv, D, cfg.page_size, DTypeKey(cfg.dtype), DTypeKey(cfg.q_dtype), causal,
      t.launch_us, kv_bytes / t.launch_us / 1e6, t.b2b_us, err, work.kv_chunk, merge,
      cfg.graph_launch ? "graph" : "plain", blocks, work.decode_blocks_per_sm,
      RunsNarrowDecode(p) ? "true" : "false", c.copies, static_cast<long long>(positions),
      /*stages: the kernels' own, as older rows print it*/ 0, read.read_us,
      read.read_us > 0 ? kv_bytes / read.read_us / 1e6 : 0.0, read.blocks_per_sm);
  return with_variant(row);
}

#ifdef PAGEDATTN_PROFILE
// --profile: the phase stamps (kernels/device/profile.cuh) of the last of kBackToBack launches
// back to back, as b2b_time_us times them (ProfileJson's object; its summary on stderr).
std::string ProfileLaunch(const Config& cfg, BenchCase& c, Launcher& launcher) {
  namespace pf = profile;
  uint64_t* buf = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&buf, pf::kBufferBytes));
  BENCH_CHECK_CUDA(cudaMemsetAsync(buf, 0, pf::kBufferBytes, c.stream));
  FlushL2(c);
  for (int it = 0; it < kBackToBack; ++it) {
    c.UseCopy(it);
    c.launch.attention.profile = it + 1 == kBackToBack ? buf : nullptr;
    CheckLaunch(Launch(c, launcher), "paged attention");
  }
  c.launch.attention.profile = nullptr;
  std::vector<uint64_t> stamps(size_t{pf::kSlots} * pf::kEvents);
  BENCH_CHECK_CUDA(cudaMemcpyAsync(stamps.data(), buf, pf::kBufferBytes, cudaMemcpyDeviceToHost,
                                   c.stream));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(c.stream));
  BENCH_CHECK_CUDA(cudaFree(buf));
  std::ostringstream head;
  head << "\"suite\": \"" << (cfg.prefill ? "prefill" : "decode")
       << "\", \"batch\": " << c.ctx.size() << ", \"ctx\": " << c.ctx[0]
       << ", \"head_dim\": " << cfg.head_dim << ", \"dtype\": \"" << DTypeKey(cfg.dtype)
       << "\", \"static_scales\": " << (cfg.static_scales ? "true" : "false");
  std::string summary;
  std::string json = ProfileJson(head.str(), stamps, &summary);
  std::fprintf(stderr, "profile, case %d:\n%s", c.index, summary.c_str());
  return json;
}
#endif

// Checks, times, checks again (a launch that left state behind shows in the second check), and
// reads the roofline; a case over the tolerance is neither timed nor reported. With --profile
// (a profile build), *profile gets the case's phase stamps (ProfileLaunch).
std::string RunCase(const Config& cfg, const std::vector<int>& ctx, int index, Launcher& launcher,
                    std::string* profile) {
  std::unique_ptr<BenchCase> c = MakeCase(cfg, ctx, index);
  // bf16's 8 bits (in the cache, or in q and out) bound the accuracy; f16's 11 otherwise.
  const bool bf16 = cfg.dtype == DType::kBFloat16 || cfg.q_dtype == DType::kBFloat16;
  const double tol = bf16 ? 1e-2 : 2e-3;
  double worst = 0;
  auto check = [&](const char* when) {
    worst = std::max(worst, CheckAgainstReference(cfg, *c, launcher));
    if (!(worst <= tol)) {
      std::fprintf(stderr, "case %d: relative error %.3g %s exceeds %.1g\n", index, worst, when,
                   tol);
      std::exit(1);
    }
  };
  check("before timing");
  const Timing t = TimeLaunches(cfg, *c, launcher);
  check("after timing");
#ifdef PAGEDATTN_PROFILE
  if (!cfg.profile.empty()) *profile = ProfileLaunch(cfg, *c, launcher);
#else
  (void)profile;
#endif
  const Roofline read = cfg.prefill ? Roofline{} : ReadRoofline(cfg, *c);
  return Row(cfg, *c, t, read, worst);
}

}  // namespace
}  // namespace pagedattn::kernels

int main(int argc, char** argv) {
  using namespace pagedattn::kernels;
  const Config cfg = ParseFlags(argc, argv);
  Launcher launcher(cfg.graph_launch);
  std::vector<std::string> rows, profiles;
  for (size_t i = 0; i < cfg.cases.size(); ++i) {
    std::string profile;
    rows.push_back(RunCase(cfg, cfg.cases[i], static_cast<int>(i), launcher, &profile));
    if (!profile.empty()) profiles.push_back(profile);
    std::printf("%s\n", rows.back().c_str());
    std::fflush(stdout);
  }
  // A JSON array of objects, one a line.
  auto write_array = [](const std::string& path, const std::vector<std::string>& objects) {
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return false;
    }
    std::fprintf(f, "[\n");
    for (size_t i = 0; i < objects.size(); ++i) {
      std::fprintf(f, " %s%s\n", objects[i].c_str(), i + 1 < objects.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
    return true;
  };
  if (!cfg.json.empty() && !write_array(cfg.json, rows)) return 1;
  if (!cfg.profile.empty() && !write_array(cfg.profile, profiles)) return 1;
  return 0;
}
