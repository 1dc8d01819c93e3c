// CacheConfig validation rules. Each rule reports the field, the value received and what
// would be valid (the nearest valid value where there is one); all rules run every time.
#include "server/core/cache_config.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "server/core/error_info.h"

namespace pagedattn {
namespace {

std::vector<int> HeadDims(BackendKind backend) {
  return backend == BackendKind::kCuda
             ? std::vector<int>(kCudaHeadDims.begin(), kCudaHeadDims.end())
             : std::vector<int>(kCpuHeadDims.begin(), kCpuHeadDims.end());
}

std::string HeadDimList(BackendKind backend) { return absl::StrJoin(HeadDims(backend), ", "); }

// The supported head dims nearest head_dim: one, or the two equally near ("128 or 192").
std::string NearestHeadDims(BackendKind backend, int head_dim) {
  const std::vector<int> dims = HeadDims(backend);
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int d : dims) best = std::min(best, std::abs(int64_t{d} - head_dim));
  std::vector<int> nearest;
  for (int d : dims) {
    if (std::abs(int64_t{d} - head_dim) == best) nearest.push_back(d);
  }
  return absl::StrJoin(nearest, " or ");
}

std::string KvDTypeList(BackendKind backend) {
  std::vector<std::string> names;
  auto add = [&](auto& table) {
    for (DType d : table) names.emplace_back(DTypeName(d));
  };
  if (backend == BackendKind::kCuda) {
    add(kCudaKvDTypes);
  } else {
    add(kCpuKvDTypes);
  }
  return absl::StrJoin(names, ", ");
}

// a * b, or nullopt on overflow of int64.
std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The entries of `values` that `ok` refuses, named as "field[i] is x" (the first 8, then how
// many more), or "" when there are none: a violation names every bad entry, not the first alone.
template <typename Ok>
std::string BadEntries(absl::string_view field, const std::vector<float>& values, Ok&& ok) {
  constexpr int kShown = 8;
  std::string bad;
  int num_bad = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (ok(values[i])) continue;
    if (num_bad++ < kShown) {
      absl::StrAppend(&bad, bad.empty() ? "" : ", ", field, "[", i, "] is ", values[i]);
    }
  }
  if (num_bad > kShown) absl::StrAppend(&bad, " and ", num_bad - kShown, " more");
  return bad;
}

const char* BackendName(BackendKind backend) {
  return backend == BackendKind::kCuda ? "cuda" : "cpu";
}

// The rules of CacheConfig.layers: how many entries, and each option's range and backend.
template <typename Violate>
void ValidateLayers(const CacheConfigRequest& c, BackendKind backend, Violate&& violate) {
  const size_t n = c.layers.size();
  if (n > 1 && static_cast<int64_t>(n) != c.num_layers) {
    violate("layers", absl::StrCat("layers must have 0, 1 (every layer) or num_layers=",
                                   c.num_layers, " entries (got ", n, ")"));
  }
  // Counted as the cache holds them: one entry's sinks for every layer.
  int64_t sink_values = 0;
  for (const LayerAttentionRequest& l : c.layers) {
    sink_values += static_cast<int64_t>(l.sinks.size());
  }
  if (n == 1) sink_values *= std::max<int64_t>(c.num_layers, 0);
  if (sink_values > kMaxSinkValues) {
    violate("layers", absl::StrCat("the layers' sinks hold ", sink_values, " values in all",
                                   n == 1 ? " (one entry's, for each of num_layers layers)" : "",
                                   "; at most ", kMaxSinkValues,
                                   " (a config travels in every answer that describes its cache)"));
  }
  // The first kShownEntries bad entries are named, the others counted: a request of millions
  // of entries (a few bytes each) would otherwise make a violation each, and an answer and
  // memory many times its size. Messages are built only for the entries named.
  constexpr int64_t kShownEntries = 8;
  int64_t bad_entries = 0;
  for (size_t i = 0; i < n; ++i) {
    const LayerAttentionRequest& l = c.layers[i];
    bool entry_bad = false;
    auto violate_entry = [&](const char* option, auto&& describe) {
      if (!entry_bad) ++bad_entries;
      entry_bad = true;
      if (bad_entries <= kShownEntries) {
        violate(absl::StrCat("layers[", i, "].", option), describe());
      }
    };
    auto unsupported = [&](const char* option, bool supported) {
      if (supported) return false;
      violate_entry(option, [&] {
        return absl::StrCat(option, " is not supported by the ", BackendName(backend),
                            " backend (see ServerInfo.capabilities)");
      });
      return true;
    };
    if (l.sliding_window.has_value() &&
        !unsupported("sliding_window", SupportsSlidingWindow(backend)) &&
        (*l.sliding_window < 1 || *l.sliding_window > kMaxSlidingWindow)) {
      violate_entry("sliding_window", [&] {
        return absl::StrCat("sliding_window must be in 1..", kMaxSlidingWindow,
                            " positions, or unset for none (got ", *l.sliding_window, ")");
      });
    }
    if (l.logit_softcap.has_value() &&
        !unsupported("logit_softcap", SupportsLogitSoftcap(backend)) &&
        !(*l.logit_softcap >= kMinLogitSoftcap && *l.logit_softcap <= kMaxLogitSoftcap)) {
      violate_entry("logit_softcap", [&] {
        return absl::StrCat("logit_softcap must be in ", kMinLogitSoftcap, " (2^-20) .. ",
                            kMaxLogitSoftcap, " (2^64), or unset for none (got ", *l.logit_softcap,
                            ")");
      });
    }
    if (!l.sinks.empty() && !unsupported("sinks", SupportsSinks(backend))) {
      auto finite = [](float x) { return std::fabs(x) <= kMaxSinkMagnitude; };
      if (static_cast<int64_t>(l.sinks.size()) != c.num_q_heads) {
        violate_entry("sinks", [&] {
          return absl::StrCat("sinks must have num_q_heads=", c.num_q_heads,
                              " values, one per q head (got ", l.sinks.size(), ")");
        });
      } else if (!std::all_of(l.sinks.begin(), l.sinks.end(), finite)) {
        violate_entry("sinks", [&] {
          return absl::StrCat("sinks must be finite, within +-", kMaxSinkMagnitude, " (2^64) (",
                              BadEntries("sinks", l.sinks, finite), ")");
        });
      }
    }
  }
  if (bad_entries > kShownEntries) {
    violate("layers", absl::StrCat(bad_entries - kShownEntries,
                                   " more entries of layers have invalid options (the first ",
                                   kShownEntries, " bad entries are named)"));
  }
}

// An FP8 cache's scaling: kv_scaling only on FP8, STATIC with its scales (2 or 2 * num_layers,
// finite, normal and positive), scales only with STATIC. Never a silent scale of 1.
template <typename Violate>
void ValidateScaling(const CacheConfigRequest& c, Violate&& violate) {
  const bool fp8 = c.kv_dtype == DType::kFloat8E4M3;
  const int scaling = static_cast<int>(c.kv_scaling);
  if (scaling < 0 || scaling > 2) {
    violate("kv_scaling",
            absl::StrCat("kv_scaling must be PER_TOKEN or STATIC, or unset (got ", scaling, ")"));
    return;
  }
  if (!fp8) {
    // Neither field means anything here: each one given is refused as such, never as the other
    // way of scaling's (STATIC with scales on a bfloat16 cache is told to leave both unset).
    const std::string dtype = DTypeSize(c.kv_dtype) > 0 || c.kv_dtype == DType::kUnspecified
                                  ? std::string(DTypeName(c.kv_dtype))
                                  : absl::StrCat(static_cast<int>(c.kv_dtype));
    if (c.kv_scaling != KvScaling::kUnspecified) {
      violate("kv_scaling",
              absl::StrCat("kv_scaling applies to FLOAT8_E4M3 caches only (got kv_scaling ",
                           c.kv_scaling == KvScaling::kStatic ? "STATIC" : "PER_TOKEN",
                           " with kv_dtype ", dtype, "); leave it unset"));
    }
    if (!c.kv_scales.empty()) {
      violate("kv_scales",
              absl::StrCat("kv_scales apply to FLOAT8_E4M3 caches only (got ", c.kv_scales.size(),
                           " values with kv_dtype ", dtype, "); leave them unset"));
    }
    return;
  }
  if (c.kv_scaling == KvScaling::kStatic) {
    const size_t n = c.kv_scales.size();
    // Each scale float's smallest normal and up: an inverse (what values are stored times) that
    // overflows made 0 * inf = NaN of a zero.
    if (n != 2 && n != 2 * static_cast<size_t>(std::max(c.num_layers, 0))) {
      violate("kv_scales",
              absl::StrCat("kv_scaling STATIC needs kv_scales: K's and V's scale for every layer "
                           "(2 values) or per layer (2 x num_layers = ",
                           2 * int64_t{c.num_layers}, ") (got ", n, "); PER_TOKEN needs none"));
    } else if (const std::string bad =
                   BadEntries("kv_scales", c.kv_scales,
                              [](float x) { return std::isfinite(x) && x >= kFp8MinStaticScale; });
               !bad.empty()) {
      violate("kv_scales",
              absl::StrCat("kv_scales must be finite and at least ", kFp8MinStaticScale,
                           " (float's smallest normal value) (", bad, ")"));
    }
  } else if (!c.kv_scales.empty()) {
    violate("kv_scales",
            absl::StrCat("kv_scales are for kv_scaling STATIC (got ", c.kv_scales.size(),
                         " values with PER_TOKEN); set kv_scaling STATIC or leave them unset"));
  }
}

// Each layer's variant (empty when every layer is plain).
std::vector<LayerAttention> ResolveLayers(const CacheConfigRequest& c) {
  std::vector<LayerAttention> layers;
  bool any = false;
  for (int32_t i = 0; i < c.num_layers && !c.layers.empty(); ++i) {
    const LayerAttentionRequest& l = c.layers[c.layers.size() == 1 ? 0 : static_cast<size_t>(i)];
    LayerAttention a;
    a.sliding_window = l.sliding_window.value_or(0);
    a.logit_softcap = l.logit_softcap.value_or(0.f);
    a.sinks = l.sinks;
    any = any || !a.plain();
    layers.push_back(std::move(a));
  }
  if (!any) layers.clear();
  return layers;
}

}  // namespace

