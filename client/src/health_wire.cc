#include "client/src/health_wire.h"

#include "absl/status/status.h"
#include "normgrad/v1/health_check.pb.h"

namespace normgrad::client_internal {

std::string EncodeHealthCheckRequest(absl::string_view service) {
  v1::health::HealthCheckRequest request;
  request.set_service(std::string(service));
  return request.SerializeAsString();
}

absl::StatusOr<int> DecodeHealthCheckResponse(absl::string_view bytes) {
  v1::health::HealthCheckResponse response;
  if (!response.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InternalError("health reply: not a grpc.health.v1.HealthCheckResponse");
  }
  return static_cast<int>(response.status());
}

}  // namespace normgrad::client_internal
