// CpuBackend: the reference backend and the GPU-less default. Pools live in host RAM;
// attention runs in float32, multi-threaded over (span, kv head, query block).
#pragma once

#include <cstdint>
#include <memory>

#include "server/core/backend.h"
#include "server/core/thread_pool.h"

namespace pagedattn {

struct CpuBackendOptions {
  int num_threads = 0;  // <= 0: one per hardware thread.
  // Host memory kept out of pools (requests in flight): memory() reports this much less free.
  int64_t reserved_bytes = 0;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options = {});

  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string name() const override { return "cpu"; }
  std::string device_name() const override;
  int device_count() const override { return 1; }
  // The host memory this process may use (cgroup and RLIMIT_AS included), less the reserve.
  absl::StatusOr<MemoryInfo> memory(int device) const override;
  // The pool is its own anonymous mapping, so deleting the cache returns its memory to the
  // system; its pages are faulted in up front, in pieces between which the stop token is read.
  absl::StatusOr<std::unique_ptr<KvPool>> AllocatePool(const CacheGeometry& geometry,
                                                       const StopToken& stop) override;
  absl::Status Forward(KvPool& pool, const CacheGeometry& geometry, const ForwardPlan& plan,
                       const ForwardIO& io) override;

 private:
  std::unique_ptr<ThreadPool> threads_;
  int64_t reserved_bytes_;
};

}  // namespace pagedattn
