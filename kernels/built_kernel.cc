#include "kernels/built_kernel.h"

#include "absl/strings/str_cat.h"
#include "kernels/ptx/divergence_analysis.h"
#include "kernels/ptx/ptx_printer.h"
#include "base/status_macros.h"
#include "kernels/ptx/targets.h"
#include "kernels/ptx/verifier.h"

namespace normgrad::kernels {
namespace {

std::vector<KernelParam> ToKernelParams(const Function& f) {
  std::vector<KernelParam> out;
  for (const ParamDecl& p : f.params()) {
    out.push_back(KernelParam{p.name, std::string(PtxTypeName(p.type))});
  }
  return out;
}

}  // namespace

PtxVersion InstructionsVersion(DType dtype) {
  return dtype == DType::kBF16 ? PtxVersion{7, 0} : PtxVersion{6, 0};
}

Value F32ToU16(Builder& b, DType dtype, Value v) {
  const Value h = b.Cvt(dtype == DType::kF16 ? PtxType::kF16 : PtxType::kBF16, v, Rounding::kRn);
  return b.Bitcast(PtxType::kU16, h);
}

std::vector<KernelParam> BuiltKernel::Params() const {
  KernelConfig small;
  small.hidden_dim = 1;
  small.target_sm = 80;
  absl::StatusOr<Module> module = Build(small);
  if (!module.ok() || module->functions().empty()) return {};
  return ToKernelParams(module->functions().front());
}

absl::Status BuiltKernel::CanImplement(const KernelConfig& config) const {
  if (config.hidden_dim == 0 || config.hidden_dim > max_hidden_dim_) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_dim ", config.hidden_dim, " is outside 1..", max_hidden_dim_,
                     ", the limit of ", entry_name_, hidden_dim_limit_note_));
  }
  if (!ImplementsVariant(config.variant)) {
    return absl::InvalidArgumentError(absl::StrCat(
        entry_name_, " implements the plain RMSNorm only (gamma_offset 0, a gamma, casting mode "
        "gemma); this batch has ", config.variant.Describe(),
        "; rms_norm_backward_row_resident computes the variants"));
  }
  if (config.dtype == DType::kBF16 && config.target_sm < 80) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype bf16 needs target sm_80 or newer (cvt.rn.bf16.f32); target is sm_",
                     config.target_sm));
  }
  return ResolvePtxVersion(config.target_sm, config.ptx_version, InstructionsVersion(config.dtype))
      .status();
}

absl::StatusOr<Module> BuiltKernel::StartModule(const KernelConfig& config) const {
  NORMGRAD_RETURN_IF_ERROR(CanImplement(config));
  NORMGRAD_ASSIGN_OR_RETURN(
      const PtxVersion version,
      ResolvePtxVersion(config.target_sm, config.ptx_version, InstructionsVersion(config.dtype)));
  Module m(version, config.target_sm);
  m.AddEntry(EntryName()).set_max_threads(BlockThreads(config));
  return m;
}

std::string BuiltKernel::ConfigKey(const KernelConfig& config) const {
  absl::StatusOr<PtxVersion> v =
      ResolvePtxVersion(config.target_sm, config.ptx_version, InstructionsVersion(config.dtype));
  const std::string version =
      v.ok() ? v->ToString()
             : (config.ptx_version.has_value() ? config.ptx_version->ToString() : "invalid");
  return absl::StrCat(EntryName(), "|dtype=", DTypeName(config.dtype), "|sm_", config.target_sm,
                      "|ptx=", version, "|", kGeneratorVersion, config.variant.KeySuffix());
}

absl::StatusOr<EmittedPtx> BuiltKernel::Emit(const KernelConfig& config) const {
  NORMGRAD_ASSIGN_OR_RETURN(const Module module, Build(config));
  if (absl::Status s = Verify(module); !s.ok()) {
    return absl::InternalError(absl::StrCat(EntryName(), " failed verification: ", s.message()));
  }
  if (absl::Status s = CheckDivergence(module, LaunchAssumptions{}); !s.ok()) {
    return absl::InternalError(
        absl::StrCat(EntryName(), " failed divergence analysis: ", s.message()));
  }
  EmittedPtx out;
  out.text = EmitPtx(module);
  out.entry = std::string(EntryName());
  out.params = ToKernelParams(module.functions().front());
  out.version = module.version();
  out.target_sm = module.target_sm();
  out.config_key = ConfigKey(config);
  return out;
}

}  // namespace normgrad::kernels
