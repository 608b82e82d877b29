#include "kernels/rmsnorm/kernel_choice.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/bounded_quote.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/rmsnorm/rms_norm_backward.h"
#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"
#include "base/status_macros.h"

namespace normgrad::kernels {

KernelConfig ConfigFor(const BackwardRequest& request, const BackwardDevice& device) {
  KernelConfig config;
  config.hidden_dim = request.hidden_dim;
  config.dtype = request.dtype;
  config.target_sm = device.target_sm;
  config.sm_count = device.sm_count;
  config.variant = request.variant;
  return config;
}

absl::Status CheckEps(float eps, bool rms_provided, bool kernel_reads_rms,
                      absl::string_view field) {
  if ((rms_provided && kernel_reads_rms) || (std::isfinite(eps) && eps > 0)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", eps, "; must be finite and > 0",
                   rms_provided ? "" : " (or give the forward's rms with the rows)"));
}

absl::Status CheckNamedKernel(const BackwardRequest& request) {
  if (request.kernel.empty()) return absl::OkStatus();
  const BackwardKernel* kernel = FindKernel(request.kernel);
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel ", base::BoundedQuote(request.kernel), " is unknown"));
  }
  NORMGRAD_RETURN_IF_ERROR(kernel->CanImplement(ConfigFor(request, {.target_sm = kProbeTargetSm})));
  const BackwardDataFlow flow = kernel->DataFlow();
  if (absl::Status s = CheckEps(request.eps, request.rms_provided, flow.reads_rms); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel \"", kernel->EntryName(), "\" recomputes rms from x and eps (a given ",
                     "rms is not read): ", s.message(), "; leave kernel empty to use the given rms"));
  }
  if (flow.requires_rms && !request.rms_provided) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel \"", kernel->EntryName(),
                     "\" needs the forward pass's rms (one value per row); none given"));
  }
  return absl::OkStatus();
}

bool ReadsGivenRms(const BackwardRequest& request) {
  if (!request.rms_provided) return false;
  if (request.kernel.empty()) return true;
  const BackwardKernel* kernel = FindKernel(request.kernel);
  return kernel == nullptr || kernel->DataFlow().reads_rms;
}

absl::StatusOr<const BackwardKernel*> ChooseBackwardKernel(const BackwardRequest& request,
                                                           const BackwardDevice& device) {
  NORMGRAD_RETURN_IF_ERROR(CheckNamedKernel(request));
  absl::string_view name = request.kernel;
  if (name.empty() && !request.variant.is_default()) {
    // Only the row-resident kernel computes the variants: no other kernel, and not the host path
    // (its math is the plain RMSNorm), may stand in for it. Whether the device's target can run
    // it is the caller's check, as for any chosen kernel.
    const BackwardKernel* row_resident = FindKernel(RowResidentRmsNormBackwardKernel::kEntryName);
    if (row_resident == nullptr) {
      return absl::InternalError(absl::StrCat("the kernels library lacks ",
                                              RowResidentRmsNormBackwardKernel::kEntryName));
    }
    const absl::Status s =
        row_resident->CanImplement(ConfigFor(request, {.target_sm = kProbeTargetSm}));
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("no kernel computes this RMSNorm variant (",
                                 request.variant.Describe(), ") for this batch: only ",
                                 RowResidentRmsNormBackwardKernel::kEntryName,
                                 " computes variants, and it refuses: ", s.message()));
    }
    return row_resident;
  }
  if (name.empty()) {
    const BackwardKernel* row_resident = FindKernel(RowResidentRmsNormBackwardKernel::kEntryName);
    name = row_resident != nullptr && row_resident->CanImplement(ConfigFor(request, device)).ok()
               ? RowResidentRmsNormBackwardKernel::kEntryName
           : !request.rms_provided ? BatchedRmsNormBackwardKernel::kEntryName
           : request.hidden_dim <= RmsNormBackwardKernel::kMaxHiddenDim
               ? RmsNormBackwardKernel::kEntryName
               : absl::string_view();
    if (name.empty()) return nullptr;
  }
  const BackwardKernel* kernel = FindKernel(name);
  if (kernel == nullptr) {
    return absl::InternalError(absl::StrCat("the kernels library lacks ", name));
  }
  return kernel;
}

}  // namespace normgrad::kernels
