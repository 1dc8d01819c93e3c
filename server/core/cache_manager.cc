// CacheManager: the registry of caches and the only place pools are allocated.
#include "server/core/cache_manager.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <random>

#include "absl/hash/hash.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/core/error_info.h"

namespace pagedattn {

namespace {

absl::Status UnknownCache(absl::string_view cache_id) {
  if (cache_id.empty()) {
    return absl::InvalidArgumentError("cache_id is required (CreateCache or ListCaches gives it)");
  }
  return absl::NotFoundError(absl::StrCat("cache '", QuotedId(cache_id), "' not found"));
}

}  // namespace

std::string QuotedId(absl::string_view id) {
  constexpr size_t kShown = 64;
  std::string shown = absl::CHexEscape(id.substr(0, kShown));
  if (id.size() > kShown) absl::StrAppend(&shown, "...(", id.size(), " bytes)");
  return shown;
}

absl::Status ValidateCacheName(absl::string_view name) {
  // Characters first: a name of 100 non-ASCII characters is refused for them, not its bytes.
  for (size_t i = 0; i < name.size() && i <= kMaxCacheNameBytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c > 0x7e) {
      return InvalidFieldError(
          "name", absl::StrCat("name must be printable ASCII (0x20..0x7e); character ", i, " is 0x",
                               absl::Hex(c, absl::kZeroPad2)));
    }
  }
  if (name.size() > kMaxCacheNameBytes) {
    return InvalidFieldError("name", absl::StrCat("name must be at most ", kMaxCacheNameBytes,
                                                  " characters (got ", name.size(), ")"));
  }
  return absl::OkStatus();
}

std::string NewCacheId() {
  std::random_device rd;  // getrandom(2) on Linux
  std::string id;
  for (int i = 0; i < 4; ++i) absl::StrAppendFormat(&id, "%08x", rd());
  return id;
}

struct CacheManager::Arrival::Book {
  absl::Mutex mu;
  std::multiset<std::chrono::steady_clock::time_point> times ABSL_GUARDED_BY(mu);
};

struct CacheManager::Arrival::Record {
  std::shared_ptr<Book> book;
  std::multiset<std::chrono::steady_clock::time_point>::iterator at;
  bool ended = false;  // under book->mu
  ~Record() { End(); }
  void End() {
    absl::MutexLock lock(&book->mu);
    if (ended) return;
    ended = true;
    book->times.erase(at);
  }
};

CacheManager::CacheManager(Backend* backend, CacheManagerLimits limits)
    : backend_(backend), limits_(limits), arrivals_(std::make_shared<Arrival::Book>()) {
  std::random_device rd;
  for (uint64_t& k : token_key_) k = (uint64_t{rd()} << 32) | rd();
}

CacheManager::~CacheManager() {
  // The caches' deleters uncount their bytes under mu_: they run while the members live.
  absl::flat_hash_map<std::string, std::shared_ptr<Cache>> caches;
  {
    absl::MutexLock lock(&mu_);
    caches.swap(caches_);
  }
}

ValidationContext CacheManager::ContextFor(int32_t device) const {
  ValidationContext ctx;
  ctx.backend = backend_->kind();
  ctx.device_count = backend_->device_count();
  ctx.max_message_bytes = limits_.forward.max_response_bytes;
  if (device >= 0 && device < ctx.device_count) {
    absl::StatusOr<MemoryInfo> mem = backend_->memory(device);
    ctx.free_bytes = mem.ok() ? mem->free_bytes : 0;
    ctx.free_bytes_source = ctx.backend == BackendKind::kCpu
                                ? std::string("free in host memory (the CPU backend's)")
                                : absl::StrCat("free on device ", device);
  }
  if (limits_.max_total_pool_bytes > 0) {
    const int64_t used = total_pool_bytes();
    const int64_t left = std::max<int64_t>(0, limits_.max_total_pool_bytes - used);
    if (left < ctx.free_bytes) {
      ctx.free_bytes = left;
      ctx.free_bytes_source = absl::StrCat(
          "left of the server's pool budget (--max_total_pool_gb: ", limits_.max_total_pool_bytes,
          " bytes, ", used, " in use)");
    }
  }
  return ctx;
}

ValidationResult CacheManager::Validate(const CacheConfigRequest& config) const {
  ValidationContext ctx = ContextFor(config.device);
  ctx.device_runs = [this, device = config.device](DType kv_dtype, int head_dim) {
    return backend_->RunsHeadDim(device, kv_dtype, head_dim);
  };
  return ValidateCacheConfig(config, ctx);
}

