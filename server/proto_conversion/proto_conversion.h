// Conversions between the normgrad.v1 messages and the server's own types, each in one place:
// DType, kernel names (with the one wording for an unknown or missing kernel), module-cache
// statistics and device descriptions. Messages only, no gRPC.
//
//   NORMGRAD_ASSIGN_OR_RETURN(kernels::DType dtype, DTypeFromProto(h.dtype(), "header.dtype"));
//   NORMGRAD_ASSIGN_OR_RETURN(const kernels::Kernel* kernel, KernelNamed(name, "kernel"));
//   ToProto(backend.CacheStats(), response.mutable_cache());
#ifndef NORMGRAD_SERVER_PROTO_CONVERSION_PROTO_CONVERSION_H_
#define NORMGRAD_SERVER_PROTO_CONVERSION_PROTO_CONVERSION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/kernel.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/backend/backend.h"
#include "server/cache/module_cache.h"

namespace normgrad::server {

// DTYPE_UNSPECIFIED is f32. INVALID_ARGUMENT naming `field` and listing the known values for
// anything else.
absl::StatusOr<kernels::DType> DTypeFromProto(v1::DType dtype, absl::string_view field);

// Every kernel's entry name, in the registry's order.
std::vector<std::string> KernelNames();

// The kernel whose entry name is `name`. INVALID_ARGUMENT naming `field` and listing the known
// names when `name` is empty or unknown.
absl::StatusOr<const kernels::Kernel*> KernelNamed(absl::string_view name, absl::string_view field);

void ToProto(const ModuleCacheStats& stats, v1::CacheStats* out);
void ToProto(const DeviceDescription& device, v1::DeviceInfo* out);

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_PROTO_CONVERSION_PROTO_CONVERSION_H_
