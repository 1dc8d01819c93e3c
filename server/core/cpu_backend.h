// CpuBackend: the reference backend and the GPU-less default. Pools live in host RAM;
// attention runs in float32, multi-threaded over (span, kv head, query block).
#pragma once

#include <memory>

#include "server/core/backend.h"
#include "server/core/thread_pool.h"

namespace pagedattn {

class CpuBackend final : public Backend {
 public:
  // num_threads <= 0: one per hardware thread.
  explicit CpuBackend(int num_threads = 0);

  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string name() const override { return "cpu"; }
  std::string device_name() const override;
  int device_count() const override { return 1; }
  absl::StatusOr<MemoryInfo> memory(int device) const override;
  absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry& geometry) override;
  absl::Status Forward(KvPool& pool, const CacheGeometry& geometry, const ForwardPlan& plan,
                       const ForwardIO& io) override;

 private:
  std::unique_ptr<ThreadPool> threads_;
};

// MemTotal and MemAvailable from /proc/meminfo (falls back to sysconf).
MemoryInfo HostMemory();

}  // namespace pagedattn
