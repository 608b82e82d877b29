// Which backward kernel runs a request: the one function that picks it (ChooseBackwardKernel),
// and the checks of a kernel named in a request. The backends ask and obey; none of them knows a
// kernel by name.
//
//   BackwardRequest request{.hidden_dim = 4096, .dtype = DType::kBF16, .rms_provided = true};
//   NORMGRAD_ASSIGN_OR_RETURN(const BackwardKernel* kernel,
//                             ChooseBackwardKernel(request, {.target_sm = 90, .sm_count = 132}));
//   if (kernel == nullptr) ... no kernel takes it on a GPU: compute on the host
//   KernelConfig config = ConfigFor(request, device);
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backward_kernel.h"
#include "kernels/kernel_config.h"

namespace normgrad::kernels {

// What a backward request fixes for its whole batch: the one shape of a request, from the
// service's validator (server/service/backward_validator.h, which fills it from the stream's
// header) to the backends and the kernel choice.
struct BackwardRequest {
  uint64_t num_rows = 0;
  uint32_t hidden_dim = 0;
  float eps = 1e-5f;  // neither checked nor used when a given rms is read (CheckEps)
  DType dtype = DType::kF32;
  bool rms_provided = false;  // the forward's rms comes with the rows (header.rms_provided)
  std::string kernel;         // an entry name; empty: ChooseBackwardKernel's choice
  NormVariant variant;        // no gamma: grad_gamma is left alone
};

// eps is used, so it must be finite and > 0, unless the rows come with their rms
// (`rms_provided`) and the kernel reads it (`kernel_reads_rms`). INVALID_ARGUMENT otherwise,
// naming `field` ("header.eps") and the value. The one check of eps: the service's validator,
// the backends and the kernel choice all call it.
absl::Status CheckEps(float eps, bool rms_provided, bool kernel_reads_rms,
                      absl::string_view field = "eps");

// The device a kernel is emitted and sized for.
struct BackwardDevice {
  int target_sm = 75;
  uint32_t sm_count = 0;  // 0: unknown (KernelConfig::sm_count)
};

// A target every kernel supports for every dtype: whether a request is valid at all (as opposed
// to valid but not on this GPU) is judged against it.
inline constexpr int kProbeTargetSm = 90;

// The KernelConfig a request implies on `device`.
KernelConfig ConfigFor(const BackwardRequest& request, const BackwardDevice& device);

// OK when request.kernel is empty, else INVALID_ARGUMENT for an unknown name, for the kernel's
// own CanImplement failure at kProbeTargetSm (e.g. hidden_dim > 32 for rms_norm_backward), for a
// kernel that requires the forward's rms without it, and for a kernel that recomputes rms with
// the forward's rms given but no valid eps.
absl::Status CheckNamedKernel(const BackwardRequest& request);

// Whether the request's kernel reads the forward's rms: given, and not a kernel that recomputes
// it from x and eps. The CPU backend computes the same math and asks this too, so a request is
// answered alike on every backend.
bool ReadsGivenRms(const BackwardRequest& request);

// The kernel for `request` on `device`: the named one (after CheckNamedKernel), else, for a
// variant other than the default (NormVariant), rms_norm_backward_row_resident, the one kernel
// that computes them, or its refusal at kProbeTargetSm (never another kernel, never nullptr);
// else
//   rms_norm_backward_row_resident   when it implements the request on the device (any rms,
//                                    reproducible grad_gamma, one launch);
//   batched_rms_norm_backward        else, without a given rms;
//   rms_norm_backward                else, for rows of at most 32 (it needs the given rms);
//   nullptr                          else: no kernel takes a given rms for such rows, and the
//                                    caller computes the request on the host.
// The kernel may still fail CanImplement on the device's target (bf16 below sm_80, say).
absl::StatusOr<const BackwardKernel*> ChooseBackwardKernel(const BackwardRequest& request,
                                                           const BackwardDevice& device);

}  // namespace normgrad::kernels
