#include "server/backend/kernel_choice.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/bounded_quote.h"
#include "kernels/kernel_registry.h"
#include "kernels/status_macros.h"

namespace normgrad::server::backend_internal {

kernels::KernelConfig ConfigFor(const BatchSpec& spec, int target_sm) {
  kernels::KernelConfig config;
  config.hidden_dim = spec.hidden_dim;
  config.dtype = spec.dtype;
  config.target_sm = target_sm;
  return config;
}

absl::Status CheckNamedKernel(const BatchSpec& spec) {
  if (spec.kernel.empty()) return absl::OkStatus();
  const kernels::Kernel* kernel = kernels::FindKernel(spec.kernel);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel ", kernels::BoundedQuote(spec.kernel), " is unknown"));
  }
  if (spec.kernel != kWarpKernel && spec.kernel != kBatchedKernel &&
      spec.kernel != kRowResidentKernel) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel ", kernels::BoundedQuote(spec.kernel),
                     " cannot run a backward batch here; use \"", kRowResidentKernel, "\", \"",
                     kBatchedKernel, "\", \"", kWarpKernel, "\" or leave kernel empty"));
  }
  kernels::KernelConfig config = ConfigFor(spec, kProbeTargetSm);
  NORMGRAD_RETURN_IF_ERROR(kernel->CanImplement(config));
  if (spec.kernel == kBatchedKernel && spec.rms_provided &&
      !(std::isfinite(spec.eps) && spec.eps > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel \"", kBatchedKernel, "\" recomputes rms from x and eps (a given rms ",
                     "is not read), so eps must be finite and > 0, got ", spec.eps,
                     "; leave kernel empty to use the given rms"));
  }
  if (spec.kernel == kWarpKernel && !spec.rms_provided) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel \"", kWarpKernel,
                     "\" needs the forward pass's rms (one value per row); none given"));
  }
  return absl::OkStatus();
}

bool ReadsGivenRms(const BatchSpec& spec) {
  return spec.rms_provided && spec.kernel != kBatchedKernel;
}

}  // namespace normgrad::server::backend_internal
