// LogThrottled: a log line at most once a second for each kind of line, with the count of
// those held back, so that a client repeating a mistake (or a library repeating a complaint)
// cannot flood the log.
#pragma once

#include <string>

#include "spdlog/spdlog.h"

namespace pagedattn {

// At most this many throttled lines a second, of all kinds together.
inline constexpr int kMaxThrottledLinesPerSecond = 20;

// Logs "<line> (and N more like it)" at `level` unless a line of the same `kind` went out
// within the last second (then it only counts it), or kMaxThrottledLinesPerSecond lines of any
// kind did (then it is counted, and the next line that goes out says how many were held back).
void LogThrottled(spdlog::level::level_enum level, const std::string& kind,
                  const std::string& line);

// Counts held back that no later line of their kind has told, a second or more after their
// kind's last line: "N more held back in the last 1.2s like it: <that line>" (and the lines of
// all kinds held back past the cap). Called periodically (the server's main), so that a burst
// that ends is counted in the log, not only in the metrics.
void FlushThrottledLog();

}  // namespace pagedattn
