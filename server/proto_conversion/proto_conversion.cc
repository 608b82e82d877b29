#include "server/proto_conversion/proto_conversion.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bounded_quote.h"
#include "kernels/rmsnorm/kernel_registry.h"

namespace normgrad::server {
namespace {

std::string KnownKernelNames() {
  const std::vector<std::string> names = KernelNames();
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

// gamma_offset, no_gamma and casting_mode of a message; `prefix` names their message in errors
// ("header." or "").
absl::StatusOr<kernels::NormVariant> VariantFromFields(float gamma_offset, bool no_gamma,
                                                       v1::CastingMode casting,
                                                       absl::string_view prefix) {
  kernels::NormVariant variant;
  if (!std::isfinite(gamma_offset)) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "gamma_offset is ", gamma_offset, "; must be finite"));
  }
  if (no_gamma && gamma_offset != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "gamma_offset is ", gamma_offset,
                                                   " with ", prefix,
                                                   "no_gamma; an offset scales gamma, so it must "
                                                   "be 0"));
  }
  variant.gamma_offset = kernels::NormVariant::CanonicalOffset(gamma_offset);
  variant.has_gamma = !no_gamma;
  switch (casting) {
    case v1::CASTING_MODE_UNSPECIFIED:
    case v1::CASTING_MODE_GEMMA:
      variant.casting = kernels::CastingMode::kGemma;
      break;
    case v1::CASTING_MODE_LLAMA:
      variant.casting = kernels::CastingMode::kLlama;
      break;
    case v1::CASTING_MODE_NONE:
      variant.casting = kernels::CastingMode::kNone;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "casting_mode is ", static_cast<int>(casting),
                       "; must be one of 0 (unspecified: gemma), 1 (llama), 2 (gemma), 3 (none)"));
  }
  return variant;
}

}  // namespace

absl::StatusOr<kernels::NormVariant> VariantFromHeader(const v1::BackwardHeader& header) {
  return VariantFromFields(header.gamma_offset(), header.no_gamma(), header.casting_mode(),
                           "header.");
}

absl::StatusOr<kernels::NormVariant> VariantFromEmitPtxRequest(const v1::EmitPtxRequest& request) {
  return VariantFromFields(request.gamma_offset(), request.no_gamma(), request.casting_mode(), "");
}

absl::StatusOr<kernels::DType> DTypeFromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_F32:
      return kernels::DType::kF32;
    case v1::DTYPE_BF16:
      return kernels::DType::kBF16;
    case v1::DTYPE_F16:
      return kernels::DType::kF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is ", static_cast<int>(dtype),
                       ", not a known DType (DTYPE_UNSPECIFIED = 0, DTYPE_F32 = 1, DTYPE_BF16 = 2, "
                       "DTYPE_F16 = 3)"));
  }
}

std::vector<std::string> KernelNames() {
  std::vector<std::string> names;
  for (const kernels::BackwardKernel* k : kernels::AllKernels()) names.emplace_back(k->EntryName());
  return names;
}

absl::StatusOr<const kernels::BackwardKernel*> KernelNamed(absl::string_view name,
                                                   absl::string_view field) {
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is empty; known: ", KnownKernelNames()));
  }
  const kernels::BackwardKernel* kernel = kernels::FindKernel(name);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", base::BoundedQuote(name),
                                                   " is unknown; known: ", KnownKernelNames()));
  }
  return kernel;
}

void ToProto(const ModuleCacheStats& stats, v1::CacheStats* out) {
  out->set_hits(stats.hits);
  out->set_misses(stats.misses);
  out->set_evictions(stats.evictions);
  out->set_compiles(stats.compiles);
  out->set_compile_failures(stats.compile_failures);
  out->set_entries(stats.entries);
  out->set_bytes(stats.bytes);
  out->set_compile_seconds(stats.compile_seconds);
  out->set_max_entries(stats.max_entries);
  out->set_max_bytes(stats.max_bytes);
}

void ToProto(const DeviceDescription& device, v1::DeviceInfo* out) {
  out->set_name(device.name);
  out->set_compute_capability_major(device.compute_capability_major);
  out->set_compute_capability_minor(device.compute_capability_minor);
  out->set_total_memory_bytes(device.total_memory_bytes);
  out->set_driver_version(device.driver_version);
  out->set_max_ptx_version(device.max_ptx_version);
  out->set_sm_count(device.sm_count);
}

void ToProto(const ServerInfo& info, v1::GetServerInfoResponse* out) {
  out->set_version(info.version);
  out->set_backend(info.backend);
  ToProto(info.device, out->mutable_device());
  v1::Limits* limits = out->mutable_limits();
  limits->set_max_concurrent_streams(info.limits.max_streams);
  limits->set_max_inflight_bytes(info.limits.max_inflight_bytes);
  limits->set_max_hidden_dim(info.limits.max_hidden_dim);
  limits->set_max_num_rows(info.limits.max_num_rows);
  limits->set_max_message_bytes(info.limits.max_message_bytes);
  limits->set_stream_idle_timeout_seconds(absl::ToDoubleSeconds(info.limits.stream_idle_timeout));
  limits->set_max_streams_per_client(info.limits.max_streams_per_client);
  ToProto(info.cache, out->mutable_cache());
  ToProto(info.ptx_cache, out->mutable_ptx_cache());
  out->set_nvjitlink_available(info.nvjitlink_available);
  if (info.shared_memory.has_value()) {
    v1::SharedMemoryInfo* shm = out->mutable_shared_memory();
    shm->set_enabled(true);
    shm->set_max_regions(info.shared_memory->max_regions);
    shm->set_max_region_bytes(info.shared_memory->max_region_bytes);
    shm->set_max_regions_per_user(info.shared_memory->max_regions_per_user);
    shm->set_max_region_bytes_per_user(info.shared_memory->max_region_bytes_per_user);
  }
  if (info.cuda_ipc.has_value()) {
    v1::CudaIpcInfo* ipc = out->mutable_cuda_ipc();
    ipc->set_enabled(true);
    ipc->set_device_uuid(info.cuda_ipc->device_uuid);
    ipc->set_max_open_handles(info.cuda_ipc->max_open_handles);
  }
  for (const std::string& name : info.kernels) out->add_kernels(name);
  out->mutable_health()->set_serving(info.serving);
  out->mutable_health()->set_reason(info.health_reason);
}

}  // namespace normgrad::server
