// ShardedClient: each shard's slice of a cache's heads, its calls made on every shard at once,
// and the shards' answers joined into one (a Forward's failures say which shard wrote nothing).
#include "client/sharded.h"

#include <arpa/inet.h>
#include <netdb.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pagedattn {
namespace {

size_t ElementSize(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return 4;
    case v1::FLOAT16:
    case v1::BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

// Rows of [rows, heads, row] elements: shard `part` of `parts` takes heads [part*h/parts, ...).
// Gather copies that slice of every row into dst (contiguous); Scatter puts it back.
struct HeadSlice {
  int64_t rows = 0, heads = 0;
  size_t row_bytes = 0;  // one head's bytes (head_dim * element size, or 4 for an lse)
  int parts = 1;

  size_t part_bytes() const { return static_cast<size_t>(heads / parts) * row_bytes; }
  size_t offset(int64_t r, int part) const {
    return (static_cast<size_t>(r) * heads + static_cast<size_t>(part) * (heads / parts)) *
           row_bytes;
  }
  void Gather(const void* src, int part, char* dst) const {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(dst + r * part_bytes(), static_cast<const char*>(src) + offset(r, part),
                  part_bytes());
    }
  }
  void Scatter(const char* src, int part, void* dst) const {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<char*>(dst) + offset(r, part), src + r * part_bytes(), part_bytes());
    }
  }
};

// The limit B of gRPC's "Received message larger than max (A vs. B)", or -1.
int64_t ReceiveLimitOf(absl::string_view message) {
  const size_t vs = message.find(" vs. ");
  if (!absl::StrContains(message, "Received message larger than max") ||
      vs == absl::string_view::npos) {
    return -1;
  }
  absl::string_view rest = message.substr(vs + 5);
  rest = rest.substr(0, rest.find(')'));
  int64_t limit = -1;
  return absl::SimpleAtoi(rest, &limit) ? limit : -1;
}

// True when a shard's failed Forward certainly wrote nothing: refused for what the request is
// (a Forward is all or nothing), refused by the server for room with its details (ErrorInfo),
// or never sent (over this client's own message limit), or refused by the server's message
// limit (a receive limit not this client's: its own refuses an answer, sent after the commit).
// Other failures (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL, an answer over this
// client's limit) may come after the shard committed.
bool NothingWritten(const absl::Status& s, int64_t own_receive_limit) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return true;
    case absl::StatusCode::kResourceExhausted:
      return s.GetPayload(kStatusDetailsPayload).has_value() ||
             absl::StrContains(s.message(), "Sent message larger than max") ||
             (ReceiveLimitOf(s.message()) >= 0 &&
              ReceiveLimitOf(s.message()) != own_receive_limit);
    default:
      return false;
  }
}

// Shard `part`'s slice of a whole-cache tensor, gathered into `storage`.
TensorArg SliceTensor(const TensorArg& t, int part, int parts, std::string* storage) {
  if (t.dtype == v1::DTYPE_UNSPECIFIED || t.shape.size() != 3) return t;
  HeadSlice s{t.shape[0], t.shape[1], static_cast<size_t>(t.shape[2]) * ElementSize(t.dtype),
              parts};
  storage->resize(static_cast<size_t>(s.rows) * s.part_bytes());
  if (t.data != nullptr) s.Gather(t.data, part, storage->data());
  TensorArg out = t;
  out.shape[1] = t.shape[1] / parts;
  out.data = storage->data();
  out.bytes = storage->size();
  return out;
}

// A shard's cache name: the cache's, cut to leave room under the server's 128 characters,
// then "[shard i/N]", as the Python client names them, so that ListCaches on any server shows
// which part of which cache it holds whichever client made it.
std::string ShardCacheName(const std::string& name, int shard, int num_shards) {
  constexpr size_t kMaxNameBytes = 128;  // the server's (kMaxCacheNameBytes)
  const std::string suffix = absl::StrCat("[shard ", shard, "/", num_shards, "]");
  if (name.empty()) return suffix;
  return absl::StrCat(name.substr(0, kMaxNameBytes - 1 - suffix.size()), " ", suffix);
}

