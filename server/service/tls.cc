// LoadTlsMaterial: OpenSSL parses and checks what gRPC would otherwise reject later with a
// message that names neither the file nor the problem.
#include "server/service/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/service/flag_file.h"

namespace pagedattn {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::string OpenSslError() {
  const unsigned long err = ERR_get_error();
  ERR_clear_error();
  if (err == 0) return "no PEM block of the expected kind";
  char buf[256];
  ERR_error_string_n(err, buf, sizeof(buf));
  return buf;
}

absl::StatusOr<std::string> ReadFile(const char* flag, const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFlagFile(flag, path);
  if (!contents.ok()) return contents.status();
  std::string pem = *std::move(contents);
  // The manifests' and examples' placeholders: a server must not start on them.
  for (const char* placeholder : {"REPLACE", "CHANGEME", "PLACEHOLDER"}) {
    if (absl::StrContains(absl::AsciiStrToUpper(pem), placeholder)) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, " ", path, ": holds placeholder text ('", placeholder,
          "'), not real PEM material; put the real certificate and key in the secret"));
    }
  }
  return pem;
}

std::unique_ptr<BIO, BioFree> Bio(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

absl::StatusOr<std::unique_ptr<X509, X509Free>> ParseCert(const char* flag, const std::string& path,
                                                          const std::string& pem) {
  auto bio = Bio(pem);
  std::unique_ptr<X509, X509Free> cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": not a PEM certificate (", OpenSslError(), ")"));
  }
  return cert;
}

// A certificate's notBefore or notAfter (InfinitePast where OpenSSL cannot read it).
absl::Time TimeOf(const ASN1_TIME* t) {
  std::tm tm{};
  if (t == nullptr || ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTimeT(timegm(&tm));
}

// " (valid from A until B; this host's clock says C)": a certificate refused for its dates is
// either stale or the node's clock is wrong, and the message must tell which.
std::string ValidityText(const X509* cert) {
  return absl::StrCat(" (valid from ", TlsTimeText(TimeOf(X509_get0_notBefore(cert))), " until ",
                      TlsTimeText(TimeOf(X509_get0_notAfter(cert))), "; this host's clock says ",
                      TlsTimeText(absl::Now()), ")");
}

}  // namespace

std::string TlsTimeText(absl::Time t) {
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", t, absl::UTCTimeZone());
}

absl::StatusOr<TlsMaterial> LoadTlsMaterial(const TlsFiles& files) {
  TlsMaterial m;
  absl::StatusOr<std::string> cert_pem = ReadFile("--tls_cert", files.cert_file);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFile("--tls_key", files.key_file);
  if (!key_pem.ok()) return key_pem.status();
  m.cert_pem = *std::move(cert_pem);
  m.key_pem = *std::move(key_pem);

  absl::StatusOr<std::unique_ptr<X509, X509Free>> cert =
      ParseCert("--tls_cert", files.cert_file, m.cert_pem);
  if (!cert.ok()) return cert.status();
  if (X509_cmp_current_time(X509_get0_notAfter(cert->get())) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_cert ", files.cert_file,
                                                   ": the certificate has expired",
                                                   ValidityText(cert->get())));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert->get())) > 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_cert ", files.cert_file,
                                                   ": the certificate is not valid yet",
                                                   ValidityText(cert->get())));
  }
  m.cert_not_after = TimeOf(X509_get0_notAfter(cert->get()));
  auto key_bio = Bio(m.key_pem);
  // An encrypted key is refused, never asked for: OpenSSL's default callback would prompt for a
  // pass phrase on the terminal and block startup where one is attached (docker run -it).
  pem_password_cb* no_pass_phrase = [](char*, int, int, void*) { return -1; };
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_pass_phrase, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_key ", files.key_file,
                                                   ": not an unencrypted PEM private key (",
                                                   OpenSslError(), ")"));
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key ", files.key_file, ": does not match the certificate in ", files.cert_file));
  }
  if (!files.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca_pem = ReadFile("--tls_client_ca", files.client_ca_file);
    if (!ca_pem.ok()) return ca_pem.status();
    m.client_ca_pem = *std::move(ca_pem);
    absl::StatusOr<std::unique_ptr<X509, X509Free>> ca =
        ParseCert("--tls_client_ca", files.client_ca_file, m.client_ca_pem);
    if (!ca.ok()) return ca.status();
    // A bundle may hold an expired CA beside its successor; with none valid now, no client
    // certificate verifies and every client would fail its handshake.
    int certs = 0, valid = 0;
    auto bio = Bio(m.client_ca_pem);
    while (true) {
      std::unique_ptr<X509, X509Free> c(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
      if (c == nullptr) break;
      ++certs;
      if (X509_cmp_current_time(X509_get0_notAfter(c.get())) >= 0 &&
          X509_cmp_current_time(X509_get0_notBefore(c.get())) <= 0) {
        ++valid;
      }
    }
    ERR_clear_error();  // the loop's end: no more certificates
    if (valid == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca ", files.client_ca_file, ": ",
                       certs == 1 ? "the certificate has"
                                  : absl::StrCat("each of its ", certs, " certificates has"),
                       " expired or is not valid yet: no client certificate would verify"));
    }
  }
  return m;
}

}  // namespace pagedattn
