#include "server/process/transport_security.h"

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace normgrad::server {
namespace {

constexpr absl::string_view kHealthPathPrefix = "/grpc.health.v1.Health/";

// OK when `cert_pem`'s first certificate holds the public half of `key_pem`. Checked at start
// so that a mismatched pair is one clear line, not a port that fails every handshake.
absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem,
                                        const TransportSecurityOptions& o) {
  BIO* cert_bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
  BIO_free(cert_bio);
  BIO* key_bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio, nullptr, nullptr, nullptr);
  BIO_free(key_bio);
  absl::Status status;
  if (cert == nullptr) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls-cert=", o.cert_file, ": no readable PEM certificate"));
  } else if (key == nullptr) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls-key=", o.key_file,
                     ": no readable PEM private key (encrypted keys are not supported)"));
  } else if (X509_check_private_key(cert, key) != 1) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls-key=", o.key_file, " is not the key of --tls-cert=", o.cert_file));
  }
  X509_free(cert);
  EVP_PKEY_free(key);
  return status;
}

}  // namespace

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": cannot read it"));
  }
  std::stringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": not a PEM file (no -----BEGIN line)"));
  }
  return text;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-token-file=", path, ": cannot read it"));
  }
  std::stringstream s;
  s << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(s.str()));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-token-file=", path, ": it is empty"));
  }
  for (char c : token) {
    // A metadata value is printable ASCII; a token that is not could never be presented.
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth-token-file=", path,
          ": the token must be one line of printable ASCII (found a control or non-ASCII byte)"));
    }
  }
  return token;
}

bool BearerMatches(absl::string_view presented, absl::string_view token) {
  const std::string expected = absl::StrCat("Bearer ", token);
  unsigned char want[SHA256_DIGEST_LENGTH];
  unsigned char got[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(expected.data()), expected.size(), want);
  SHA256(reinterpret_cast<const unsigned char*>(presented.data()), presented.size(), got);
  return CRYPTO_memcmp(want, got, SHA256_DIGEST_LENGTH) == 0;
}

grpc::Status BearerTokenProcessor::Process(const InputMetadata& auth_metadata,
                                           grpc::AuthContext* /*context*/,
                                           OutputMetadata* consumed_auth_metadata,
                                           OutputMetadata* /*response_metadata*/) {
  auto path = auth_metadata.find(":path");
  if (path != auth_metadata.end() &&
      absl::StartsWith(absl::string_view(path->second.data(), path->second.size()),
                       kHealthPathPrefix)) {
    return grpc::Status::OK;  // probes and load balancers check health without a token
  }
  auto it = auth_metadata.find("authorization");
  if (it == auth_metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing bearer token: this server requires the metadata "
                        "\"authorization: Bearer <token>\"");
  }
  const absl::string_view presented(it->second.data(), it->second.size());
  if (!BearerMatches(presented, token_)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "wrong bearer token in the \"authorization\" metadata");
  }
  consumed_auth_metadata->insert(
      std::make_pair(std::string(it->first.data(), it->first.size()), std::string(presented)));
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TransportSecurityOptions& options) {
  const bool tls = !options.cert_file.empty() || !options.key_file.empty();
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!tls && !options.client_ca_file.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  }
  if (!tls && !options.token_file.empty()) {
    return absl::InvalidArgumentError(
        "--auth-token-file needs --tls-cert and --tls-key: a bearer token sent over plaintext "
        "can be read by anyone on the path");
  }
  if (!tls) return grpc::InsecureServerCredentials();

  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  NORMGRAD_ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(options.cert_file, "tls-cert"));
  NORMGRAD_ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(options.key_file, "tls-key"));
  NORMGRAD_RETURN_IF_ERROR(CheckKeyMatchesCertificate(pair.cert_chain, pair.private_key, options));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!options.client_ca_file.empty()) {
    NORMGRAD_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                              ReadPemFile(options.client_ca_file, "tls-client-ca"));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(ssl);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert=", options.cert_file,
                                                   " / --tls-key=", options.key_file,
                                                   ": gRPC refused the certificate and key"));
  }
  if (!options.token_file.empty()) {
    NORMGRAD_ASSIGN_OR_RETURN(std::string token, ReadTokenFile(options.token_file));
    creds->SetAuthMetadataProcessor(std::make_shared<BearerTokenProcessor>(std::move(token)));
  }
  return creds;
}

}  // namespace normgrad::server
