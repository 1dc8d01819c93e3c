// CacheConfig validation: every rule, several violations at once, overflow, memory.
#include "server/core/cache_config.h"

#include <gtest/gtest.h>

#include <limits>

#include "common/capabilities.h"
#include "common/dtype.h"

namespace pagedattn {
namespace {

CacheConfigRequest Valid() {
  CacheConfigRequest c;
  c.num_layers = 4;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_size = 16;
  c.kv_dtype = DType::kBFloat16;
  c.num_pages = 100;
  return c;
}

ValidationContext Ctx(BackendKind b = BackendKind::kCpu, int64_t free = int64_t{1} << 34) {
  ValidationContext ctx;
  ctx.backend = b;
  ctx.device_count = 1;
  ctx.free_bytes = free;
  return ctx;
}

std::vector<std::string> Fields(const ValidationResult& r) {
  std::vector<std::string> f;
  for (const auto& v : r.violations) f.push_back(v.field);
  return f;
}

TEST(CacheConfigTest, ValidConfigResolvesSize) {
  ValidationResult r = ValidateCacheConfig(Valid(), Ctx());
  ASSERT_TRUE(r.valid());
  EXPECT_EQ(r.geometry.num_pages, 100);
  // 2 (K,V) x 4 layers x 8 heads x 16 tokens x 128 dims x 2 bytes per page.
  EXPECT_EQ(r.bytes, 100 * 2 * 4 * 8 * 16 * 128 * 2);
  EXPECT_TRUE(r.fits);
  EXPECT_TRUE(ValidationStatus(r).ok());
}

TEST(CacheConfigTest, EveryPageSizeInRangeIsAccepted) {
  for (int p : {1, 3, 7, 16, 31, 100, 257, 1000, 1024}) {
    CacheConfigRequest c = Valid();
    c.page_size = p;
    EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid()) << p;
  }
}

TEST(CacheConfigTest, PageSizeOutOfRange) {
  for (int p : {0, -1, 1025, 4096}) {
    CacheConfigRequest c = Valid();
    c.page_size = p;
    ValidationResult r = ValidateCacheConfig(c, Ctx());
    ASSERT_EQ(Fields(r), std::vector<std::string>{"page_size"}) << p;
    EXPECT_NE(r.violations[0].description.find(absl::StrCat("(got ", p)), std::string::npos);
    EXPECT_NE(r.violations[0].description.find("1..1024"), std::string::npos);
  }
}

// One layer's K rows stay below 2^31 (the kernels' 32-bit row and position indices): a larger
// num_pages is refused with the largest that fits; a default capacity stops there.
TEST(CacheConfigTest, PoolRowsStayBelowTwoToThe31) {
  CacheConfigRequest c = Valid();
  c.num_layers = 1;
  c.num_kv_heads = 8;
  c.num_q_heads = 8;
  c.head_dim = 64;
  c.page_size = 1024;
  c.kv_dtype = DType::kFloat8E4M3;
  const int64_t max_pages = ((int64_t{1} << 31) - 1) / (8 * 1024);  // 262143
  c.num_pages = max_pages + 1;
  ValidationResult r = ValidateCacheConfig(c, Ctx(BackendKind::kCuda, int64_t{1} << 50));
  ASSERT_EQ(Fields(r), std::vector<std::string>{"num_pages"});
  EXPECT_NE(r.violations[0].description.find(absl::StrCat("nearest valid: ", max_pages)),
            std::string::npos)
      << r.violations[0].description;
  c.num_pages = max_pages;
  EXPECT_TRUE(ValidateCacheConfig(c, Ctx(BackendKind::kCuda, int64_t{1} << 50)).valid());
  c.num_pages.reset();  // the default capacity of a (hypothetical) 1 PiB device
  r = ValidateCacheConfig(c, Ctx(BackendKind::kCuda, int64_t{1} << 50));
  ASSERT_TRUE(r.valid());
  EXPECT_EQ(r.geometry.num_pages, max_pages);
}

// A head_dim the backend's table lists but the requested device cannot run (its shared memory
// a block) is refused at validation, naming why and the head dims that device runs.
TEST(CacheConfigTest, AHeadDimTheDeviceCannotRunIsRefused) {
  CacheConfigRequest c = Valid();
  c.head_dim = 256;
  ValidationContext ctx = Ctx(BackendKind::kCuda);
  int asked = 0;
  ctx.device_runs = [&](DType, int head_dim) {
    ++asked;
    return head_dim >= 192 ? absl::FailedPreconditionError("too little shared memory")
                           : absl::OkStatus();
  };
  ValidationResult r = ValidateCacheConfig(c, ctx);
  ASSERT_EQ(Fields(r), std::vector<std::string>{"head_dim"});
  EXPECT_NE(r.violations[0].description.find(
                "head_dim 256 with kv_dtype BFLOAT16 does not run on device 0 (too little shared "
                "memory); head dims it runs: 64, 80, 96, 128"),
            std::string::npos)
      << r.violations[0].description;
  c.head_dim = 128;
  asked = 0;
  EXPECT_TRUE(ValidateCacheConfig(c, ctx).valid());
  EXPECT_EQ(asked, 1);
  c.head_dim = 100;  // a head_dim the tables refuse is not asked about
  asked = 0;
  EXPECT_EQ(Fields(ValidateCacheConfig(c, ctx)), std::vector<std::string>{"head_dim"});
  EXPECT_EQ(asked, 0);
  c.head_dim = 256;  // asked beside another field's violation: one answer names both
  c.page_size = 0;
  EXPECT_EQ(Fields(ValidateCacheConfig(c, ctx)),
            (std::vector<std::string>{"page_size", "head_dim"}));
}

TEST(CacheConfigTest, HeadDimNamesNearestValid) {
  CacheConfigRequest c = Valid();
  c.head_dim = 100;
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"head_dim"});
  EXPECT_NE(r.violations[0].description.find("nearest valid: 96"), std::string::npos);
  r = ValidateCacheConfig(c, Ctx(BackendKind::kCuda));
  EXPECT_NE(r.violations[0].description.find("nearest valid: 96"), std::string::npos);
  // Each backend names its own table (today the same): 400 is nearest 512 on both.
  c.head_dim = 400;
  r = ValidateCacheConfig(c, Ctx());
  EXPECT_NE(r.violations[0].description.find("nearest valid: 512"), std::string::npos);
  r = ValidateCacheConfig(c, Ctx(BackendKind::kCuda));
  EXPECT_NE(r.violations[0].description.find("nearest valid: 512"), std::string::npos);
  // Halfway between two: both named.
  c.head_dim = 160;
  r = ValidateCacheConfig(c, Ctx(BackendKind::kCuda));
  EXPECT_NE(r.violations[0].description.find("nearest valid: 128 or 192)"), std::string::npos)
      << r.violations[0].description;
  EXPECT_NE(r.violations[0].description.find("64, 80, 96, 128, 192, 256, 512 on the cuda backend"),
            std::string::npos)
      << r.violations[0].description;
  for (int d : {80, 96, 192, 512}) {
    c.head_dim = d;
    EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid()) << d;
    EXPECT_TRUE(ValidateCacheConfig(c, Ctx(BackendKind::kCuda)).valid()) << d;
  }
}

