// The request's text as it goes into a log line: escaped, so that a value cannot forge a line
// or fields of one, and cut.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace pagedattn {

// The metadata key whose value a call's log lines carry as req= (Rpc::Caller; a TLS call
// refused at its headers, TokenAuthProcessor).
inline constexpr char kRequestIdKey[] = "x-request-id";

// How much of a request's text a log line escapes (each as \xNN, beyond the controls \n, \r, \t
// and \xNN that every kind escapes: one line of a log that greps for what the caller was told;
// CHexEscape's \' did not match the client's message).
enum class LogText {
  kFree,    // free text after the fields (an error message): nothing else
  kQuoted,  // a value between single quotes (a cache's name): the quote and the backslash
  kField,   // one field of the line (a cache id, a request id): spaces, backslashes, quotes and
            // bytes past ASCII, so that it cannot end the field and write others
            // ("x tenant=acme") nor carry terminal controls past ASCII
};

// s escaped as `kind` says, whole.
std::string EscapeControl(absl::string_view s, LogText kind = LogText::kFree);

// s escaped as `kind` says and cut to 64 bytes ("...(N bytes)" after).
std::string ForLog(absl::string_view s, LogText kind = LogText::kFree);

}  // namespace pagedattn
