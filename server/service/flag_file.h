// ReadFlagFile: the whole file a server flag names, or an error that names the flag, the path and
// why (a directory, or the OS's reason it cannot be read). Shared by the TLS and tokens files.
#pragma once

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace pagedattn {

inline absl::StatusOr<std::string> ReadFlagFile(const char* flag, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": is a directory"));
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    return absl::NotFoundError(absl::StrCat(
        flag, " ", path, ": cannot read the file",
        err != 0 ? absl::StrCat(" (", std::strerror(err), ")") : std::string()));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace pagedattn
