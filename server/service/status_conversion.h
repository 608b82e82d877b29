// The one place where absl::Status becomes grpc::Status. Both use the same canonical codes, so
// the code and the message cross the RPC boundary unchanged.
//
//   return reactor->Finish(ToGrpcStatus(status));
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace normgrad::server {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace normgrad::server