ValidationResult ValidateCacheConfig(const CacheConfigRequest& c, const ValidationContext& ctx) {
  ValidationResult r;
  r.free_bytes = ctx.free_bytes;
  r.free_bytes_source = ctx.free_bytes_source;
  if (c.num_pages.has_value()) r.capacity_field = "num_pages";
  if (c.max_bytes.has_value()) r.capacity_field = "max_bytes";
  auto violate = [&](std::string field, std::string description) {
    r.violations.push_back({std::move(field), std::move(description)});
  };

  if (c.num_layers < 1 || c.num_layers > kMaxNumLayers) {
    violate("num_layers",
            absl::StrCat("num_layers must be in 1..", kMaxNumLayers, " (got ", c.num_layers, ")"));
  }
  if (c.num_kv_heads < 1 || c.num_kv_heads > kMaxNumHeads) {
    violate("num_kv_heads", absl::StrCat("num_kv_heads must be in 1..", kMaxNumHeads, " (got ",
                                         c.num_kv_heads, ")"));
  }
  if (c.num_q_heads < 1 || c.num_q_heads > kMaxNumHeads) {
    violate("num_q_heads",
            absl::StrCat("num_q_heads must be in 1..", kMaxNumHeads, " (got ", c.num_q_heads, ")"));
  } else if (c.num_kv_heads >= 1 && c.num_kv_heads <= kMaxNumHeads) {
    if (c.num_q_heads % c.num_kv_heads != 0) {
      // Nearest multiples of num_kv_heads around num_q_heads.
      const int lower = c.num_q_heads / c.num_kv_heads * c.num_kv_heads;
      const int upper = lower + c.num_kv_heads;
      std::string nearest = lower > 0 ? absl::StrCat(lower, " or ", upper) : absl::StrCat(upper);
      violate(
          "num_q_heads",
          absl::StrCat("num_q_heads must be a positive multiple of num_kv_heads=", c.num_kv_heads,
                       " (got ", c.num_q_heads, "; nearest valid: ", nearest, ")"));
    } else if (c.num_q_heads / c.num_kv_heads > kMaxGqaRatio) {
      violate("num_q_heads",
              absl::StrCat("num_q_heads / num_kv_heads must be at most ", kMaxGqaRatio, " (got ",
                           c.num_q_heads, "/", c.num_kv_heads, " = ",
                           c.num_q_heads / c.num_kv_heads, "; with num_kv_heads=", c.num_kv_heads,
                           " num_q_heads can be at most ", c.num_kv_heads * kMaxGqaRatio, ")"));
    }
  }
  if (!IsSupportedHeadDim(ctx.backend, c.head_dim)) {
    violate("head_dim", absl::StrCat("head_dim must be one of ", HeadDimList(ctx.backend),
                                     " on the ", ctx.backend == BackendKind::kCuda ? "cuda" : "cpu",
                                     " backend (got ", c.head_dim, "; nearest valid: ",
                                     NearestHeadDims(ctx.backend, c.head_dim), ")"));
  }
  if (!IsSupportedPageSize(c.page_size)) {
    const int nearest = c.page_size < kMinPageSize ? kMinPageSize : kMaxPageSize;
    violate("page_size",
            absl::StrCat("page_size must be one of ", kMinPageSize, "..", kMaxPageSize,
                         " tokens (got ", c.page_size, "; nearest valid: ", nearest, ")"));
  }
  if (c.kv_dtype == DType::kUnspecified) {
    violate("kv_dtype", absl::StrCat("kv_dtype is required: one of ", KvDTypeList(ctx.backend),
                                     " (got DTYPE_UNSPECIFIED)"));
  } else if (!IsSupportedKvDType(ctx.backend, c.kv_dtype)) {
    const bool known = DTypeSize(c.kv_dtype) > 0;
    violate("kv_dtype",
            absl::StrCat("kv_dtype must be one of ", KvDTypeList(ctx.backend), " on the ",
                         ctx.backend == BackendKind::kCuda ? "cuda" : "cpu", " backend (got ",
                         known ? std::string(DTypeName(c.kv_dtype))
                               : absl::StrCat(static_cast<int>(c.kv_dtype)),
                         ")"));
  }
  if (c.device < 0 || c.device >= ctx.device_count) {
    violate("device",
            absl::StrCat("device must be in 0..", ctx.device_count - 1, " (got ", c.device, ")"));
  }
  if (c.num_pages.has_value() && c.max_bytes.has_value()) {
    violate("capacity", "set num_pages or max_bytes, not both");
  }
  // Whether a field already broke a rule: a check that needs it valid waits for it; the others
  // run, so that one answer names every field it can.
  auto bad = [&](absl::string_view field) {
    return std::any_of(r.violations.begin(), r.violations.end(),
                       [&](const FieldViolation& v) { return v.field == field; });
  };
  if (c.num_pages.has_value()) {
    // One layer's K rows are indexed in 32 bits: the most pages num_kv_heads and page_size allow.
    const bool rows_known = !bad("num_kv_heads") && !bad("page_size");
    const int64_t most =
        rows_known ? std::min<int64_t>(std::numeric_limits<int32_t>::max(),
                                       kMaxPoolRows / (int64_t{c.num_kv_heads} * c.page_size))
                   : std::numeric_limits<int32_t>::max();
    if (*c.num_pages < 1 || *c.num_pages > std::numeric_limits<int32_t>::max()) {
      violate("num_pages",
              absl::StrCat("num_pages must be in 1..", most, " (got ", *c.num_pages, ")"));
    } else if (*c.num_pages > most) {
      violate("num_pages",
              absl::StrCat("num_pages x num_kv_heads x page_size (one layer's K rows) must be "
                           "below 2^31, which the kernels index in 32 bits (got ",
                           *c.num_pages, " x ", c.num_kv_heads, " x ", c.page_size,
                           "); nearest valid: ", most));
    }
  }
  if (c.max_bytes.has_value() && *c.max_bytes < 1) {
    violate("max_bytes", absl::StrCat("max_bytes must be positive (got ", *c.max_bytes, ")"));
  }
  ValidateLayers(c, ctx.backend, violate);
  ValidateScaling(c, violate);
  // One query's answer at its largest (float32, with its lse) and its row of q must fit a
  // message, or every Forward that queries would be refused (256 bytes: a message's framing).
  if (ctx.max_message_bytes > 0 && !bad("num_q_heads") && !bad("head_dim")) {
    const int64_t one_query = int64_t{c.num_q_heads} * (int64_t{c.head_dim} * 4 + 4) + 256;
    if (one_query > ctx.max_message_bytes) {
      violate("num_q_heads",
              absl::StrCat("one query's answer, num_q_heads=", c.num_q_heads, " x head_dim=",
                           c.head_dim, " float32 values with its lse, takes ", one_query,
                           " bytes, over the server's largest message of ", ctx.max_message_bytes,
                           " bytes (--max_message_mb): no Forward could answer a query; spread "
                           "the heads over several caches or raise --max_message_mb"));
    }
  }
  // The device's own limits, for a config the tables accept: a head_dim its kernels cannot run
  // there is refused now, with the head dims it does run, not at the pool's allocation.
  if (!bad("head_dim") && !bad("kv_dtype") && !bad("device") && ctx.device_runs) {
    if (absl::Status s = ctx.device_runs(c.kv_dtype, c.head_dim); !s.ok()) {
      std::vector<int> runs;
      for (int d : HeadDims(ctx.backend)) {
        if (ctx.device_runs(c.kv_dtype, d).ok()) runs.push_back(d);
      }
      violate("head_dim",
              absl::StrCat("head_dim ", c.head_dim, " with kv_dtype ", DTypeName(c.kv_dtype),
                           " does not run on device ", c.device, " (", s.message(),
                           "); head dims it runs: ",
                           runs.empty() ? "none" : absl::StrJoin(runs, ", ")));
    }
  }
  if (!r.violations.empty()) return r;

  CacheGeometry g;
  g.num_layers = c.num_layers;
  g.num_q_heads = c.num_q_heads;
  g.num_kv_heads = c.num_kv_heads;
  g.head_dim = c.head_dim;
  g.page_size = c.page_size;
  g.kv_dtype = c.kv_dtype;
  g.device = c.device;
  g.layers = ResolveLayers(c);
  if (c.kv_dtype == DType::kFloat8E4M3) {
    g.kv_scaling = c.kv_scaling == KvScaling::kUnspecified ? KvScaling::kPerToken : c.kv_scaling;
    if (g.kv_scaling == KvScaling::kStatic) {
      for (int32_t l = 0; l < c.num_layers; ++l) {
        const size_t at = c.kv_scales.size() == 2 ? 0 : 2 * static_cast<size_t>(l);
        g.kv_scales.push_back(c.kv_scales[at]);
        g.kv_scales.push_back(c.kv_scales[at + 1]);
      }
    }
  }
  // Every factor is bounded above, so this product cannot overflow; the pool size can.
  const int64_t bytes_per_page = g.BytesPerPage();
  const int64_t max_pages = kMaxPoolRows / (int64_t{g.num_kv_heads} * g.page_size);
  if (c.num_pages.has_value()) {
    g.num_pages = *c.num_pages;  // at most max_pages (checked with the fields above)
  } else {
    const int64_t budget = c.max_bytes.has_value()
                               ? *c.max_bytes
                               : static_cast<int64_t>(ctx.free_bytes * kDefaultPoolFraction);
    g.num_pages = std::min<int64_t>(budget / bytes_per_page, max_pages);
    if (g.num_pages < 1) {
      violate(c.max_bytes.has_value() ? "max_bytes" : "capacity",
              absl::StrCat(c.max_bytes.has_value() ? "max_bytes" : "free memory", " (", budget,
                           " bytes) is less than one page (", bytes_per_page,
                           " bytes: 2 x num_layers x num_kv_heads x page_size x head_dim x ",
                           DTypeSize(g.kv_dtype),
                           g.ScaleBytesPerPage() > 0 ? ", and the FP8 rows' scales" : "",
                           "); nearest valid max_bytes: ", bytes_per_page));
      return r;
    }
  }
  std::optional<int64_t> total = CheckedMul(bytes_per_page, g.num_pages);
  if (!total.has_value()) {
    violate("num_pages", absl::StrCat("num_pages=", g.num_pages, " x ", bytes_per_page,
                                      " bytes per page overflows 64 bits"));
    return r;
  }
  r.geometry = g;
  r.bytes = *total;
  r.fits = r.bytes <= ctx.free_bytes;
  return r;
}

