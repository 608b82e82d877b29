// The one conversion from grpc::Status to absl::Status (codes share their numbers), at the
// client's edge. The server's edge converts the other way (server/service/status_conversion.h);
// they stay two files because client/ depends on no server code.
//
//   if (!status.ok()) return FromGrpcStatus(status);
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace normgrad::client_internal {

// Same code, same message; OK stays OK.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace normgrad::client_internal
