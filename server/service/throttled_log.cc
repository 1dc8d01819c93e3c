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
  // All kinds together: kinds keyed by a client's connection are as many as the connections a
  // client opens (a new connection a call made 28,800 lines in 30 s).
  static absl::Time second_start;
  static int lines_this_second = 0;
  static int64_t held_back = 0;  // lines of any kind past kMaxThrottledLinesPerSecond
  if (!spdlog::should_log(level)) return;
  const absl::Time now = absl::Now();
  int suppressed = 0;
  int64_t held = 0;
  {
    absl::MutexLock lock(&mu);
    if (last_seen->size() > 1000) last_seen->clear();
    auto& [when, count] = (*last_seen)[kind];
    if (now - when < absl::Seconds(1)) {
      ++count;
      return;
    }
    if (now - second_start >= absl::Seconds(1)) {
      second_start = now;
      lines_this_second = 0;
    }
    if (lines_this_second >= kMaxThrottledLinesPerSecond) {
      ++held_back;
      return;
    }
    ++lines_this_second;
    suppressed = count;
    held = held_back;
    held_back = 0;
    when = now;
    count = 0;
  }
  spdlog::log(level, "{}{}{}", line,
              suppressed > 0 ? absl::StrCat(" (and ", suppressed, " more like it)") : "",
              held > 0
                  ? absl::StrCat(" (", held, " throttled lines of all kinds held back before it)")
                  : "");
}

}  // namespace pagedattn
