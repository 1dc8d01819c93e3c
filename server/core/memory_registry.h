// MemoryRegistry: device memory that clients on the same node registered (CUDA IPC) so that
// Forward's tensors can name {region, offset} instead of carrying bytes. It knows each region's
// owner, the cache it serves and its lease, and turns a Forward's {region, offset, bytes} into an
// address after checking every bound. Regions idle past their lease are released by a thread of
// the registry's own, so a client that dies without unregistering leaves nothing behind.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/backend.h"
#include "server/core/periodic_task.h"

namespace pagedattn {

struct RegionSpec {
  std::string owner;     // The caller's tenant ("" without auth).
  std::string cache_id;  // The cache whose Forwards may use it (checked by the caller).
  int32_t device = 0;    // The cache's device.
  std::string handle;    // cudaIpcMemHandle_t bytes.
  int64_t size_bytes = 0;
  absl::Duration lease = absl::ZeroDuration();  // Zero: the registry's default.
  std::vector<std::string> event_handles;       // cudaIpcEventHandle_t bytes, for DeviceSync.
};

struct RegionInfo {
  std::string id;
  std::string cache_id;
  int64_t size_bytes = 0;
  int32_t device = 0;
  absl::Duration lease;
  int32_t num_events = 0;
};

struct MemoryRegistryOptions {
  int64_t max_regions = 1024;                       // Regions held at once, server-wide.
  absl::Duration default_lease = absl::Minutes(5);  // When a registration names none.
  absl::Duration max_lease = absl::Hours(24);
  absl::Duration sweep_interval = absl::Seconds(1);  // How often expired leases are looked for.
};

class MemoryRegistry {
 public:
  // Why a region went away, for the server's log.
  using OnRelease = std::function<void(const RegionInfo&, const std::string& why)>;

  MemoryRegistry(Backend* backend, MemoryRegistryOptions options, OnRelease on_release = nullptr);
  ~MemoryRegistry();  // Stops the sweeper; the mappings go once no Forward pins them.
  MemoryRegistry(const MemoryRegistry&) = delete;
  MemoryRegistry& operator=(const MemoryRegistry&) = delete;

  // Maps the handle (the backend's ImportMemory) and records the region. INVALID_ARGUMENT for
  // a bad size, lease or handle; RESOURCE_EXHAUSTED past max_regions; FAILED_PRECONDITION on a
  // backend without device tensors, or where max_regions is 0 (registration off).
  absl::StatusOr<RegionInfo> Register(const RegionSpec& spec);
  // Whether regions may be registered at all (max_regions > 0).
  bool enabled() const { return options_.max_regions > 0; }
  // OK, or FAILED_PRECONDITION saying why no region can ever be registered here (a backend
  // without device tensors, or registration off): said before any argument is looked at.
  absl::Status CheckAvailable() const;
  // NOT_FOUND when there is no such region of this owner.
  absl::Status Unregister(const std::string& region_id, const std::string& owner);

  // Keeps a region's mapping alive while a Forward uses it.
  using Pin = std::shared_ptr<const void>;

  // The address of `bytes` bytes at `offset` in the region, for a Forward of `owner` on
  // `cache_id`; renews the region's lease and appends a pin to *pins. `what` names the tensor
  // in errors ("q"). NOT_FOUND for an unknown region (or another owner's), INVALID_ARGUMENT for
  // another cache's region, a misaligned offset or bytes past the region's end.
  absl::StatusOr<char*> Resolve(const std::string& region_id, int64_t offset, int64_t bytes,
                                const std::string& cache_id, const std::string& owner,
                                const char* what, std::vector<Pin>* pins);

  // The event at 1-based `index` of the region (ImportedEvent::handle()), with Resolve's checks
  // of region, cache and owner; INVALID_ARGUMENT for an index the region has no event for.
  absl::StatusOr<void*> ResolveEvent(const std::string& region_id, int32_t index,
                                     const std::string& cache_id, const std::string& owner,
                                     const char* what, std::vector<Pin>* pins);

  // Releases the regions serving a cache (it was deleted); returns how many.
  int64_t ReleaseCache(const std::string& cache_id);
  // Releases regions idle past their lease at `now`; returns how many. The sweeper calls it.
  int64_t Sweep(absl::Time now);

  int64_t CountFor(const std::string& cache_id) const;
  int64_t size() const;

 private:
  struct Region;
  // The owner's region serving cache_id, its lease renewed; `what` names the field in errors.
  absl::StatusOr<std::shared_ptr<Region>> Use(const std::string& region_id,
                                              const std::string& cache_id, const std::string& owner,
                                              const std::string& what);
  void Released(std::vector<std::shared_ptr<Region>> regions, const std::string& why);

  Backend* const backend_;
  const MemoryRegistryOptions options_;
  const OnRelease on_release_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
  // Mappings by (device, handle): a handle registered twice (for two caches) is mapped once.
  // Opening one takes milliseconds, so under a lock of its own.
  absl::Mutex import_mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<ImportedMemory>> mapped_
      ABSL_GUARDED_BY(import_mu_);
  // Last: stopped (a sweep in progress waited for) before the members it uses go.
  PeriodicTask sweeper_;
};

}  // namespace pagedattn
