// MemoryRegistry: regions by id, their leases, and the checked resolution of {region, offset}.
#include "server/core/memory_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/capabilities.h"
#include "server/core/cache_manager.h"  // NewCacheId

namespace pagedattn {
namespace {

absl::Status TooManyRegions(size_t held, int64_t limit) {
  if (limit == 0) {
    return absl::FailedPreconditionError(
        "RegisterMemory is off on this server (--max_memory_regions=0): send tensors as bytes");
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("the server holds ", held, " memory regions, its limit ",
                   "(--max_memory_regions); unregister regions no longer used"));
}

// A request that names no region: a missing field, not an unknown region.
absl::Status MissingRegionId(absl::string_view field_prefix) {
  return absl::InvalidArgumentError(
      absl::StrCat(field_prefix, "region_id is required (RegisterMemory gives it)"));
}

}  // namespace

struct MemoryRegistry::Region {
  RegionInfo info;
  std::string owner;
  std::shared_ptr<ImportedMemory> memory;
  std::vector<std::shared_ptr<ImportedEvent>> events;
  absl::Time last_used;  // guarded by the registry's mu_
};

MemoryRegistry::MemoryRegistry(Backend* backend, MemoryRegistryOptions options,
                               OnRelease on_release)
    : backend_(backend),
      options_(options),
      on_release_(std::move(on_release)),
      sweeper_(options_.sweep_interval, [this] { Sweep(absl::Now()); }) {}

MemoryRegistry::~MemoryRegistry() = default;

absl::Status MemoryRegistry::CheckAvailable() const {
  if (!SupportsDeviceTensors(backend_->kind())) {
    return absl::FailedPreconditionError(
        absl::StrCat("device tensors (RegisterMemory, Tensor.device_buffer) need the CUDA backend; "
                     "this server runs the ",
                     backend_->name(), " backend: send the tensors' data instead"));
  }
  if (!enabled()) return TooManyRegions(0, 0);
  return absl::OkStatus();
}

absl::StatusOr<RegionInfo> MemoryRegistry::Register(const RegionSpec& spec) {
  if (absl::Status s = CheckAvailable(); !s.ok()) return s;
  if (spec.size_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("size_bytes must be >= 1 (got ", spec.size_bytes, ")"));
  }
  const absl::Duration lease =
      spec.lease == absl::ZeroDuration() ? options_.default_lease : spec.lease;
  if (lease < absl::Seconds(1) || lease > options_.max_lease) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_seconds must be in 1..", absl::ToInt64Seconds(options_.max_lease),
        " or 0 for the server's default (got ", absl::ToInt64Seconds(spec.lease), ")"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
      return TooManyRegions(regions_.size(), options_.max_regions);
    }
  }
  const std::string key = absl::StrCat(spec.device, ":", spec.handle);
  std::shared_ptr<ImportedMemory> memory;
  {
    absl::MutexLock lock(&import_mu_);
    if (auto it = mapped_.find(key); it != mapped_.end()) memory = it->second.lock();
    if (memory == nullptr) {
      absl::StatusOr<std::unique_ptr<ImportedMemory>> imported =
          backend_->ImportMemory(spec.device, spec.handle);
      if (!imported.ok()) return imported.status();
      memory = std::shared_ptr<ImportedMemory>(*std::move(imported));
      mapped_[key] = memory;
    }
    for (auto it = mapped_.begin(); it != mapped_.end();) {  // forget mappings gone since
      if (it->second.expired()) {
        mapped_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  if (spec.size_bytes > memory->size()) {
    return absl::InvalidArgumentError(absl::StrCat("size_bytes is ", spec.size_bytes,
                                                   " but the allocation the handle names has ",
                                                   memory->size(), " bytes"));
  }
  std::vector<std::shared_ptr<ImportedEvent>> events;
  for (size_t i = 0; i < spec.event_handles.size(); ++i) {
    absl::StatusOr<std::unique_ptr<ImportedEvent>> event =
        backend_->ImportEvent(spec.device, spec.event_handles[i]);
    if (!event.ok()) {
      return absl::Status(event.status().code(),
                          absl::StrCat("cuda_ipc_events[", i, "]: ", event.status().message()));
    }
    events.push_back(*std::move(event));
  }
  auto region = std::make_shared<Region>();
  region->events = std::move(events);
  region->info = {.id = NewCacheId(),
                  .cache_id = spec.cache_id,
                  .size_bytes = spec.size_bytes,
                  .device = spec.device,
                  .lease = lease,
                  .num_events = static_cast<int32_t>(spec.event_handles.size())};
  region->owner = spec.owner;
  region->memory = std::move(memory);
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
    return TooManyRegions(regions_.size(), options_.max_regions);  // others registered meanwhile
  }
  region->last_used = absl::Now();
  regions_[region->info.id] = region;
  return region->info;
}

absl::Status MemoryRegistry::Unregister(const std::string& region_id, const std::string& owner) {
  if (region_id.empty()) return MissingRegionId("");
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second->owner != owner) {
      return absl::NotFoundError(
          absl::StrCat("memory region '", QuotedId(region_id), "' is not registered"));
    }
    region = std::move(it->second);
    regions_.erase(it);
  }
  Released({std::move(region)}, "unregistered");
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<MemoryRegistry::Region>> MemoryRegistry::Use(
    const std::string& region_id, const std::string& cache_id, const std::string& owner,
    const std::string& what) {
  if (region_id.empty()) return MissingRegionId(absl::StrCat(what, "."));
  std::shared_ptr<Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second->owner != owner) {
      return absl::NotFoundError(
          absl::StrCat(what, ".region_id '", QuotedId(region_id),
                       "' is not registered (unregistered, released after its lease, or the server "
                       "restarted): register the memory again"));
    }
    region = it->second;
    region->last_used = absl::Now();
  }
  if (region->info.cache_id != cache_id) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": region ", region->info.id,
                                                   " serves cache ", region->info.cache_id,
                                                   ", not this Forward's cache ", cache_id));
  }
  return region;
}