TEST(CacheConfigTest, GqaRules) {
  CacheConfigRequest c = Valid();
  c.num_q_heads = 32;
  c.num_kv_heads = 5;
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"num_q_heads"});
  EXPECT_NE(r.violations[0].description.find("30 or 35"), std::string::npos);
  c.num_q_heads = 64;
  c.num_kv_heads = 1;  // ratio 64 > kMaxGqaRatio
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"num_q_heads"});
  c.num_q_heads = 0;
  c.num_kv_heads = 0;
  r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r), (std::vector<std::string>{"num_kv_heads", "num_q_heads"}));
  c.num_q_heads = 3;
  c.num_kv_heads = 6;  // fewer q heads than kv heads
  r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r), std::vector<std::string>{"num_q_heads"});
}

TEST(CacheConfigTest, DTypeRulesDependOnBackend) {
  CacheConfigRequest c = Valid();
  c.kv_dtype = DType::kUnspecified;
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())), std::vector<std::string>{"kv_dtype"});
  c.kv_dtype = static_cast<DType>(42);
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())), std::vector<std::string>{"kv_dtype"});
  c.kv_dtype = DType::kFloat32;
  EXPECT_TRUE(ValidateCacheConfig(c, Ctx(BackendKind::kCpu)).valid());
  ValidationResult r = ValidateCacheConfig(c, Ctx(BackendKind::kCuda));
  ASSERT_EQ(Fields(r), std::vector<std::string>{"kv_dtype"});
  EXPECT_NE(r.violations[0].description.find("cuda"), std::string::npos);
}

