// CacheManager: creates (validate, then allocate), finds, lists and deletes caches.
// Caches are owned by a tenant ("" when auth is off): other tenants see NOT_FOUND.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/backend.h"
#include "server/core/cache.h"
#include "server/core/cache_config.h"

namespace pagedattn {

struct CacheManagerLimits {
  int64_t max_caches_per_tenant = 64;
  int64_t max_total_pool_bytes = 0;  // 0: no limit beyond the device's free memory.
  ForwardLimits forward;
  // Caches unused this long are deleted (the server runs DeleteIdle with it); zero: never.
  // PagedAttnServer::Start sets it from ServerOptions::cache_idle_timeout.
  absl::Duration cache_idle_timeout = absl::ZeroDuration();
};

// A cache DeleteIdle took, for the server's log.
struct IdleCache {
  std::string id;
  std::string name;
  std::string owner;
  int64_t bytes = 0;    // Its pool's bytes.
  absl::Duration idle;  // How long it had gone unused.
};

class CacheManager {
 public:
  // A call on its way to a cache: from its arrival at the server to its lookup (GetToUse),
  // through its waits for a thread and for its turn on a layer. While one is on its way,
  // DeleteIdle leaves every cache that had not yet gone unused for the timeout when the call
  // arrived: the call may be for it, and its caller came in time. Copies share one record, which
  // ends at GetToUse or with the last copy.
  class Arrival {
   public:
    Arrival() = default;
    // Ends it now (for a call that will not look a cache up after all); idempotent.
    void End();

   private:
    friend class CacheManager;
    struct Book;
    struct Record;
    std::shared_ptr<Record> record_;
  };

  explicit CacheManager(Backend* backend, CacheManagerLimits limits = {});
  // Caches still held elsewhere must be gone first (their deleters count bytes here).
  ~CacheManager();

  Backend& backend() const { return *backend_; }

  // Dry run against the memory free now: never allocates.
  ValidationResult Validate(const CacheConfigRequest& config) const;
  // Validates, then allocates. The stop token is read while the pool is allocated and once
  // after: a caller that gave up leaves no cache behind.
  absl::StatusOr<std::shared_ptr<Cache>> Create(const CacheConfigRequest& config,
                                                const std::string& name, const std::string& owner,
                                                const StopToken& stop = {});
  absl::StatusOr<std::shared_ptr<Cache>> Get(const std::string& cache_id,
                                             const std::string& owner) const;
  // Get for a Forward, release or truncate (a Step layer): the cache counts as used from its
  // lookup, under the lock DeleteIdle takes, so that no idle sweep takes it from the call. Ends
  // the call's arrival once the use is marked.
  absl::StatusOr<std::shared_ptr<Cache>> GetToUse(const std::string& cache_id,
                                                  const std::string& owner,
                                                  Arrival arrival = {}) const;
  // A call that will look a cache up to use it has arrived (now). Empty (no record, no cost
  // beyond the check) when no idle timeout is set.
  Arrival Arrive() const;
  // The owner's caches, oldest first (in the order they were made: Cache::serial).
  std::vector<std::shared_ptr<Cache>> List(const std::string& owner) const;
  // The owner's caches after the one whose ListToken is `after` ("": from the first), in List's
  // order: a page of a listing goes on there even where caches were deleted in between. An
  // `after` that no ListToken of this manager for this owner could be is INVALID_ARGUMENT.
  absl::StatusOr<std::vector<std::shared_ptr<Cache>>> ListAfter(const std::string& owner,
                                                                const std::string& after) const;
  // Where a listing stands once it has given this cache: its place among every tenant's caches,
  // enciphered with this manager's key and the owner, so that a token tells nothing of other
  // tenants' caches and holds for its owner only.
  std::string ListToken(const Cache& cache) const;
  // Every tenant's caches (for metrics).
  std::vector<std::shared_ptr<Cache>> ListAll() const;
  // Returns the bytes freed. The memory returns once in-flight Forwards drop their reference,
  // and counts in total_pool_bytes() until then.
  absl::StatusOr<int64_t> Delete(const std::string& cache_id, const std::string& owner);
  // Deletes every tenant's caches unused for `idle` or longer at `now` (Cache::last_used), as
  // Delete does, but those a call still on its way may be for (Arrival); returns them, oldest
  // first. A later call naming one (of the last 4096) is told
  // why it is NOT_FOUND.
  std::vector<IdleCache> DeleteIdle(std::chrono::steady_clock::time_point now, absl::Duration idle);

  // The pools of live caches and of deleted ones that a Forward still holds.
  int64_t total_pool_bytes() const;
  const CacheManagerLimits& limits() const { return limits_; }
  // Bytes a new pool on `device` may take now: its free memory, or less where
  // max_total_pool_bytes leaves less.
  int64_t PoolBytesFree(int32_t device) const { return ContextFor(device).free_bytes; }

 private:
  ValidationContext ContextFor(int32_t device) const;
  // NOT_FOUND for an id that names none of the owner's caches; for one DeleteIdle took, saying so.
  absl::Status UnknownCacheLocked(const std::string& cache_id, const std::string& owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The owner's cache of that id, or UnknownCacheLocked's status.
  absl::StatusOr<std::shared_ptr<Cache>> FindLocked(const std::string& cache_id,
                                                    const std::string& owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Backend* const backend_;
  const CacheManagerLimits limits_;
  absl::Mutex create_mu_;  // Serializes memory checks with allocations.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Cache>> caches_ ABSL_GUARDED_BY(mu_);
  int64_t total_pool_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The caches DeleteIdle took, the latest kIdleDeletedKept: their owners and idle times.
  static constexpr size_t kIdleDeletedKept = 4096;
  absl::flat_hash_map<std::string, std::pair<std::string, absl::Duration>> idle_deleted_
      ABSL_GUARDED_BY(mu_);
  std::deque<std::string> idle_deleted_order_ ABSL_GUARDED_BY(mu_);
  uint64_t caches_made_ ABSL_GUARDED_BY(create_mu_) = 0;
  uint64_t token_key_[4];  // ListToken's round keys, random per manager
  // The arrival times of calls on their way to a cache (shared with their records, which may
  // outlive the manager in a call torn down late).
  std::shared_ptr<Arrival::Book> arrivals_;
};

// A cache's name is a label for people and logs: at most this many printable ASCII characters.
inline constexpr size_t kMaxCacheNameBytes = 128;
absl::Status ValidateCacheName(absl::string_view name);

// 128 random bits from the OS, as 32 hex digits.
std::string NewCacheId();

// An id as received (a cache's, a memory region's), quoted for an error message: escaped (no
// control characters reach a log or a terminal, no UTF-8 character is cut in half) and cut to 64
// bytes with its length (a hostile id cannot make the status arbitrarily long).
std::string QuotedId(absl::string_view id);

}  // namespace pagedattn