absl::StatusOr<std::shared_ptr<Cache>> CacheManager::Create(const CacheConfigRequest& config,
                                                            const std::string& name,
                                                            const std::string& owner,
                                                            const StopToken& stop) {
  if (absl::Status s = ValidateCacheName(name); !s.ok()) {
    // Said with the config's violations, if it has any: one answer names every bad field.
    ValidationResult v = Validate(config);
    if (v.valid()) return s;
    const std::vector<FieldViolation> named = FieldViolationsFromStatus(s);
    v.violations.insert(v.violations.begin(), named.begin(), named.end());
    return ValidationStatus(v);
  }
  absl::MutexLock create(&create_mu_);
  // The config first: a bad one is told every violation, not to delete a cache for it.
  ValidationResult v = Validate(config);
  if (absl::Status s = ValidationStatus(v); !s.ok()) return s;
  if (limits_.max_caches_per_tenant > 0 &&
      static_cast<int64_t>(List(owner).size()) >= limits_.max_caches_per_tenant) {
    return WithErrorInfo(absl::ResourceExhaustedError(absl::StrCat(
                             "at most ", limits_.max_caches_per_tenant,
                             limits_.max_caches_per_tenant == 1 ? " cache" : " caches",
                             " per tenant (--max_caches_per_tenant); delete one first")),
                         {"TOO_MANY_CACHES", {{"max_caches", limits_.max_caches_per_tenant}}});
  }
  absl::StatusOr<std::unique_ptr<KvPool>> pool = backend_->AllocatePool(v.geometry, stop);
  if (!pool.ok()) return pool.status();
  // A caller that gave up while the pool was allocated gets no cache it cannot know about.
  if (absl::Status s = stop.Check(); !s.ok()) return s;
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  // The pool's bytes count against --max_total_pool_gb until the cache is gone, not only
  // until it is deleted: a Forward in flight keeps it (and its pool) past DeleteCache.
  const int64_t bytes = v.geometry.TotalBytes();
  std::shared_ptr<Cache> cache(new Cache(NewCacheId(), name, owner, v.geometry, *std::move(pool),
                                         backend_, now_ms, limits_.forward, ++caches_made_),
                               [this, bytes](Cache* c) {
                                 delete c;
                                 absl::MutexLock lock(&mu_);
                                 total_pool_bytes_ -= bytes;
                               });
  absl::MutexLock lock(&mu_);
  caches_[cache->id()] = cache;
  total_pool_bytes_ += bytes;
  return cache;
}

absl::Status CacheManager::UnknownCacheLocked(const std::string& cache_id,
                                              const std::string& owner) const {
  if (auto it = idle_deleted_.find(cache_id);
      it != idle_deleted_.end() && it->second.first == owner) {
    return absl::NotFoundError(
        absl::StrCat("cache '", cache_id, "' was deleted by the server after ",
                     absl::ToInt64Seconds(it->second.second),
                     " s unused (its --cache_idle_timeout_s): create the cache again"));
  }
  return UnknownCache(cache_id);
}

absl::StatusOr<std::shared_ptr<Cache>> CacheManager::FindLocked(const std::string& cache_id,
                                                                const std::string& owner) const {
  auto it = caches_.find(cache_id);
  // Another tenant's cache is indistinguishable from a missing one.
  if (it == caches_.end() || it->second->owner() != owner) {
    return UnknownCacheLocked(cache_id, owner);
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Cache>> CacheManager::Get(const std::string& cache_id,
                                                         const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  return FindLocked(cache_id, owner);
}

void CacheManager::Arrival::End() {
  if (record_ != nullptr) record_->End();
}

CacheManager::Arrival CacheManager::Arrive() const {
  Arrival a;
  if (limits_.cache_idle_timeout <= absl::ZeroDuration()) return a;
  a.record_ = std::make_shared<Arrival::Record>();
  a.record_->book = arrivals_;
  absl::MutexLock lock(&arrivals_->mu);
  a.record_->at = arrivals_->times.insert(std::chrono::steady_clock::now());
  return a;
}

absl::StatusOr<std::shared_ptr<Cache>> CacheManager::GetToUse(const std::string& cache_id,
                                                              const std::string& owner,
                                                              Arrival arrival) const {
  absl::StatusOr<std::shared_ptr<Cache>> cache;
  {
    absl::MutexLock lock(&mu_);
    cache = FindLocked(cache_id, owner);
    if (cache.ok()) (*cache)->MarkUsed();
  }
  arrival.End();  // after the use is marked: a sweep sees one or the other
  return cache;
}

std::vector<std::shared_ptr<Cache>> CacheManager::List(const std::string& owner) const {
  std::vector<std::shared_ptr<Cache>> out = ListAll();
  out.erase(
      std::remove_if(out.begin(), out.end(), [&](const auto& c) { return c->owner() != owner; }),
      out.end());
  return out;
}

namespace {

// A list token is a cache's serial (under 2^40) above 24 zero bits, through a four-round Feistel
// permutation of 64 bits keyed by the manager's keys and the owner: another tenant's token, or
// one made up, deciphers to nonzero low bits (but for one in 2^24) and is refused.
constexpr int kTokenSerialBits = 40;

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Feistel(uint64_t block, const uint64_t (&keys)[4], uint64_t tweak, bool decipher) {
  uint32_t left = static_cast<uint32_t>(block >> 32), right = static_cast<uint32_t>(block);
  for (int i = 0; i < 4; ++i) {
    const int round = decipher ? 3 - i : i;
    if (decipher) std::swap(left, right);
    const uint32_t f = static_cast<uint32_t>(Mix(right ^ keys[round] ^ tweak));
    left ^= f;
    if (!decipher) std::swap(left, right);
  }
  return (uint64_t{left} << 32) | right;
}

}  // namespace

std::string CacheManager::ListToken(const Cache& cache) const {
  const uint64_t block = cache.serial() << (64 - kTokenSerialBits);
  return absl::StrFormat("%016x", Feistel(block, token_key_, absl::HashOf(cache.owner()), false));
}

absl::StatusOr<std::vector<std::shared_ptr<Cache>>> CacheManager::ListAfter(
    const std::string& owner, const std::string& after) const {
  std::vector<std::shared_ptr<Cache>> all = List(owner);
  if (after.empty()) return all;
  uint64_t block = 0;
  uint64_t serial = 0;
  if (after.size() == 16 && absl::SimpleHexAtoi(after, &block)) {
    block = Feistel(block, token_key_, absl::HashOf(owner), true);
    if ((block & ((uint64_t{1} << (64 - kTokenSerialBits)) - 1)) == 0) {
      serial = block >> (64 - kTokenSerialBits);
    }
  }
  if (serial == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token '", absl::CHexEscape(after.substr(0, 64)),
                     "' is not one this server gave (pass an answer's next_page_token, or "
                     "nothing for the first page)"));
  }
  all.erase(all.begin(), std::find_if(all.begin(), all.end(), [&](const auto& c) {
              return c->serial() > serial;
            }));
  return all;
}