TEST(CacheConfigTest, IssueExampleReportsAllFourViolations) {
  CacheConfigRequest c = Valid();
  c.page_size = 0;
  c.head_dim = 100;
  c.num_q_heads = 32;
  c.num_kv_heads = 5;
  c.kv_dtype = DType::kUnspecified;
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r),
            (std::vector<std::string>{"num_q_heads", "head_dim", "page_size", "kv_dtype"}));
  absl::Status s = ValidationStatus(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  for (const char* needle : {"page_size", "head_dim", "num_q_heads", "kv_dtype", "4 violations"}) {
    EXPECT_NE(s.message().find(needle), std::string::npos) << needle;
  }
  std::vector<FieldViolation> round_trip = FieldViolationsFromStatus(s);
  ASSERT_EQ(round_trip.size(), 4u);
  EXPECT_EQ(round_trip[2].field, "page_size");
  EXPECT_EQ(round_trip[2].description, r.violations[2].description);
}

TEST(CacheConfigTest, LayersDeviceAndCapacityRules) {
  CacheConfigRequest c = Valid();
  c.num_layers = 0;
  c.device = 3;
  c.max_bytes = 1000;  // with num_pages too
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())),
            (std::vector<std::string>{"num_layers", "device", "capacity"}));
  c = Valid();
  c.num_pages = 0;
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())), std::vector<std::string>{"num_pages"});
  c.num_pages.reset();
  c.max_bytes = 10;  // less than one page
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"max_bytes"});
  EXPECT_NE(r.violations[0].description.find("nearest valid max_bytes"), std::string::npos);
}

TEST(CacheConfigTest, MaxBytesAndDefaultCapacity) {
  CacheConfigRequest c = Valid();
  c.num_pages.reset();
  const int64_t page = 2 * 4 * 8 * 16 * 128 * 2;
  c.max_bytes = 10 * page + page / 2;
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid());
  EXPECT_EQ(r.geometry.num_pages, 10);
  c.max_bytes.reset();
  r = ValidateCacheConfig(c, Ctx(BackendKind::kCpu, 100 * page));
  ASSERT_TRUE(r.valid());
  EXPECT_EQ(r.geometry.num_pages, 90);  // kDefaultPoolFraction of free memory
  EXPECT_TRUE(r.fits);
}

TEST(CacheConfigTest, SizeOverflowIsAViolation) {
  CacheConfigRequest c = Valid();
  c.num_layers = kMaxNumLayers;
  c.num_q_heads = kMaxNumHeads;
  c.num_kv_heads = kMaxNumHeads;
  c.head_dim = 256;
  c.page_size = 1024;
  c.kv_dtype = DType::kFloat32;
  c.num_pages = std::numeric_limits<int32_t>::max();
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"num_pages"});
  // The 2^31 rows' bound comes first (and keeps every pool under 2^56 bytes).
  EXPECT_NE(r.violations[0].description.find("below 2^31"), std::string::npos);
}

