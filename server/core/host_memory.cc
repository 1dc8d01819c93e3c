// HostMemory: /proc/meminfo, the memory cgroup this process is in (v2 memory.max and
// memory.current, or v1 memory.limit_in_bytes and memory.usage_in_bytes) and RLIMIT_AS.
#include "server/core/host_memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pagedattn {
namespace {

std::optional<int64_t> ReadNumber(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return std::nullopt;
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) return std::nullopt;  // "max": no limit
  return value;
}

struct CgroupMemory {
  int64_t limit = 0;
  int64_t usage = 0;
};

// The memory cgroup of this process. /proc/self/cgroup names it relative to the hierarchy's
// root; inside a container with its own cgroup namespace the mount is that root, so the
// relative path is tried first and the mount itself second.
std::optional<CgroupMemory> ReadCgroupMemory() {
  std::ifstream in("/proc/self/cgroup");
  std::string line, v1_path, v2_path;
  bool have_v1 = false, have_v2 = false;
  while (std::getline(in, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) {
      v2_path = parts[2];
      have_v2 = true;
    }
    for (absl::string_view c : absl::StrSplit(parts[1], ',')) {
      if (c == "memory") {
        v1_path = parts[2];
        have_v1 = true;
      }
    }
  }
  // A limit at or above this is "none" (v1 reports 2^63 rounded down to a page).
  constexpr int64_t kNoLimit = int64_t{1} << 60;
  auto read = [&](const std::string& dir, const char* limit_file,
                  const char* usage_file) -> std::optional<CgroupMemory> {
    std::optional<int64_t> limit = ReadNumber(dir + "/" + limit_file);
    std::optional<int64_t> usage = ReadNumber(dir + "/" + usage_file);
    if (!limit.has_value() || !usage.has_value() || *limit <= 0 || *limit >= kNoLimit) {
      return std::nullopt;
    }
    return CgroupMemory{*limit, *usage};
  };
  if (have_v1) {
    for (const std::string& dir :
         {"/sys/fs/cgroup/memory" + v1_path, std::string("/sys/fs/cgroup/memory")}) {
      if (auto m = read(dir, "memory.limit_in_bytes", "memory.usage_in_bytes")) return m;
    }
  }
  if (have_v2) {
    for (const std::string& dir : {"/sys/fs/cgroup" + v2_path, std::string("/sys/fs/cgroup")}) {
      if (auto m = read(dir, "memory.max", "memory.current")) return m;
    }
  }
  return std::nullopt;
}

// VmSize of this process, bytes.
int64_t VirtualSize() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "VmSize:")) {
      std::istringstream fields{std::string(rest)};
      int64_t kb = 0;
      fields >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

}  // namespace

HostMemoryInfo HostMemory() {
  HostMemoryInfo m;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t value = 0;
  while (in >> key >> value >> unit) {
    if (key == "MemTotal:") m.total_bytes = value * 1024;
    if (key == "MemAvailable:") m.free_bytes = value * 1024;
  }
  if (m.total_bytes == 0) {
    m.total_bytes = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGE_SIZE);
    m.free_bytes = int64_t{sysconf(_SC_AVPHYS_PAGES)} * sysconf(_SC_PAGE_SIZE);
  }
  m.limited_by = "MemAvailable";
  if (std::optional<CgroupMemory> cg = ReadCgroupMemory()) {
    m.total_bytes = std::min(m.total_bytes, cg->limit);
    const int64_t left = std::max<int64_t>(0, cg->limit - cg->usage);
    if (left < m.free_bytes) {
      m.free_bytes = left;
      m.limited_by = "memory cgroup";
    }
  }
  rlimit as = {};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    const int64_t limit = static_cast<int64_t>(as.rlim_cur);
    m.total_bytes = std::min(m.total_bytes, limit);
    const int64_t left = std::max<int64_t>(0, limit - VirtualSize());
    if (left < m.free_bytes) {
      m.free_bytes = left;
      m.limited_by = "RLIMIT_AS";
    }
  }
  return m;
}

}  // namespace pagedattn
