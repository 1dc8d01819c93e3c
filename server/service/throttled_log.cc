#include "server/service/throttled_log.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace pagedattn {

void LogThrottled(spdlog::level::level_enum level, const std::string& kind,
                  const std::string& line) {
  static absl::Mutex mu;
  static auto* last_seen = new std::map<std::string, std::pair<absl::Time, int>>();
  if (!spdlog::should_log(level)) return;
  const absl::Time now = absl::Now();
  int suppressed = 0;
  {
    absl::MutexLock lock(&mu);
    if (last_seen->size() > 1000) last_seen->clear();
    auto& [when, count] = (*last_seen)[kind];
    if (now - when < absl::Seconds(1)) {
      ++count;
      return;
    }
    suppressed = count;
    when = now;
    count = 0;
  }
  spdlog::log(level, "{}{}", line,
              suppressed > 0 ? absl::StrCat(" (and ", suppressed, " more like it)") : "");
}

}  // namespace pagedattn
