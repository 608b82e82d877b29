#include "server/ptx/ptx_service.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bounded_quote.h"
#include "base/sha256.h"
#include "base/status_macros.h"
#include "kernels/backward_kernel.h"
#include "kernels/kernel_config.h"
#include "kernels/ptx/targets.h"
#include "proto/normgrad/v1/emit_ptx_fields.h"
#include "server/proto_conversion/proto_conversion.h"

namespace normgrad::server {

namespace {

using Cache = ModuleCache<v1::EmitPtxArtifact>;

// The same status with `prefix` before its message (a batch's item named in front).
absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

v1::DType DTypeToProto(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kF32:
      return v1::DTYPE_F32;
    case kernels::DType::kBF16:
      return v1::DTYPE_BF16;
    case kernels::DType::kF16:
      return v1::DTYPE_F16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

void ToProto(const AssemblerReport& report, v1::ResourceUsage* out) {
  out->set_registers(report.registers);
  out->set_spill_store_bytes(report.spill_store_bytes);
  out->set_spill_load_bytes(report.spill_load_bytes);
  out->set_shared_memory_bytes(report.shared_memory_bytes);
  out->set_local_memory_bytes(report.stack_frame_bytes);
  out->set_barriers(report.barriers);
  out->set_constant_memory_bytes(report.constant_memory_bytes);
}

}  // namespace

// One (target, dtype) of a request, checked, with what its errors call it.
struct PtxService::Configuration {
  const kernels::BackwardKernel* kernel = nullptr;
  kernels::KernelConfig config;
  std::string name;  // "" for a single-configuration request, else "configuration 3 (sm_90, bf16)"
};

PtxService::PtxService(const PtxServiceOptions& options)
    : cache_(options.cache), nvjitlink_(NvJitLink::Load(options.nvjitlink_path)) {}

absl::StatusOr<v1::EmitPtxResponse> PtxService::Emit(const v1::EmitPtxRequest& request) {
  NORMGRAD_ASSIGN_OR_RETURN(const kernels::BackwardKernel* kernel, KernelNamed(request.kernel(), "kernel"));
  const bool batch = request.targets_size() > 0 || request.dtypes_size() > 0;
  if (!request.target().empty() && request.targets_size() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("target ", base::BoundedQuote(request.target()), " and targets (",
                     request.targets_size(), " items) are both set; set one of them"));
  }
  if (request.dtype() != v1::DTYPE_UNSPECIFIED && request.dtypes_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat("dtype (", static_cast<int>(request.dtype()),
                                                   ") and dtypes (", request.dtypes_size(),
                                                   " items) are both set; set one of them"));
  }
  const uint64_t num_targets = std::max(1, request.targets_size());
  const uint64_t num_dtypes = std::max(1, request.dtypes_size());
  if (num_targets * num_dtypes > kMaxEmitPtxConfigurations) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "targets (", num_targets, ") x dtypes (", num_dtypes, ") = ", num_targets * num_dtypes,
        " configurations; at most ", kMaxEmitPtxConfigurations, " per EmitPtx request"));
  }

  // Targets and dtypes in request order; the parsers' errors name the field and quote the text
  // (bounded: base/bounded_quote.h).
  std::vector<int> targets;
  if (request.targets_size() == 0) {
    kernels::KernelConfig defaults;
    targets.push_back(defaults.target_sm);
    if (!request.target().empty()) {
      NORMGRAD_ASSIGN_OR_RETURN(targets[0], kernels::ParseTarget(request.target()));
    }
  }
  for (int i = 0; i < request.targets_size(); ++i) {
    const std::string field = absl::StrCat("targets[", i, "]");
    absl::StatusOr<int> sm = kernels::ParseTarget(request.targets(i));
    if (!sm.ok()) return Prefixed(sm.status(), absl::StrCat(field, ": "));
    for (int j = 0; j < i; ++j) {
      if (targets[j] == *sm) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, " ", base::BoundedQuote(request.targets(i)), " repeats targets[", j, "]"));
      }
    }
    targets.push_back(*sm);
  }
  std::vector<kernels::DType> dtypes;
  if (request.dtypes_size() == 0) {
    NORMGRAD_ASSIGN_OR_RETURN(kernels::DType d, DTypeFromProto(request.dtype(), "dtype"));
    dtypes.push_back(d);
  }
  for (int i = 0; i < request.dtypes_size(); ++i) {
    const std::string field = absl::StrCat("dtypes[", i, "]");
    NORMGRAD_ASSIGN_OR_RETURN(kernels::DType d, DTypeFromProto(request.dtypes(i), field));
    for (int j = 0; j < i; ++j) {
      if (dtypes[j] == d) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " (", kernels::DTypeName(d), ") repeats dtypes[", j, "]"));
      }
    }
    dtypes.push_back(d);
  }
  std::optional<kernels::PtxVersion> ptx_version;
  if (!request.ptx_version().empty()) {
    NORMGRAD_ASSIGN_OR_RETURN(ptx_version, kernels::ParsePtxVersion(request.ptx_version()));
  }

  NORMGRAD_ASSIGN_OR_RETURN(const kernels::NormVariant variant, VariantFromEmitPtxRequest(request));

  // Every configuration is checked before any is emitted: a batch is all or nothing.
  std::vector<Configuration> configurations;
  for (int t = 0; t < static_cast<int>(targets.size()); ++t) {
    for (int d = 0; d < static_cast<int>(dtypes.size()); ++d) {
      Configuration c;
      c.kernel = kernel;
      c.config.hidden_dim = request.hidden_dim();
      c.config.dtype = dtypes[d];
      c.config.target_sm = targets[t];
      c.config.ptx_version = ptx_version;
      c.config.variant = variant;
      if (batch) {
        c.name =
            absl::StrCat("configuration ", configurations.size(), " (targets[", t, "] sm_",
                         targets[t], ", dtypes[", d, "] ", kernels::DTypeName(dtypes[d]), "): ");
      }
      if (absl::Status s = kernel->CanImplement(c.config); !s.ok()) return Prefixed(s, c.name);
      configurations.push_back(std::move(c));
    }
  }
  if (request.cubin() && !nvjitlink_.ok()) return nvjitlink_.status();

  v1::EmitPtxResponse response;
  for (const Configuration& c : configurations) {
    absl::StatusOr<v1::EmitPtxArtifact> artifact =
        EmitOne(c, request.cubin(), request.resource_usage());
    if (!artifact.ok()) return Prefixed(artifact.status(), c.name);
    *response.add_artifacts() = *std::move(artifact);
  }
  if (!batch) {
    // The single-configuration fields, as before `artifacts` existed.
    v1::CopySingleConfigurationFields(response.artifacts(0), response);
  }
  return response;
}

