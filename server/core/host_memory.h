// What host memory this process may use: the machine's (MemTotal / MemAvailable), bounded by
// its memory cgroup (v1 or v2) and by RLIMIT_AS, so that a container's limit is respected.
#pragma once

#include <cstdint>
#include <string>

namespace pagedattn {

struct HostMemoryInfo {
  int64_t total_bytes = 0;  // The most this process may hold: min(MemTotal, cgroup, RLIMIT_AS).
  int64_t free_bytes = 0;   // What it may still take now.
  std::string limited_by;   // "MemAvailable", "memory cgroup" or "RLIMIT_AS".
};

HostMemoryInfo HostMemory();

}  // namespace pagedattn