TEST(CacheConfigTest, TooLargeForMemoryIsResourceExhaustedWithNumbers) {
  CacheConfigRequest c = Valid();
  c.num_pages = 1000;
  ValidationResult r = ValidateCacheConfig(c, Ctx(BackendKind::kCpu, 12345678));
  ASSERT_TRUE(r.valid());
  EXPECT_FALSE(r.fits);
  absl::Status s = ValidationStatus(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find(absl::StrCat(r.bytes)), std::string::npos);
  EXPECT_NE(s.message().find("12345678"), std::string::npos);
}

TEST(CacheConfigTest, LayerVariantsResolvePerLayer) {
  CacheConfigRequest c = Valid();  // 4 layers: Gemma-style, windowed and global alternating
  LayerAttentionRequest windowed, global;
  windowed.sliding_window = 4096;
  windowed.logit_softcap = 50.f;
  global.logit_softcap = 50.f;
  c.layers = {windowed, global, windowed, global};
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid()) << Fields(r).size();
  ASSERT_EQ(r.geometry.layers.size(), 4u);
  EXPECT_EQ(r.geometry.attention(0)->sliding_window, 4096);
  EXPECT_EQ(r.geometry.attention(1)->sliding_window, 0);
  EXPECT_EQ(r.geometry.attention(1)->logit_softcap, 50.f);
  // One entry holds for every layer; sinks one per q head.
  LayerAttentionRequest sinks;
  sinks.sinks.assign(32, 0.5f);
  c.layers = {sinks};
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid());
  for (int l = 0; l < 4; ++l) EXPECT_EQ(r.geometry.attention(l)->sinks.size(), 32u);
  // Entries with no option set: every layer plain, nothing kept.
  c.layers = {LayerAttentionRequest{}};
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid());
  EXPECT_TRUE(r.geometry.layers.empty());
  EXPECT_EQ(r.geometry.attention(2), nullptr);
}

TEST(CacheConfigTest, LayerVariantRulesNameTheFieldAndTheValue) {
  CacheConfigRequest c = Valid();
  c.layers.resize(3);  // neither 1 nor num_layers
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r), std::vector<std::string>{"layers"});
  EXPECT_NE(r.violations[0].description.find("(got 3)"), std::string::npos);

  c.layers.assign(4, LayerAttentionRequest{});
  c.layers[0].sliding_window = 0;
  c.layers[1].logit_softcap = -1.f;
  c.layers[2].sinks.assign(31, 0.f);
  c.layers[3].sinks.assign(32, 0.f);
  c.layers[3].sinks[5] = std::numeric_limits<float>::infinity();
  r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r),
            (std::vector<std::string>{"layers[0].sliding_window", "layers[1].logit_softcap",
                                      "layers[2].sinks", "layers[3].sinks"}));
  EXPECT_NE(r.violations[0].description.find("(got 0)"), std::string::npos);
  EXPECT_NE(r.violations[2].description.find("num_q_heads=32"), std::string::npos);
  EXPECT_NE(r.violations[3].description.find("sinks[5]"), std::string::npos);
}

// A request of many bad layer entries (a few bytes each on the wire) would otherwise make a
// violation each, and an answer and memory many times the request's size: the first 8 are named,
// the rest counted in one more.
TEST(CacheConfigTest, BadLayerEntriesAreNamedUpToEightThenCounted) {
  CacheConfigRequest c = Valid();
  LayerAttentionRequest bad;
  bad.sliding_window = -1;
  bad.logit_softcap = -1.f;
  c.layers.assign(100000, bad);
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  std::vector<std::string> want = {"layers"};  // its count: neither 1 nor num_layers
  for (int i = 0; i < 8; ++i) {
    want.push_back("layers[" + std::to_string(i) + "].sliding_window");
    want.push_back("layers[" + std::to_string(i) + "].logit_softcap");
  }
  want.push_back("layers");
  EXPECT_EQ(Fields(r), want);
  EXPECT_EQ(r.violations.back().description,
            "99992 more entries of layers have invalid options (the first 8 bad entries are "
            "named)");
  // Eight bad entries are all named, with no count after them.
  c.num_layers = 8;
  c.layers.assign(8, bad);
  c.layers.push_back(LayerAttentionRequest{});
  r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(r.violations.size(), 1u + 16u);
}