absl::Status ValidationStatus(const ValidationResult& result) {
  if (!result.violations.empty()) {
    std::vector<std::string> parts;
    std::string payload;
    for (const FieldViolation& v : result.violations) {
      parts.push_back(absl::StrCat(v.field, ": ", v.description));
      absl::StrAppend(&payload, v.field, "\t", v.description, "\n");
    }
    absl::Status s = absl::InvalidArgumentError(
        absl::StrCat("invalid cache config (", result.violations.size(), " violation",
                     result.violations.size() == 1 ? "" : "s", "): ", absl::StrJoin(parts, "; ")));
    s.SetPayload(kFieldViolationsPayload, absl::Cord(payload));
    return s;
  }
  if (!result.fits) {
    const CacheGeometry& g = result.geometry;
    return WithErrorInfo(absl::ResourceExhaustedError(absl::StrCat(
                             "cache pool needs ", result.bytes, " bytes (", g.num_pages,
                             " pages x ", g.BytesPerPage(), " bytes) but only ", result.free_bytes,
                             " bytes are ", result.free_bytes_source, "; at most ",
                             result.free_bytes / g.BytesPerPage(), " pages would fit")),
                         {"POOL_TOO_LARGE",
                          {{"bytes_needed", result.bytes},
                           {"num_pages", g.num_pages},
                           {"bytes_per_page", g.BytesPerPage()},
                           {"free_bytes", result.free_bytes},
                           {"device", g.device},
                           {"max_pages", result.free_bytes / g.BytesPerPage()}}});
  }
  return absl::OkStatus();
}

std::vector<FieldViolation> FieldViolationsFromStatus(const absl::Status& status) {
  std::vector<FieldViolation> out;
  auto payload = status.GetPayload(kFieldViolationsPayload);
  if (!payload.has_value()) return out;
  for (absl::string_view line : absl::StrSplit(std::string(*payload), '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('\t', 1));
    out.push_back({kv.first, kv.second});
  }
  return out;
}

absl::Status InvalidFieldError(absl::string_view field, absl::string_view description) {
  absl::Status s = absl::InvalidArgumentError(description);
  s.SetPayload(kFieldViolationsPayload, absl::Cord(absl::StrCat(field, "\t", description, "\n")));
  return s;
}

}  // namespace pagedattn
