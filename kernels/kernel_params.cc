#include "kernels/kernel_params.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace normgrad::kernels {
namespace {

constexpr KernelParamSpec kSpecs[] = {
    {KernelParamId::kInput, "input_ptr", PtxType::kU64},
    {KernelParamId::kGamma, "gamma_ptr", PtxType::kU64},
    {KernelParamId::kRms, "rms_ptr", PtxType::kU64},
    {KernelParamId::kGradOutput, "grad_output_ptr", PtxType::kU64},
    {KernelParamId::kGradInput, "grad_input_ptr", PtxType::kU64},
    {KernelParamId::kGradGamma, "grad_gamma_ptr", PtxType::kU64},
    {KernelParamId::kDgammaPartials, "dgamma_partials_ptr", PtxType::kU64},
    {KernelParamId::kDgamma, "dgamma_ptr", PtxType::kU64},
    {KernelParamId::kSemaphores, "semaphores_ptr", PtxType::kU64},
    {KernelParamId::kNumRows, "num_rows", PtxType::kU32},
    {KernelParamId::kHiddenDim, "hidden_dim", PtxType::kU32},
    {KernelParamId::kEps, "eps", PtxType::kF32},
};
static_assert(sizeof(kSpecs) / sizeof(kSpecs[0]) == kNumKernelParamIds);

// Where each parameter's value lives in KernelParamValues.
void* ValueSlot(KernelParamValues& v, KernelParamId id) {
  switch (id) {
    case KernelParamId::kInput:
      return &v.input;
    case KernelParamId::kGamma:
      return &v.gamma;
    case KernelParamId::kRms:
      return &v.rms;
    case KernelParamId::kGradOutput:
      return &v.grad_output;
    case KernelParamId::kGradInput:
      return &v.grad_input;
    case KernelParamId::kGradGamma:
      return &v.grad_gamma;
    case KernelParamId::kDgammaPartials:
      return &v.dgamma_partials;
    case KernelParamId::kDgamma:
      return &v.dgamma;
    case KernelParamId::kSemaphores:
      return &v.semaphores;
    case KernelParamId::kNumRows:
      return &v.num_rows;
    case KernelParamId::kHiddenDim:
      return &v.hidden_dim;
    case KernelParamId::kEps:
      return &v.eps;
  }
  return nullptr;
}

// The id of `param` when it is ours with our type; INTERNAL otherwise (a kernel's Build and
// kernel_params.cc disagree, or the list did not come from one of our kernels).
absl::StatusOr<KernelParamId> IdOf(const KernelParam& param) {
  const std::optional<KernelParamId> id = FindKernelParam(param.name);
  if (!id.has_value()) {
    return absl::InternalError(
        absl::StrCat("kernel parameter ", param.name, " is not one the launch contract fills"));
  }
  const absl::string_view want = PtxTypeName(SpecOf(*id).type);
  if (param.ptx_type != want) {
    return absl::InternalError(absl::StrCat("kernel parameter ", param.name, " is .",
                                            param.ptx_type, "; the launch contract fills .", want));
  }
  return *id;
}

size_t SlotBytes(KernelParamId id) { return PtxTypeBits(SpecOf(id).type) / 8; }

}  // namespace

const KernelParamSpec& SpecOf(KernelParamId id) { return kSpecs[static_cast<int>(id)]; }

std::optional<KernelParamId> FindKernelParam(absl::string_view name) {
  for (const KernelParamSpec& s : kSpecs) {
    if (s.name == name) return s.id;
  }
  return std::nullopt;
}

Param AddKernelParam(Function& f, KernelParamId id) {
  const KernelParamSpec& spec = SpecOf(id);
  return f.AddParam(spec.type, spec.name);
}

absl::StatusOr<PackedArgs> PackArgs(absl::Span<const KernelParam> params,
                                    const KernelParamValues& values) {
  PackedArgs packed;
  packed.storage_.assign(params.size(), 0);
  packed.pointers_.resize(params.size());
  KernelParamValues source = values;
  for (size_t k = 0; k < params.size(); ++k) {
    NORMGRAD_ASSIGN_OR_RETURN(const KernelParamId id, IdOf(params[k]));
    std::memcpy(&packed.storage_[k], ValueSlot(source, id), SlotBytes(id));
    packed.pointers_[k] = &packed.storage_[k];
  }
  return packed;
}

absl::StatusOr<KernelParamValues> UnpackArgs(absl::Span<const KernelParam> params,
                                             void* const* args) {
  KernelParamValues values;
  for (size_t k = 0; k < params.size(); ++k) {
    NORMGRAD_ASSIGN_OR_RETURN(const KernelParamId id, IdOf(params[k]));
    std::memcpy(ValueSlot(values, id), args[k], SlotBytes(id));
  }
  return values;
}

}  // namespace normgrad::kernels
