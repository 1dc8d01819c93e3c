// ShardedClient: one cache split by KV head over N servers. Attention is independent per KV head
// (and its group of query heads), so shard i holds kv heads [i*kv/N, (i+1)*kv/N) and q heads
// [i*q/N, (i+1)*q/N) of every layer, computes their attention, and the client joins the outputs:
// no traffic between servers, the same pages and sequences on each. A tensor-parallel rank of
// the dense layers can give each rank its own attention server the same way.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace pagedattn {

// A sharded cache: the whole cache's config and one cache id per shard, in shard order, and the
// targets it was made through (CreateCache sets them): a client of other targets, or of the same
// in another order, refuses it (FAILED_PRECONDITION) rather than send shard i's id to another
// server. Store the targets with the ids: empty targets are not checked.
struct ShardedCache {
  v1::CacheConfig config;
  std::vector<std::string> cache_ids;
  std::vector<std::string> targets;
};

class ShardedClient {
 public:
  // One Client per target (options.target is ignored); shard i is targets[i]. Its calls may come
  // from several threads at once, as a Client's may (each call goes to every shard at once, on
  // threads of its own). It has what a sharded cache needs of the API; the rest (ListCaches,
  // RegisterMemory, Step streams, ...) goes to each shard: shard(i) with cache.cache_ids[i].
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Connect(std::vector<std::string> targets,
                                                                const ClientOptions& options);

  int num_shards() const { return static_cast<int>(shards_.size()); }
  const std::string& target(int shard) const { return targets_[shard]; }
  Client& shard(int i) { return *shards_[i]; }

  // Shard `shard`'s part of `config`: num_kv_heads / N, num_q_heads / N, max_bytes / N, and
  // each layer's sinks of its q heads. INVALID_ARGUMENT naming num_kv_heads (and the shard
  // counts that would divide it), or a layer's sinks of another count than num_q_heads.
  absl::StatusOr<v1::CacheConfig> ShardConfig(const v1::CacheConfig& config, int shard) const;
  // Validates the whole config once, then each shard's part on its server (errors name the
  // shard and the field, every violation of every shard), then creates a cache on each. If a
  // shard fails, the caches already created are deleted and the status names the shard (and
  // any cache that could not be deleted, with its id and shard).
  // Shard i's cache is named "<name> [shard i/N]" (the name cut to fit the server's 128
  // characters), as the Python client names them.
  absl::StatusOr<ShardedCache> CreateCache(const v1::CacheConfig& config, const std::string& name);
  // As CreateCache, with each shard's num_pages given (tests and uneven memory): one a shard,
  // or none.
  absl::StatusOr<ShardedCache> CreateCache(const v1::CacheConfig& config, const std::string& name,
                                           const std::vector<int64_t>& num_pages_per_shard);
  // Every shard's, even when one fails (the first failure is returned, naming its shard); a
  // shard whose cache is gone already (NOT_FOUND) counts as deleted, so a retry completes. So a
  // cache put together from stored ids must keep its targets: sent to other servers, its ids are
  // NOT_FOUND there, and nothing is deleted.
  absl::Status DeleteCache(const ShardedCache& cache);
  // Releases seq_ids on every shard; when a shard fails the others still release them
  // (releasing again completes it) and the status names it.
  absl::Status ReleaseSequences(const ShardedCache& cache, const std::vector<uint64_t>& seq_ids);
  // Each shard's CacheInfo (its stats: used pages and live sequences are the same on every shard
  // unless a rollback failed), by shard; the first failure names its shard.
  absl::StatusOr<std::vector<v1::CacheInfo>> GetCache(const ShardedCache& cache);
  // Rewinds sequences of `layer` to `lengths` ({seq_id, length}) on every shard (e.g. rejected
  // speculative tokens); each shard's answer, by shard. When a shard fails the others are still
  // truncated (truncating again to the same lengths completes it) and the status names it.
  absl::StatusOr<std::vector<v1::TruncateSequencesResponse>> TruncateSequences(
      const ShardedCache& cache, int32_t layer,
      const std::vector<std::pair<uint64_t, int64_t>>& lengths);

  // One Forward on every shard. call.q [T, num_q_heads, head_dim] and call.k / call.v
  // [new tokens, num_kv_heads, head_dim] are the whole cache's host tensors (a registered
  // region's are refused: each shard's would need its own), shapes and bytes checked as such
  // before anything is sent (cache ids are taken from
  // `cache`); the N Forwards run concurrently and `output` receives the joined answer (lse
  // too). Calls that write the same sequences in the same layer must not overlap (on one server
  // the later wins; here a rollback could rewind the other's tokens). A shard that hangs costs
  // the timeout twice: once for the Forward, once for the rollback. server_micros and kernel_micros
  // are the slowest shard's. Each shard's Forward is all or nothing; when some fail, every shard is
  // rewound to each appending span's start (TruncateSequences; a call that failed in transport may
  // have committed; not when every shard refused it before writing), so every shard's sequences
  // keep the lengths they had, and the status (the failed shard's code) names the shard(s) and any
  // shard that could not be rewound. Rows a rewinding span (start < the sequence's length)
  // overwrote are not put back there: the sequence then ends at the span's start, and a retry at
  // the same start writes them again.
  absl::StatusOr<ForwardReply> Forward(const ShardedCache& cache, const ForwardCall& call,
                                       const ForwardOutput& output);

 private:
  ShardedClient(std::vector<std::string> targets, std::vector<std::unique_ptr<Client>> shards)
      : targets_(std::move(targets)), shards_(std::move(shards)) {}

  // OK when `cache` was made through this client's targets (or names none).
  absl::Status CheckTargets(const ShardedCache& cache) const;
  // `status` with its message prefixed by the shard (index and target); payloads kept.
  absl::Status Named(int shard, const absl::Status& status) const;
  // The shards' results, by shard: OK, or the first failure naming its shard with every other
  // failure after it (NOT_FOUND counted as done where not_found_is_done), each said once.
  absl::Status Failures(const std::vector<absl::Status>& results, bool not_found_is_done) const;
  // failed ({shard, status}, by shard, not empty): the first's status (code and payloads) naming
  // every shard that failed alike (the same code and message: "shards 0 (a), 2 (c) of 3: ..."),
  // and in `others` each other failure, likewise said once with its shards.
  absl::Status NamedAlike(const std::vector<std::pair<int, absl::Status>>& failed,
                          std::vector<std::string>* others) const;
  // The shards' answers, by shard, or Failures' status where any failed.
  template <typename T>
  absl::StatusOr<std::vector<T>> Answers(std::vector<absl::StatusOr<T>> answers) const;

  std::vector<std::string> targets_;
  std::vector<std::unique_ptr<Client>> shards_;
};

// The shard targets of a StatefulSet behind a headless Service: "<set>-<i>.<service>:<port>" for
// i in [0, replicas) (stable names: pod i is shard i across restarts).
std::vector<std::string> StatefulSetTargets(const std::string& set, const std::string& service,
                                            int replicas, int port);

// The addresses `name` resolves to, each once, sorted as the Python client's targets_from_dns
// sorts them (IPv4 before IPv6, each by its number), as "ip:port" targets ("[ip6]:port"). The
// order is the addresses', not the pods': prefer StatefulSetTargets where names are stable.
absl::StatusOr<std::vector<std::string>> ResolveShardTargets(const std::string& name, int port);

}  // namespace pagedattn