// `status` with notes after its message, its code and payloads (the server's details) kept.
absl::Status WithNotes(const absl::Status& status, const std::vector<std::string>& notes) {
  if (notes.empty()) return status;
  absl::Status noted(status.code(),
                     absl::StrCat(status.message(), "; ", absl::StrJoin(notes, "; ")));
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { noted.SetPayload(url, payload); });
  return noted;
}

// fn(i) for every shard at once (shard 0 on the calling thread), so that a shard that hangs
// costs one timeout, not one for each shard behind it. Each thread carries the caller's
// RequestId, if one is in force (a thread does not inherit it), so that every shard's calls
// carry the id.
template <typename Fn>
void OnEveryShard(int n, Fn&& fn) {
  const std::string* current = RequestId::Current();
  const std::optional<std::string> request_id =
      current == nullptr ? std::nullopt : std::optional<std::string>(*current);
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) {
    threads.emplace_back([fn, &request_id, i] {
      std::optional<RequestId> scope;
      if (request_id.has_value()) scope.emplace(*request_id);
      fn(i);
    });
  }
  if (n > 0) fn(0);
  for (std::thread& t : threads) t.join();
}

// A shard's server judges its part of max_bytes (1/N of the whole cache's), so the values
// its violation names are a shard's; said beside it, or the suggestion fails again.
std::string ShardPartNote(absl::string_view field, int num_shards) {
  if (field != "max_bytes" || num_shards == 1) return "";
  return absl::StrCat(" (the values are a shard's: each takes 1/", num_shards,
                      " of the cache's max_bytes, so the cache's are ", num_shards, " times them)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Connect(
    std::vector<std::string> targets, const ClientOptions& options) {
  if (targets.empty()) return absl::InvalidArgumentError("a sharded client needs >= 1 target");
  // The same server twice would hold two shards' heads in two caches: a mistake in the list.
  for (size_t i = 0; i < targets.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (targets[i] == targets[j]) {
        return absl::InvalidArgumentError(absl::StrCat("shard targets ", j, " and ", i,
                                                       " are the same (", targets[i],
                                                       "): each shard needs its own server"));
      }
    }
  }
  std::vector<std::unique_ptr<Client>> shards;
  for (const std::string& t : targets) {
    ClientOptions o = options;
    o.target = t;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    if (!c.ok()) {
      return absl::Status(c.status().code(), absl::StrCat("shard ", shards.size(), " (", t,
                                                          "): ", c.status().message()));
    }
    shards.push_back(*std::move(c));
  }
  return std::unique_ptr<ShardedClient>(new ShardedClient(std::move(targets), std::move(shards)));
}

absl::Status ShardedClient::Named(int shard, const absl::Status& status) const {
  if (status.ok()) return status;
  absl::Status named(status.code(),
                     absl::StrCat("shard ", shard, " (", targets_[shard], "): ", status.message()));
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { named.SetPayload(url, payload); });
  return named;
}

