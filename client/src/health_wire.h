// grpc.health.v1 messages encoded by hand (two fields), so that this library registers no
// grpc.health.v1 descriptors that could collide with a server's in the same process.
//   HealthCheckRequest  { string service = 1; }
//   HealthCheckResponse { ServingStatus status = 1; }
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