TEST(CacheConfigTest, SinksOfEveryLayerAreBoundedInAll) {
  CacheConfigRequest c = Valid();
  c.num_layers = 256;
  c.num_q_heads = c.num_kv_heads = 256;
  LayerAttentionRequest sinks;
  sinks.sinks.assign(256, 0.5f);
  c.layers.assign(256, sinks);  // 65536 values: the most a config may hold
  EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid());
  c.num_layers = 257;
  c.layers.push_back(sinks);
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r), std::vector<std::string>{"layers"});
  EXPECT_NE(r.violations[0].description.find("65792 values in all; at most 65536"),
            std::string::npos)
      << r.violations[0].description;
  // One entry stands for every layer: counted as the cache holds it (257 x 256).
  c.layers = {sinks};
  r = ValidateCacheConfig(c, Ctx());
  EXPECT_EQ(Fields(r), std::vector<std::string>{"layers"});
  EXPECT_NE(r.violations[0].description.find("65792 values in all (one entry's"), std::string::npos)
      << r.violations[0].description;
  c.num_layers = 256;
  EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid());
}

// Caps and sinks whose arithmetic leaves float's range (sm_scale over a small cap, a large cap
// or sink in log2 units) are refused with the range; the range's ends are accepted.
TEST(CacheConfigTest, VariantValuesStayWithinFloatsRange) {
  CacheConfigRequest c = Valid();
  c.layers.assign(1, LayerAttentionRequest{});
  for (float cap : {1e-39f, 1e-45f, 1e-7f, 1e30f, std::numeric_limits<float>::max()}) {
    c.layers[0].logit_softcap = cap;
    ValidationResult r = ValidateCacheConfig(c, Ctx());
    ASSERT_EQ(Fields(r), std::vector<std::string>{"layers[0].logit_softcap"}) << cap;
    EXPECT_NE(r.violations[0].description.find("must be in"), std::string::npos)
        << r.violations[0].description;
  }
  for (float cap : {kMinLogitSoftcap, kMaxLogitSoftcap, 30.f}) {
    c.layers[0].logit_softcap = cap;
    EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid()) << cap;
  }
  c.layers[0].logit_softcap.reset();
  c.layers[0].sinks.assign(32, 0.5f);
  for (float sink : {3e38f, -1e20f}) {
    c.layers[0].sinks[7] = sink;
    ValidationResult r = ValidateCacheConfig(c, Ctx());
    ASSERT_EQ(Fields(r), std::vector<std::string>{"layers[0].sinks"}) << sink;
    EXPECT_NE(r.violations[0].description.find("sinks[7]"), std::string::npos);
  }
  c.layers[0].sinks[7] = -kMaxSinkMagnitude;
  EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid());
  // Every bad sink is named, not the first alone (the first 8, then how many more).
  c.layers[0].sinks[3] = std::numeric_limits<float>::quiet_NaN();
  c.layers[0].sinks[7] = std::numeric_limits<float>::infinity();
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"layers[0].sinks"});
  EXPECT_NE(r.violations[0].description.find("sinks[3] is nan, sinks[7] is inf"), std::string::npos)
      << r.violations[0].description;
  c.layers[0].sinks.assign(32, 1e30f);
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"layers[0].sinks"});
  EXPECT_NE(r.violations[0].description.find("sinks[7] is 1e+30 and 24 more"), std::string::npos)
      << r.violations[0].description;
}

TEST(CacheConfigTest, LayerVariantsRunOnEveryBackend) {
  CacheConfigRequest c = Valid();
  LayerAttentionRequest l;
  l.sliding_window = 128;
  l.logit_softcap = 30.f;
  l.sinks.assign(32, 0.f);
  c.layers = {l};
  for (BackendKind backend : {BackendKind::kCpu, BackendKind::kCuda}) {
    ValidationResult r = ValidateCacheConfig(c, Ctx(backend));
    EXPECT_TRUE(r.valid()) << (backend == BackendKind::kCpu ? "cpu" : "cuda") << ": "
                           << Fields(r).size() << " violations";
    EXPECT_EQ(r.geometry.layers.size(), 4u);  // one entry: every layer alike
  }
}