absl::StatusOr<v1::CacheConfig> ShardedClient::ShardConfig(const v1::CacheConfig& config,
                                                           int shard) const {
  const int n = num_shards();
  if (shard < 0 || shard >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard must be in 0..", n - 1, " (got ", shard, ")"));
  }
  const int kv = config.num_kv_heads(), q = config.num_q_heads();
  if (kv <= 0 || kv % n != 0) {
    std::vector<int> valid;
    for (int d = 1; d <= std::max(kv, 1); ++d) {
      if (kv > 0 && kv % d == 0) valid.push_back(d);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "num_kv_heads: ", kv, " kv heads cannot be split over ", n,
        " shards (each shard holds num_kv_heads / shards of them); shard counts that divide it: ",
        valid.empty() ? "none" : absl::StrJoin(valid, ", ")));
  }
  if (q <= 0 || q % kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_q_heads: ", q, " must be a positive multiple of num_kv_heads (", kv, ")"));
  }
  // Sinks are per q head, split below: their count is the whole cache's (a shard's server
  // would name its own part's).
  for (int i = 0; i < config.layers_size(); ++i) {
    const int sinks = config.layers(i).sinks_size();
    if (sinks != 0 && sinks != q) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i,
                                                     "].sinks: sinks must have num_q_heads=", q,
                                                     " values, one per q head (got ", sinks, ")"));
    }
  }
  v1::CacheConfig part = config;
  part.set_num_kv_heads(kv / n);
  part.set_num_q_heads(q / n);
  // A byte budget is the whole cache's: each shard holds 1/N of every page.
  if (config.capacity_case() == v1::CacheConfig::kMaxBytes) {
    part.set_max_bytes(config.max_bytes() / n);
  }
  for (v1::LayerAttention& layer : *part.mutable_layers()) {
    if (layer.sinks_size() == 0) continue;
    const std::vector<float> all(layer.sinks().begin(), layer.sinks().end());
    layer.clear_sinks();
    for (int h = shard * (q / n); h < (shard + 1) * (q / n); ++h) layer.add_sinks(all[h]);
  }
  return part;
}

absl::StatusOr<ShardedCache> ShardedClient::CreateCache(const v1::CacheConfig& config,
                                                        const std::string& name) {
  return CreateCache(config, name, {});
}

absl::StatusOr<ShardedCache> ShardedClient::CreateCache(
    const v1::CacheConfig& config, const std::string& name,
    const std::vector<int64_t>& num_pages_per_shard) {
  if (!num_pages_per_shard.empty() &&
      num_pages_per_shard.size() != static_cast<size_t>(num_shards())) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages_per_shard must give one count a shard (", num_shards(), "; got ",
                     num_pages_per_shard.size(), ")"));
  }
  std::vector<v1::CacheConfig> parts;
  for (int i = 0; i < num_shards(); ++i) {
    absl::StatusOr<v1::CacheConfig> part = ShardConfig(config, i);
    if (!part.ok()) return part.status();
    parts.push_back(*std::move(part));
    if (static_cast<size_t>(i) < num_pages_per_shard.size()) {
      parts.back().set_num_pages(num_pages_per_shard[i]);
    }
  }
  // Every shard's violations, before anything is allocated.
  std::vector<std::string> problems;
  std::vector<absl::StatusOr<v1::ValidateCacheConfigResponse>> validated(
      static_cast<size_t>(num_shards()), absl::CancelledError("not validated"));
  OnEveryShard(num_shards(),
               [&](int i) { validated[i] = shards_[i]->ValidateCacheConfig(parts[i]); });
  for (int i = 0; i < num_shards(); ++i) {
    const absl::StatusOr<v1::ValidateCacheConfigResponse>& v = validated[i];
    if (!v.ok()) return Named(i, v.status());
    for (const v1::ConfigViolation& violation : v->violations()) {
      problems.push_back(absl::StrCat("shard ", i, " (", targets_[i], "): ", violation.field(),
                                      ": ", violation.description(),
                                      ShardPartNote(violation.field(), num_shards())));
    }
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid sharded cache config (", num_shards(), " shards of ", parts[0].num_q_heads(),
        " q / ", parts[0].num_kv_heads(), " kv heads): ", absl::StrJoin(problems, "; ")));
  }
  ShardedCache cache;
  cache.config = config;
  cache.targets = targets_;
  for (int i = 0; i < num_shards(); ++i) {
    absl::StatusOr<v1::CacheInfo> info =
        shards_[i]->CreateCache(parts[i], ShardCacheName(name, i, num_shards()));
    if (!info.ok()) {
      // Those created are deleted; one that cannot be is named, so that the caller, who never
      // gets its id otherwise, can delete it later.
      std::vector<std::string> left;
      for (int j = 0; j < i; ++j) {
        absl::StatusOr<int64_t> freed = shards_[j]->DeleteCache(cache.cache_ids[j]);
        if (!freed.ok() && !absl::IsNotFound(freed.status())) {
          left.push_back(absl::StrCat("the cache ", cache.cache_ids[j], " created on shard ", j,
                                      " (", targets_[j], ") could not be deleted (",
                                      freed.status().ToString(), "): delete it there"));
        }
      }
      return WithNotes(Named(i, info.status()), left);
    }
    cache.cache_ids.push_back(info->cache_id());
  }
  return cache;
}

