// EscapeControl and ForLog: a request's text escaped and cut before it goes into a log line,
// so that a client's value cannot forge a line or a field of one.
#include "server/service/log_text.h"

#include "absl/strings/str_cat.h"

namespace pagedattn {

std::string EscapeControl(absl::string_view s, LogText kind) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    const bool quoting = c == '\\' || c == '\'' || (kind == LogText::kField && c == '"');
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (u < 0x20 || u == 0x7f || (kind != LogText::kFree && quoting) ||
               (kind == LogText::kField && (u == 0x20 || u > 0x7f))) {
      absl::StrAppend(&out, "\\x", absl::Hex(u, absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out;
}

std::string ForLog(absl::string_view s, LogText kind) {
  constexpr size_t kShown = 64;
  std::string out = EscapeControl(s.substr(0, kShown), kind);
  if (s.size() > kShown) absl::StrAppend(&out, "...(", s.size(), " bytes)");
  return out;
}

}  // namespace pagedattn
