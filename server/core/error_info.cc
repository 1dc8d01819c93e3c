// WithErrorInfo / ErrorInfoOf: the payload's text form.
#include "server/core/error_info.h"

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pagedattn {

absl::Status WithErrorInfo(absl::Status status, const ErrorInfo& info) {
  std::string text = info.reason + "\n";
  for (const auto& [key, value] : info.fields) absl::StrAppend(&text, key, "=", value, "\n");
  status.SetPayload(kErrorInfoPayload, absl::Cord(text));
  return status;
}

ErrorInfo ErrorInfoOf(const absl::Status& status) {
  ErrorInfo info;
  auto payload = status.GetPayload(kErrorInfoPayload);
  if (!payload.has_value()) return info;
  std::vector<std::string> lines = absl::StrSplit(std::string(*payload), '\n', absl::SkipEmpty());
  if (lines.empty()) return info;
  info.reason = lines[0];
  for (size_t i = 1; i < lines.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(lines[i], absl::MaxSplits('=', 1));
    int64_t v = 0;
    if (absl::SimpleAtoi(kv.second, &v)) info.fields.emplace_back(kv.first, v);
  }
  return info;
}

}  // namespace pagedattn