absl::Status ShardedClient::CheckTargets(const ShardedCache& cache) const {
  if (cache.cache_ids.size() != targets_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the sharded cache has ", cache.cache_ids.size(),
                                                   " shards, the client ", targets_.size()));
  }
  if (cache.targets.empty() || cache.targets == targets_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the sharded cache was made through the targets [", absl::StrJoin(cache.targets, ", "),
      "] and this client has [", absl::StrJoin(targets_, ", "),
      "]: shard i's cache id goes to target i; use a client of the cache's targets, in order"));
}

absl::Status ShardedClient::DeleteCache(const ShardedCache& cache) {
  if (absl::Status s = CheckTargets(cache); !s.ok()) return s;
  const int n = num_shards();
  std::vector<absl::Status> results(static_cast<size_t>(n));
  OnEveryShard(n,
               [&](int i) { results[i] = shards_[i]->DeleteCache(cache.cache_ids[i]).status(); });
  // NOT_FOUND: deleted already (an earlier try, or the shard's server restarted).
  return Failures(results, /*not_found_is_done=*/true);
}

absl::Status ShardedClient::Failures(const std::vector<absl::Status>& results,
                                     bool not_found_is_done) const {
  std::vector<std::pair<int, absl::Status>> failed;
  for (int i = 0; i < static_cast<int>(results.size()); ++i) {
    if (results[i].ok() || (not_found_is_done && absl::IsNotFound(results[i]))) continue;
    failed.emplace_back(i, results[i]);
  }
  if (failed.empty()) return absl::OkStatus();
  std::vector<std::string> others;
  absl::Status first = NamedAlike(failed, &others);
  return WithNotes(first, others);
}

