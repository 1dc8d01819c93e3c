// LogThrottled and FlushThrottledLog: per-kind and server-wide caps on lines a second, and the
// counts of the lines held back, logged with the next line or once their second is over.
#include "server/service/throttled_log.h"

#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace pagedattn {
namespace {

// A kind of line: when its last line went out, what it said, and how many were held back since.
struct Kind {
  absl::Time when;
  int count = 0;
  spdlog::level::level_enum level = spdlog::level::info;
  std::string line;  // cut to kMaxKeptLine bytes
};
constexpr size_t kMaxKeptLine = 1024;

struct State {
  absl::Mutex mu;
  std::map<std::string, Kind> kinds ABSL_GUARDED_BY(mu);
  // All kinds together: kinds keyed by a client's connection are as many as the connections a
  // client opens (a new connection a call made 28,800 lines in 30 s).
  absl::Time second_start ABSL_GUARDED_BY(mu);
  int lines_this_second ABSL_GUARDED_BY(mu) = 0;
  int64_t held_back ABSL_GUARDED_BY(mu) = 0;  // lines of any kind past the cap
};

State& TheState() {
  static State* const state = new State();  // never destroyed: logging may outlive main
  return *state;
}

// Takes one of this second's lines of all kinds; false when they are spent.
bool TakeLine(State& s, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  if (now - s.second_start >= absl::Seconds(1)) {
    s.second_start = now;
    s.lines_this_second = 0;
  }
  if (s.lines_this_second >= kMaxThrottledLinesPerSecond) return false;
  ++s.lines_this_second;
  return true;
}

}  // namespace

void LogThrottled(spdlog::level::level_enum level, const std::string& kind,
                  const std::string& line) {
  if (!spdlog::should_log(level)) return;
  State& s = TheState();
  const absl::Time now = absl::Now();
  int suppressed = 0;
  int64_t held = 0;
  {
    absl::MutexLock lock(&s.mu);
    if (s.kinds.size() > 1000) s.kinds.clear();
    Kind& k = s.kinds[kind];
    if (now - k.when < absl::Seconds(1)) {
      ++k.count;
      return;
    }
    if (!TakeLine(s, now)) {
      ++s.held_back;
      return;
    }
    suppressed = k.count;
    held = s.held_back;
    s.held_back = 0;
    k.when = now;
    k.count = 0;
    k.level = level;
    k.line = line.substr(0, kMaxKeptLine);
  }
  spdlog::log(level, "{}{}{}", line,
              suppressed > 0 ? absl::StrCat(" (and ", suppressed, " more like it)") : "",
              held > 0
                  ? absl::StrCat(" (", held, " throttled lines of all kinds held back before it)")
                  : "");
}

void FlushThrottledLog() {
  State& s = TheState();
  const absl::Time now = absl::Now();
  std::vector<std::pair<spdlog::level::level_enum, std::string>> lines;
  {
    absl::MutexLock lock(&s.mu);
    // The cap's count first: the second it counts is over (a line for a kind starts another).
    if (s.held_back > 0 && now - s.second_start >= absl::Seconds(1) && TakeLine(s, now)) {
      lines.emplace_back(spdlog::level::info,
                         absl::StrCat(s.held_back, " throttled lines of all kinds held back"));
      s.held_back = 0;
    }
    for (auto& [name, k] : s.kinds) {
      if (k.count == 0 || now - k.when < absl::Seconds(1)) continue;
      if (!TakeLine(s, now)) break;  // the rest at a later flush
      lines.emplace_back(
          k.level,
          absl::StrCat(k.count, " more held back in the last ",
                       absl::FormatDuration(absl::Trunc(now - k.when, absl::Milliseconds(100))),
                       " like it: ", k.line));
      k.when = now;
      k.count = 0;
    }
  }
  for (const auto& [level, text] : lines) spdlog::log(level, "{}", text);
}

}  // namespace pagedattn