// A config whose one query's answer cannot fit the server's largest message would have every
// Forward that queries refused: it is refused at creation, naming the sizes.
TEST(CacheConfigTest, OneQuerysAnswerMustFitAMessage) {
  CacheConfigRequest c = Valid();  // 32 heads x 128: 32 x 516 + 256 = 16768 bytes
  ValidationContext ctx = Ctx();
  ctx.max_message_bytes = 16768;
  EXPECT_TRUE(ValidateCacheConfig(c, ctx).valid());
  ctx.max_message_bytes = 16767;
  ValidationResult r = ValidateCacheConfig(c, ctx);
  ASSERT_EQ(Fields(r), std::vector<std::string>{"num_q_heads"});
  EXPECT_NE(r.violations[0].description.find("takes 16768 bytes, over the server's largest "
                                             "message of 16767 bytes (--max_message_mb)"),
            std::string::npos)
      << r.violations[0].description;
}

// One answer names every field it can: the checks that need other fields valid (one query's
// answer against the largest message, the pool's 32-bit rows) run wherever those fields are, so
// a config broken three ways is not refused one field a round. A num_pages past what the rows
// allow names the bound for this config, not int32's.
TEST(CacheConfigTest, EveryViolationIsNamedAtOnce) {
  CacheConfigRequest c = Valid();
  c.head_dim = 100;
  c.num_q_heads = 1024;
  c.num_kv_heads = 64;
  c.page_size = 1024;
  c.num_pages = 1000000;
  ValidationContext ctx = Ctx();
  ctx.max_message_bytes = 1 << 19;
  ValidationResult r = ValidateCacheConfig(c, ctx);
  EXPECT_EQ(Fields(r), (std::vector<std::string>{"head_dim", "num_pages"}));
  c.head_dim = 128;  // 1024 heads x 128: one query's answer takes 528640 bytes
  r = ValidateCacheConfig(c, ctx);
  EXPECT_EQ(Fields(r), (std::vector<std::string>{"num_pages", "num_q_heads"}));
  ASSERT_FALSE(r.violations.empty());
  EXPECT_NE(r.violations[0].description.find("nearest valid: 32767"), std::string::npos)
      << r.violations[0].description;
  c.num_pages = int64_t{3} << 30;
  r = ValidateCacheConfig(c, ctx);
  ASSERT_FALSE(r.violations.empty());
  EXPECT_NE(r.violations[0].description.find("num_pages must be in 1..32767 (got 3221225472)"),
            std::string::npos)
      << r.violations[0].description;
}

// FP8: PER_TOKEN by default, its rows' scales counted in the page's bytes; STATIC with its
// scales (for every layer alike, or per layer); on either backend.
TEST(CacheConfigTest, Fp8CachesScaleTheirValues) {
  CacheConfigRequest c = Valid();
  c.kv_dtype = DType::kFloat8E4M3;
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid()) << Fields(r).size();
  EXPECT_EQ(r.geometry.kv_scaling, KvScaling::kPerToken);
  // 2 x 4 layers x 8 heads x 16 tokens x (128 one-byte values + a 4-byte scale).
  EXPECT_EQ(r.geometry.BytesPerPage(), 2 * 4 * 8 * 16 * (128 + 4));
  EXPECT_EQ(r.bytes, 100 * r.geometry.BytesPerPage());

  c.kv_scaling = KvScaling::kStatic;
  c.kv_scales = {0.5f, 0.25f};
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid());
  EXPECT_EQ(r.geometry.BytesPerPage(), 2 * 4 * 8 * 16 * 128);
  EXPECT_EQ(r.geometry.kv_scales,
            (std::vector<float>{0.5f, 0.25f, 0.5f, 0.25f, 0.5f, 0.25f, 0.5f, 0.25f}));
  c.kv_scales = {1, 2, 3, 4, 5, 6, 7, 8};
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_TRUE(r.valid());
  EXPECT_EQ(r.geometry.kv_scales[6], 7.f);

  EXPECT_TRUE(ValidateCacheConfig(c, Ctx(BackendKind::kCuda)).valid());
}