absl::StatusOr<char*> MemoryRegistry::Resolve(const std::string& region_id, int64_t offset,
                                              int64_t bytes, const std::string& cache_id,
                                              const std::string& owner, const char* what,
                                              std::vector<Pin>* pins) {
  const std::string field = absl::StrCat(what, ".device_buffer");
  absl::StatusOr<std::shared_ptr<Region>> region = Use(region_id, cache_id, owner, field);
  if (!region.ok()) return region.status();
  const RegionInfo& info = (*region)->info;
  if (offset < 0 || offset % kDeviceTensorAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".offset must be >= 0 and a multiple of ",
                                                   kDeviceTensorAlign, " (got ", offset, ")"));
  }
  if (bytes > info.size_bytes || offset > info.size_bytes - bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes, " bytes at offset ", offset,
                                                   " run past the end of region ", info.id, " (",
                                                   info.size_bytes, " bytes)"));
  }
  char* address = (*region)->memory->base() + offset;
  pins->push_back(*std::move(region));
  return address;
}

absl::StatusOr<void*> MemoryRegistry::ResolveEvent(const std::string& region_id, int32_t index,
                                                   const std::string& cache_id,
                                                   const std::string& owner, const char* what,
                                                   std::vector<Pin>* pins) {
  absl::StatusOr<std::shared_ptr<Region>> region = Use(region_id, cache_id, owner, "sync");
  if (!region.ok()) return region.status();
  const auto& events = (*region)->events;
  if (index < 1 || index > static_cast<int32_t>(events.size())) {
    return absl::InvalidArgumentError(absl::StrCat("sync.", what, " must be in 1..", events.size(),
                                                   ", the events of region ", region_id, " (got ",
                                                   index, ")"));
  }
  void* handle = events[static_cast<size_t>(index - 1)]->handle();
  pins->push_back(*std::move(region));
  return handle;
}

int64_t MemoryRegistry::ReleaseCache(const std::string& cache_id) {
  std::vector<std::shared_ptr<Region>> gone;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->second->info.cache_id == cache_id) {
        gone.push_back(std::move(it->second));
        regions_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  const int64_t n = static_cast<int64_t>(gone.size());
  Released(std::move(gone), "its cache was deleted");
  return n;
}

int64_t MemoryRegistry::Sweep(absl::Time now) {
  std::vector<std::shared_ptr<Region>> gone;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (now - it->second->last_used >= it->second->info.lease) {
        gone.push_back(std::move(it->second));
        regions_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  const int64_t n = static_cast<int64_t>(gone.size());
  Released(std::move(gone), "unused for its whole lease");
  return n;
}

void MemoryRegistry::Released(std::vector<std::shared_ptr<Region>> regions,
                              const std::string& why) {
  for (const std::shared_ptr<Region>& r : regions) {
    if (on_release_) on_release_(r->info, why);
  }
  // The mappings close here, or when the last Forward using one lets go of its pin.
}

int64_t MemoryRegistry::CountFor(const std::string& cache_id) const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [id, r] : regions_) n += r->info.cache_id == cache_id ? 1 : 0;
  return n;
}

int64_t MemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

}  // namespace pagedattn