absl::StatusOr<v1::EmitPtxArtifact> PtxService::EmitOne(const Configuration& c, bool cubin,
                                                        bool resource_usage) {
  const kernels::BackwardKernel* kernel = c.kernel;
  const kernels::KernelConfig& config = c.config;
  const std::string ptx_key = kernel->ConfigKey(config);
  auto emit_ptx = [&]() -> absl::StatusOr<Cache::Compiled> {
    NORMGRAD_ASSIGN_OR_RETURN(const kernels::EmittedPtx emitted, kernel->Emit(config));
    auto artifact = std::make_shared<v1::EmitPtxArtifact>();
    artifact->set_ptx(emitted.text);
    artifact->set_entry(emitted.entry);
    for (const kernels::KernelParam& p : emitted.params) {
      v1::KernelParameter* out = artifact->add_params();
      out->set_name(p.name);
      out->set_type(p.ptx_type);
    }
    artifact->mutable_digest()->set_sha256(base::Sha256Hex(emitted.text));
    artifact->mutable_digest()->set_size_bytes(emitted.text.size());
    artifact->set_ptx_version(emitted.version.ToString());
    artifact->set_target(absl::StrCat("sm_", emitted.target_sm));
    artifact->set_config_key(emitted.config_key);
    artifact->set_dtype(DTypeToProto(config.dtype));
    if (absl::StatusOr<std::string> driver = kernels::MinCudaDriverForPtx(emitted.version);
        driver.ok()) {
      artifact->set_min_cuda_driver(*driver);
    }
    const uint64_t bytes = artifact->ByteSizeLong();
    return Cache::Compiled{std::move(artifact), bytes};
  };
  NORMGRAD_ASSIGN_OR_RETURN(const std::shared_ptr<const v1::EmitPtxArtifact> ptx,
                            cache_.GetOrCompile(ptx_key, emit_ptx));
  if (!cubin && !resource_usage) return *ptx;
  if (!nvjitlink_.ok()) {  // resources asked, no cubin (checked by Emit)
    v1::EmitPtxArtifact out = *ptx;
    out.set_resource_usage_unknown(
        "nvJitLink is not available on this server, so the PTX was not assembled "
        "(GetServerInfo: nvjitlink_available)");
    return out;
  }

  // One assembly gives the cubin and the resource report; its entry carries the PTX too, so a
  // hit needs one lookup.
  const std::string cubin_key = absl::StrCat(ptx_key, "\ncubin");
  const NvJitLink& jit = **nvjitlink_;
  auto compile_cubin = [&]() -> absl::StatusOr<Cache::Compiled> {
    NORMGRAD_ASSIGN_OR_RETURN(NvJitLink::Assembled assembled,
                              jit.Assemble(ptx->ptx(), config.target_sm));
    auto artifact = std::make_shared<v1::EmitPtxArtifact>(*ptx);
    absl::StatusOr<AssemblerReport> report = ParseAssemblerReport(assembled.info_log, ptx->entry());
    if (report.ok()) {
      ToProto(*report, artifact->mutable_resource_usage());
    } else {
      artifact->set_resource_usage_unknown(
          absl::StrCat("nvJitLink's report could not be read: ", report.status().message()));
    }
    artifact->mutable_cubin_digest()->set_sha256(base::Sha256Hex(assembled.cubin));
    artifact->mutable_cubin_digest()->set_size_bytes(assembled.cubin.size());
    artifact->set_cubin(std::move(assembled.cubin));
    const uint64_t bytes = artifact->ByteSizeLong();
    return Cache::Compiled{std::move(artifact), bytes};
  };
  NORMGRAD_ASSIGN_OR_RETURN(const std::shared_ptr<const v1::EmitPtxArtifact> with_cubin,
                            cache_.GetOrCompile(cubin_key, compile_cubin));
  if (cubin) return *with_cubin;
  v1::EmitPtxArtifact out = *with_cubin;
  out.clear_cubin();
  out.clear_cubin_digest();
  return out;
}

}  // namespace normgrad::server
