// Conversions between the normgrad.v1 messages and the server's own types, each in one place:
// DType, kernel names (with the one wording for an unknown or missing kernel), module-cache
// statistics, device descriptions and GetServerInfo's answer. Messages only, no gRPC.
//
//   NORMGRAD_ASSIGN_OR_RETURN(kernels::DType dtype, DTypeFromProto(h.dtype(), "header.dtype"));
//   NORMGRAD_ASSIGN_OR_RETURN(const kernels::BackwardKernel* kernel, KernelNamed(name, "kernel"));
//   ToProto(backend.CacheStats(), response.mutable_cache());
//   ToProto(info, &response);  // ServerInfo, gathered by the service
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/backward_kernel.h"
#include "kernels/kernel_config.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/backend/backend.h"
#include "server/cache/module_cache.h"

namespace normgrad::server {

// DTYPE_UNSPECIFIED is f32. INVALID_ARGUMENT naming `field` and listing the known values for
// anything else.
absl::StatusOr<kernels::DType> DTypeFromProto(v1::DType dtype, absl::string_view field);

// The header's gamma_offset, no_gamma and casting_mode. INVALID_ARGUMENT naming the field: an
// offset that is not finite, or not 0 with no_gamma; a casting mode this server does not know.
absl::StatusOr<kernels::NormVariant> VariantFromHeader(const v1::BackwardHeader& header);
// The same fields of an EmitPtx request (errors name them without a prefix).
absl::StatusOr<kernels::NormVariant> VariantFromEmitPtxRequest(const v1::EmitPtxRequest& request);

// Every kernel's entry name, in the registry's order.
std::vector<std::string> KernelNames();

// The kernel whose entry name is `name`. INVALID_ARGUMENT naming `field` and listing the known
// names when `name` is empty or unknown.
absl::StatusOr<const kernels::BackwardKernel*> KernelNamed(absl::string_view name, absl::string_view field);

void ToProto(const ModuleCacheStats& stats, v1::CacheStats* out);
void ToProto(const DeviceDescription& device, v1::DeviceInfo* out);

// What GetServerInfo reports, in the server's own units; the service gathers it from its
// configuration and collaborators, ToProto below is its one conversion to the message.
struct ServerInfo {
  std::string version;
  std::string backend;  // Backend::Name()
  DeviceDescription device;
  struct Limits {
    uint32_t max_streams = 0;
    uint64_t max_inflight_bytes = 0;
    uint32_t max_streams_per_client = 0;
    uint32_t max_hidden_dim = 0;
    uint64_t max_num_rows = 0;
    uint64_t max_message_bytes = 0;
    absl::Duration stream_idle_timeout;
  } limits;
  ModuleCacheStats cache;      // the backend's modules
  ModuleCacheStats ptx_cache;  // EmitPtx's results
  bool nvjitlink_available = false;
  struct SharedMemory {  // --shared-memory's bounds
    uint32_t max_regions = 0;
    uint64_t max_region_bytes = 0;
    uint32_t max_regions_per_user = 0;
    uint64_t max_region_bytes_per_user = 0;
  };
  std::optional<SharedMemory> shared_memory;  // absent: not taken
  struct CudaIpc {
    std::string device_uuid;  // 16 bytes
    uint32_t max_open_handles = 0;
  };
  std::optional<CudaIpc> cuda_ipc;  // absent: not taken
  std::vector<std::string> kernels;
  bool serving = false;
  std::string health_reason;  // empty while the device may serve
};
void ToProto(const ServerInfo& info, v1::GetServerInfoResponse* out);

}  // namespace normgrad::server
