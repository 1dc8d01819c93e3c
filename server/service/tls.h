// TLS material checked before the server starts: each file readable, parsed as PEM, the key
// matching the certificate, the certificate in its validity period, no placeholder text.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pagedattn {

struct TlsFiles {
  std::string cert_file;       // --tls_cert
  std::string key_file;        // --tls_key
  std::string client_ca_file;  // --tls_client_ca (may be empty)
};

struct TlsMaterial {
  std::string cert_pem;
  std::string key_pem;
  std::string client_ca_pem;  // Empty without --tls_client_ca.
  // When the server's certificate expires: it is read only at start, so handshakes fail from
  // then on until a restart with a renewed one.
  absl::Time cert_not_after = absl::InfiniteFuture();
};

// A certificate's date as the server's messages print it ("2027-01-05 12:00:00 UTC").
std::string TlsTimeText(absl::Time t);

// The files' contents when every check passes; otherwise INVALID_ARGUMENT (or NOT_FOUND for
// an unreadable file) naming the flag, the file and what is wrong with it.
absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files);

}  // namespace pagedattn
