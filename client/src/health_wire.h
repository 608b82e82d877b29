// grpc.health.v1.Health/Check from the client: its path, and its two messages through the code
// generated from proto/normgrad/v1/health_check.proto (the same fields in a package of ours, so
// that this library registers no grpc.health.v1 descriptors that could collide with an
// application's).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::client_internal {

inline constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";

std::string EncodeHealthCheckRequest(absl::string_view service);

// The status field (0 when absent); INTERNAL for bytes that are not a valid message. Unknown
// fields are skipped as the protobuf wire format requires.
absl::StatusOr<int> DecodeHealthCheckResponse(absl::string_view bytes);

}  // namespace normgrad::client_internal