absl::Status ShardedClient::NamedAlike(const std::vector<std::pair<int, absl::Status>>& failed,
                                       std::vector<std::string>* others) const {
  // Each distinct failure (code and message), in the order of its first shard, with its shards.
  std::vector<std::pair<const absl::Status*, std::vector<int>>> groups;
  for (const auto& [i, s] : failed) {
    auto same = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.first->code() == s.code() && g.first->message() == s.message();
    });
    if (same == groups.end()) {
      groups.push_back({&s, {i}});
    } else {
      same->second.push_back(i);
    }
  }
  auto named = [&](const absl::Status& status, const std::vector<int>& shards) {
    if (shards.size() == 1) return Named(shards[0], status);
    std::vector<std::string> where;
    for (int i : shards) where.push_back(absl::StrCat(i, " (", targets_[i], ")"));
    absl::Status out(status.code(), absl::StrCat("shards ", absl::StrJoin(where, ", "), " of ",
                                                 num_shards(), ": ", status.message()));
    status.ForEachPayload(
        [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
    return out;
  };
  for (size_t g = 1; g < groups.size(); ++g) {
    others->push_back(named(*groups[g].first, groups[g].second).ToString());
  }
  return named(*groups[0].first, groups[0].second);
}

absl::Status ShardedClient::ReleaseSequences(const ShardedCache& cache,
                                             const std::vector<uint64_t>& seq_ids) {
  if (absl::Status s = CheckTargets(cache); !s.ok()) return s;
  const int n = num_shards();
  std::vector<absl::Status> results(static_cast<size_t>(n));
  OnEveryShard(n, [&](int i) {
    results[i] = shards_[i]->ReleaseSequences(cache.cache_ids[i], seq_ids).status();
  });
  return Failures(results, /*not_found_is_done=*/false);
}

absl::StatusOr<std::vector<v1::CacheInfo>> ShardedClient::GetCache(const ShardedCache& cache) {
  if (absl::Status s = CheckTargets(cache); !s.ok()) return s;
  const int n = num_shards();
  std::vector<absl::StatusOr<v1::CacheInfo>> infos(static_cast<size_t>(n));
  OnEveryShard(n, [&](int i) { infos[i] = shards_[i]->GetCache(cache.cache_ids[i]); });
  return Answers(std::move(infos));
}

absl::StatusOr<std::vector<v1::TruncateSequencesResponse>> ShardedClient::TruncateSequences(
    const ShardedCache& cache, int32_t layer,
    const std::vector<std::pair<uint64_t, int64_t>>& lengths) {
  if (absl::Status s = CheckTargets(cache); !s.ok()) return s;
  const int n = num_shards();
  std::vector<absl::StatusOr<v1::TruncateSequencesResponse>> answers(static_cast<size_t>(n));
  OnEveryShard(n, [&](int i) {
    answers[i] = shards_[i]->TruncateSequences(cache.cache_ids[i], layer, lengths);
  });
  return Answers(std::move(answers));
}

template <typename T>
absl::StatusOr<std::vector<T>> ShardedClient::Answers(
    std::vector<absl::StatusOr<T>> answers) const {
  std::vector<absl::Status> results;
  for (const auto& a : answers) results.push_back(a.status());
  if (absl::Status s = Failures(results, /*not_found_is_done=*/false); !s.ok()) return s;
  std::vector<T> out;
  for (auto& a : answers) out.push_back(*std::move(a));
  return out;
}

absl::StatusOr<ForwardReply> ShardedClient::Forward(const ShardedCache& cache,
                                                    const ForwardCall& call,
                                                    const ForwardOutput& output) {
  const int n = num_shards();
  if (absl::Status s = CheckTargets(cache); !s.ok()) return s;
  // The whole cache's shapes and bytes, checked before the split: a shard's server would name
  // its own part's, and a slice of a short buffer would read past it.
  int64_t total_queries = 0, new_tokens = 0;
  for (const wire::SpanRef& s : call.spans) {
    total_queries += s.num_queries;
    new_tokens += s.num_new_tokens;
  }
  const int64_t d = cache.config.head_dim();
  auto check = [&](const char* name, const TensorArg& t, std::vector<int64_t> want,
                   const char* names) -> absl::Status {
    if (t.dtype == v1::DTYPE_UNSPECIFIED) return absl::OkStatus();  // absent: the server says
    if (!t.region_id.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       " names a registered region: a sharded Forward takes host tensors (a region "
                       "belongs to one server's cache; register one a shard and call shard(i))"));
    }
    if (ElementSize(t.dtype) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ".dtype must be FLOAT32, FLOAT16 or BFLOAT16 (got ", v1::DType_Name(t.dtype), ")"));
    }
    if (t.shape != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape must be [", absl::StrJoin(want, ", "), "] = [", names,
                       "] (got [", absl::StrJoin(t.shape, ", "), "])"));
    }
    const size_t bytes = static_cast<size_t>(want[0] * want[1] * want[2]) * ElementSize(t.dtype);
    if (t.region_id.empty() && (t.bytes != bytes || (bytes > 0 && t.data == nullptr))) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".data must hold ", bytes, " bytes (got ", t.bytes, ")"));
    }
    return absl::OkStatus();
  };
  if (total_queries < 0 || new_tokens < 0) {
    return absl::InvalidArgumentError("spans: num_queries and num_new_tokens must be >= 0");
  }
  for (absl::Status s : {check("q", call.q, {total_queries, cache.config.num_q_heads(), d},
                               "total_queries, num_q_heads, head_dim"),
                         check("k", call.k, {new_tokens, cache.config.num_kv_heads(), d},
                               "total_new_tokens, num_kv_heads, head_dim"),
                         check("v", call.v, {new_tokens, cache.config.num_kv_heads(), d},
                               "total_new_tokens, num_kv_heads, head_dim")}) {
    if (!s.ok()) return s;
  }
  if (output.lse != nullptr && !call.options.return_lse) {
    return absl::InvalidArgumentError(
        "an lse buffer was given but options.return_lse is false: set it, or pass no lse");
  }
  const int64_t queries = call.q.dtype != v1::DTYPE_UNSPECIFIED ? call.q.shape[0] : 0;
  const HeadSlice out_slice{
      queries, cache.config.num_q_heads(),
      static_cast<size_t>(cache.config.head_dim()) * ElementSize(call.q.dtype), n};
  const HeadSlice lse_slice{queries, cache.config.num_q_heads(), sizeof(float), n};
  const size_t out_bytes = static_cast<size_t>(queries) * out_slice.heads * out_slice.row_bytes;
  const size_t lse_bytes = static_cast<size_t>(queries) * lse_slice.heads * sizeof(float);
  if (output.out_bytes != out_bytes || (output.lse != nullptr && output.lse_bytes != lse_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the output buffers must be the answer's size: out ", out_bytes,
                     " bytes (got ", output.out_bytes, ")",
                     output.lse != nullptr
                         ? absl::StrCat(", lse ", lse_bytes, " bytes (got ", output.lse_bytes, ")")
                         : std::string(),
                     "; the sharded client gathers the shards' answers into them"));
  }

  struct Part {
    std::string q, k, v, out, lse;
    ForwardCall call;
    absl::StatusOr<ForwardReply> reply;
  };
  std::vector<Part> parts(static_cast<size_t>(n));
  auto run = [&](int i) {
    Part& p = parts[i];
    p.call = call;
    p.call.cache_id = cache.cache_ids[i];
    p.call.q = SliceTensor(call.q, i, n, &p.q);
    p.call.k = SliceTensor(call.k, i, n, &p.k);
    p.call.v = SliceTensor(call.v, i, n, &p.v);
    p.out.resize(static_cast<size_t>(queries) * out_slice.part_bytes());
    ForwardOutput o{p.out.data(), p.out.size()};
    if (output.lse != nullptr) {
      p.lse.resize(static_cast<size_t>(queries) * lse_slice.part_bytes());
      o.lse = reinterpret_cast<float*>(p.lse.data());
      o.lse_bytes = p.lse.size();
    }
    p.reply = shards_[i]->ForwardTensors(p.call, o);
  };
  OnEveryShard(n, run);

  std::vector<int> failed;
  for (int i = 0; i < n; ++i) {
    if (!parts[i].reply.ok()) failed.push_back(i);
  }
  if (!failed.empty()) {
    // Put the shards that committed back to the lengths they had; not when every shard failed
    // before writing anything (a rewinding span would lose the rows before it for nothing).
    std::vector<std::pair<uint64_t, int64_t>> lengths;
    if (static_cast<int>(failed.size()) < n ||
        !std::all_of(failed.begin(), failed.end(),
                     [&](int i) {
                       return NothingWritten(
                           parts[i].reply.status(),
                           std::min<int64_t>(shards_[i]->options().max_message_bytes, INT32_MAX));
                     })) {
      for (const wire::SpanRef& s : call.spans) {
        if (s.num_new_tokens > 0) lengths.emplace_back(s.seq_id, s.start);
      }
    }
    std::vector<std::string> notes;
    // Every shard, the failed ones too: a shard whose call failed in transport may have
    // committed, and all shards then end each sequence at the same length.
    std::vector<absl::StatusOr<v1::TruncateSequencesResponse>> rewound(
        static_cast<size_t>(n), absl::CancelledError("not rewound"));
    if (!lengths.empty()) {
      OnEveryShard(n, [&](int i) {
        rewound[i] = shards_[i]->TruncateSequences(cache.cache_ids[i], call.layer, lengths);
      });
      std::vector<std::string> done;
      for (int i = 0; i < n; ++i) {
        if (rewound[i].ok()) done.push_back(absl::StrCat(i));
      }
      if (!done.empty()) {
        notes.push_back(absl::StrCat("shard", done.size() > 1 ? "s " : " ",
                                     absl::StrJoin(done, ", "),
                                     " rewound to the call's span starts"));
      }
    }
    for (int i = 0; i < n; ++i) {
      if (lengths.empty()) continue;
      const absl::StatusOr<v1::TruncateSequencesResponse>& t = rewound[i];
      if (absl::IsNotFound(t.status())) {
        notes.push_back(absl::StrCat(
            "could not rewind shard ", i, " (", targets_[i],
            "): its cache is gone (its server "
            "restarted?): this sharded cache cannot serve any more; delete it and create it "
            "again: ",
            t.status().message()));
      } else if (!t.ok()) {
        notes.push_back(
            absl::StrCat("could not rewind shard ", i, " (", targets_[i],
                         "), which may keep the call's tokens: ", t.status().message()));
      }
    }
    std::vector<std::pair<int, absl::Status>> statuses;
    for (int i : failed) statuses.emplace_back(i, parts[i].reply.status());
    std::vector<std::string> others;
    absl::Status first = NamedAlike(statuses, &others);
    notes.insert(notes.end(), others.begin(), others.end());
    return WithNotes(first, notes);
  }

  ForwardReply joined = *parts[0].reply;
  if (!joined.out_shape.empty()) joined.out_shape[1] = cache.config.num_q_heads();
  for (int i = 0; i < n; ++i) {
    if (output.out != nullptr) out_slice.Scatter(parts[i].out.data(), i, output.out);
    if (output.lse != nullptr) lse_slice.Scatter(parts[i].lse.data(), i, output.lse);
    joined.server_micros = std::max(joined.server_micros, parts[i].reply->server_micros);
    joined.kernel_micros = std::max(joined.kernel_micros, parts[i].reply->kernel_micros);
  }
  return joined;
}

