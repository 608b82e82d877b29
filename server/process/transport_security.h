// Transport security of normgrad-server: the gRPC server credentials (plaintext, TLS or mutual
// TLS, from PEM files) and bearer-token authentication of every call except the health service.
//
//   TransportSecurityOptions o;
//   o.cert_file = "tls.crt"; o.key_file = "tls.key"; o.client_ca_file = "ca.crt";
//   o.token_file = "token";
//   absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeServerCredentials(o);
//   builder.AddListeningPort(address, *creds);
//
// The token is compared in constant time (SHA-256 of both sides, CRYPTO_memcmp of the digests:
// the time depends on neither the content nor the length of what the client sent). Messages
// never contain the token or what the client presented.
#pragma once

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::server {

struct TransportSecurityOptions {
  std::string cert_file;       // PEM server certificate chain; empty: plaintext
  std::string key_file;        // PEM private key of cert_file
  std::string client_ca_file;  // PEM CA bundle; set: clients must present a certificate it signed
  std::string token_file;      // bearer token (file contents, whitespace trimmed); empty: none
};

// Reads a PEM file given as --`flag`: its contents. INVALID_ARGUMENT naming the flag and the
// path when unreadable or without a "-----BEGIN " line.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view flag);

// Reads a token file: its contents with leading/trailing whitespace removed. INVALID_ARGUMENT
// naming the flag and the path (never the contents) when unreadable, empty or not one line of
// printable ASCII.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Constant-time equality of a presented "authorization" value with "Bearer <token>".
bool BearerMatches(absl::string_view presented, absl::string_view token);

// Checks "authorization: Bearer <token>" on every call whose :path is not the health service's
// (/grpc.health.v1.Health/...). A missing or wrong token fails the call with UNAUTHENTICATED.
// The authorization entry is consumed: the service's handlers never see it.
class BearerTokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit BearerTokenProcessor(std::string token) : token_(std::move(token)) {}
  bool IsBlocking() const override { return false; }  // cheap; runs on the transport thread
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::string token_;
};

// Credentials for the main gRPC port. Validation (INVALID_ARGUMENT naming the flag):
// --tls-cert and --tls-key go together; --tls-client-ca and --auth-token-file need TLS (a
// bearer token over plaintext can be read off the wire, and gRPC runs authentication
// processors on secure ports only); every file must be readable and non-empty.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TransportSecurityOptions& options);

}  // namespace normgrad::server
