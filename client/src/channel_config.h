// How a ClientOptions::target becomes a gRPC target URI and a service config.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "normgrad/client.h"

namespace normgrad::client_internal {

struct ResolvedTarget {
  std::string uri;           // what grpc::CreateCustomChannel gets
  bool round_robin = false;  // a list or a dns: name: balance over every address
};

// "host:port" stays as is; "a:1,b:2" (IP literals or localhost) becomes "ipv4:a:1,b:2" (or
// "ipv6:[..]:1,..."), round-robin; a URI with a scheme ("dns:", "ipv4:", "ipv6:", "unix:") is
// kept, and dns:/ipv4:/ipv6: ones are balanced round-robin. INVALID_ARGUMENT for an empty
// target, an empty list element, a missing port or a list mixing IPv4 and IPv6.
absl::StatusOr<ResolvedTarget> ResolveTarget(absl::string_view target);

// True when every address `target` names is on this host: a unix: or unix-abstract: socket,
// "localhost", 127.0.0.0/8 or ::1 (also inside an ipv4:, ipv6: or dns: URI or a list). Names
// other than "localhost" are not resolved: false.
bool IsLoopbackOrUnixTarget(absl::string_view target);

// The service config JSON: round-robin for an address list, else gRPC's default (pick-first).
// It carries no retryPolicy: retries are the client's own (client.cc).
std::string ServiceConfigJson(const ResolvedTarget& target);

}  // namespace normgrad::client_internal
