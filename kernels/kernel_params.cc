#include "kernels/kernel_params.h"

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
    {KernelParamId::kNumRows, "num_rows", PtxType::kU32},
    {KernelParamId::kNumPartials, "num_partials", PtxType::kU32},
    {KernelParamId::kHiddenDim, "hidden_dim", PtxType::kU32},
    {KernelParamId::kEps, "eps", PtxType::kF32},
};
static_assert(sizeof(kSpecs) / sizeof(kSpecs[0]) == kNumKernelParamIds);

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

}  // namespace normgrad::kernels