std::vector<std::shared_ptr<Cache>> CacheManager::ListAll() const {
  std::vector<std::shared_ptr<Cache>> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, cache] : caches_) out.push_back(cache);
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a->serial() < b->serial(); });
  return out;
}

absl::StatusOr<int64_t> CacheManager::Delete(const std::string& cache_id,
                                             const std::string& owner) {
  // Destroyed (and its bytes uncounted, Create's deleter) outside mu_: here, or by the last
  // Forward that holds it.
  std::shared_ptr<Cache> gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = caches_.find(cache_id);
    if (it == caches_.end() || it->second->owner() != owner) {
      return UnknownCacheLocked(cache_id, owner);
    }
    gone = std::move(it->second);
    caches_.erase(it);
  }
  const int64_t bytes = gone->geometry().TotalBytes();
  gone.reset();
  // Pools are mappings of their own and go back to the system when the last reference drops;
  // this returns what the heap kept of the cache's bookkeeping and of recent requests.
  malloc_trim(0);
  return bytes;
}

std::vector<IdleCache> CacheManager::DeleteIdle(std::chrono::steady_clock::time_point now,
                                                absl::Duration idle) {
  std::vector<std::shared_ptr<Cache>> gone;
  {
    absl::MutexLock lock(&mu_);
    // The oldest call still on its way to a cache: a cache that went idle only after it arrived
    // stays (read under mu_, which GetToUse marks a use under before it ends an arrival).
    std::optional<std::chrono::steady_clock::time_point> oldest_arrival;
    {
      absl::MutexLock arrivals(&arrivals_->mu);
      if (!arrivals_->times.empty()) oldest_arrival = *arrivals_->times.begin();
    }
    auto awaited = [&](const Cache& c) {
      return oldest_arrival.has_value() && absl::FromChrono(*oldest_arrival - c.last_used()) < idle;
    };
    for (auto it = caches_.begin(); it != caches_.end();) {
      if (!it->second->in_use() && absl::FromChrono(now - it->second->last_used()) >= idle &&
          !awaited(*it->second)) {
        const Cache& c = *it->second;
        if (idle_deleted_order_.size() == kIdleDeletedKept) {
          idle_deleted_.erase(idle_deleted_order_.front());
          idle_deleted_order_.pop_front();
        }
        idle_deleted_[c.id()] = {c.owner(), absl::FromChrono(now - c.last_used())};
        idle_deleted_order_.push_back(c.id());
        gone.push_back(std::move(it->second));
        caches_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  if (gone.empty()) return {};
  std::sort(gone.begin(), gone.end(),
            [](const auto& a, const auto& b) { return a->serial() < b->serial(); });
  std::vector<IdleCache> out;
  for (std::shared_ptr<Cache>& c : gone) {
    out.push_back({c->id(), c->name(), c->owner(), c->geometry().TotalBytes(),
                   absl::FromChrono(now - c->last_used())});
    c.reset();
  }
  malloc_trim(0);  // as Delete
  return out;
}

int64_t CacheManager::total_pool_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_pool_bytes_;
}

}  // namespace pagedattn