std::vector<std::string> StatefulSetTargets(const std::string& set, const std::string& service,
                                            int replicas, int port) {
  std::vector<std::string> targets;
  for (int i = 0; i < replicas; ++i) {
    targets.push_back(absl::StrCat(set, "-", i, ".", service, ":", port));
  }
  return targets;
}

absl::StatusOr<std::vector<std::string>> ResolveShardTargets(const std::string& name, int port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (int err = getaddrinfo(name.c_str(), nullptr, &hints, &found); err != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve shard name ", name, ": ", gai_strerror(err)));
  }
  // By family (IPv4 first), then the address's bytes (its number): "10.0.0.9" before
  // "10.0.0.10", as the Python client orders them.
  std::vector<std::pair<int, std::string>> addresses;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto& in = reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr;
      addresses.push_back({4, std::string(reinterpret_cast<const char*>(&in), sizeof in)});
    } else if (a->ai_family == AF_INET6) {
      const auto& in6 = reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr;
      addresses.push_back({6, std::string(reinterpret_cast<const char*>(&in6), sizeof in6)});
    }
  }
  freeaddrinfo(found);
  std::sort(addresses.begin(), addresses.end());
  addresses.erase(std::unique(addresses.begin(), addresses.end()), addresses.end());
  std::vector<std::string> targets;
  for (const auto& [family, bytes] : addresses) {
    char ip[INET6_ADDRSTRLEN] = {};
    inet_ntop(family == 4 ? AF_INET : AF_INET6, bytes.data(), ip, sizeof ip);
    targets.push_back(family == 4 ? absl::StrCat(ip, ":", port)
                                  : absl::StrCat("[", ip, "]:", port));
  }
  if (targets.empty()) return absl::UnavailableError(absl::StrCat(name, " has no addresses"));
  return targets;
}

}  // namespace pagedattn