TEST(CacheConfigTest, Fp8ScalingRulesNameTheFieldAndTheValue) {
  CacheConfigRequest c = Valid();
  c.kv_dtype = DType::kFloat8E4M3;
  c.kv_scaling = KvScaling::kStatic;  // and no scales: never a silent 1.0
  ValidationResult r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"kv_scales"});
  EXPECT_NE(r.violations[0].description.find("(got 0)"), std::string::npos)
      << r.violations[0].description;
  c.kv_scales = {1.f, 2.f, 3.f};  // neither 2 nor 2 x num_layers
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())), std::vector<std::string>{"kv_scales"});
  // A subnormal scale's inverse overflows (the values it stores would read 0 * inf = NaN).
  for (float bad : {0.f, -1.f, 1e-39f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    c.kv_scales = {1.f, bad};
    r = ValidateCacheConfig(c, Ctx());
    ASSERT_EQ(Fields(r), std::vector<std::string>{"kv_scales"}) << bad;
    EXPECT_NE(r.violations[0].description.find("kv_scales[1]"), std::string::npos);
    EXPECT_NE(r.violations[0].description.find("at least"), std::string::npos);
  }
  // Every bad scale is named, not the first alone.
  c.kv_scales = {-1.f, std::numeric_limits<float>::quiet_NaN()};
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"kv_scales"});
  EXPECT_NE(r.violations[0].description.find("kv_scales[0] is -1, kv_scales[1] is nan"),
            std::string::npos)
      << r.violations[0].description;
  c.kv_scales = {kFp8MinStaticScale, 1.f};
  EXPECT_TRUE(ValidateCacheConfig(c, Ctx()).valid());
  c.kv_scaling = KvScaling::kPerToken;  // scales without STATIC
  c.kv_scales = {1.f, 1.f};
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())), std::vector<std::string>{"kv_scales"});
  c.kv_scales.clear();
  c.kv_dtype = DType::kBFloat16;  // scaling on a 16-bit cache
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"kv_scaling"});
  EXPECT_NE(r.violations[0].description.find("BFLOAT16"), std::string::npos);
  EXPECT_NE(r.violations[0].description.find("PER_TOKEN"), std::string::npos);
  // STATIC with scales on a 16-bit cache: both refused as meaningless there, neither message
  // asking for what the other refuses.
  c.kv_scaling = KvScaling::kStatic;
  c.kv_scales = {1.f, 1.f};
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), (std::vector<std::string>{"kv_scaling", "kv_scales"}));
  EXPECT_NE(r.violations[1].description.find(
                "kv_scales apply to FLOAT8_E4M3 caches only (got 2 values with kv_dtype BFLOAT16)"),
            std::string::npos)
      << r.violations[1].description;
  c.kv_scales.clear();
  r = ValidateCacheConfig(c, Ctx());
  ASSERT_EQ(Fields(r), std::vector<std::string>{"kv_scaling"}) << "no call for scales";
  c.kv_scaling = KvScaling::kPerToken;
  c.kv_dtype = static_cast<DType>(5);  // a dtype this server does not know: named by number
  r = ValidateCacheConfig(c, Ctx());
  bool named = false;
  for (const FieldViolation& v : r.violations) {
    if (v.field == "kv_scaling") named = v.description.find("with kv_dtype 5)") != std::string::npos;
  }
  EXPECT_TRUE(named) << ValidationStatus(r);
  c.kv_dtype = DType::kBFloat16;
  c.kv_scaling = static_cast<KvScaling>(7);
  EXPECT_EQ(Fields(ValidateCacheConfig(c, Ctx())), std::vector<std::string>{"kv_scaling"});
}

}  // namespace
}  // namespace pagedattn
