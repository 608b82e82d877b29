// The one conversion from grpc::Status to absl::Status (codes share their numbers), at the
// client's edge. The server's edge converts the other way (server/service/status_conversion.h);
// they stay two files because client/ depends on no server code.
//
//   if (!status.ok()) return FromGrpcStatus(status);
#ifndef NORMGRAD_CLIENT_SRC_GRPC_STATUS_H_
#define NORMGRAD_CLIENT_SRC_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace normgrad::client_internal {

// Same code, same message; OK stays OK.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace normgrad::client_internal

#endif  // NORMGRAD_CLIENT_SRC_GRPC_STATUS_H_
