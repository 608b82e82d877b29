// The kernels a backend can be asked to run (their entry names), whether a kernel named in a
// request can run the batch, and the KernelConfig a batch implies. Internal to the backends
// (server/cpu, server/cuda), so that CPU and CUDA refuse the same requests in the same words.
// Which kernel runs when none is named is the CUDA backend's choice (cuda_backend.h); the CPU
// backend computes the same math with host_rows whatever is named.
//
//   NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckNamedKernel(spec));
//   kernels::KernelConfig config = backend_internal::ConfigFor(spec, target_sm);
#ifndef NORMGRAD_SERVER_BACKEND_KERNEL_CHOICE_H_
#define NORMGRAD_SERVER_BACKEND_KERNEL_CHOICE_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernel.h"
#include "server/backend/backend.h"

namespace normgrad::server::backend_internal {

// The entry names the backends know how to drive.
inline constexpr absl::string_view kWarpKernel = "rms_norm_backward";  // hidden <= 32, rms given
inline constexpr absl::string_view kBatchedKernel = "batched_rms_norm_backward";  // any hidden
// Row held in registers (hidden <= 16384) or streamed (<= 65536), rms given or not, grad_gamma
// in a fixed order, one launch.
inline constexpr absl::string_view kRowResidentKernel = "rms_norm_backward_row_resident";

// OK when spec.kernel is empty, else: INVALID_ARGUMENT for an unknown name, for a kernel the
// backends cannot drive, for the kernel's own CanImplement failure (e.g. hidden_dim > 32 for
// the warp kernel), for the warp kernel without the forward's rms, and for the batched kernel
// with the forward's rms but no valid eps (it recomputes rms whatever is given).
absl::Status CheckNamedKernel(const BatchSpec& spec);

// Whether the batch's kernel reads the forward's rms: given, and not the batched kernel (which
// recomputes it from x and eps by its contract). Both backends ask this, so a request is
// answered alike on each.
bool ReadsGivenRms(const BatchSpec& spec);

// A target every kernel supports for every dtype: whether a request is valid at all (as opposed
// to valid but not on this GPU) is judged against it.
inline constexpr int kProbeTargetSm = 90;

// The KernelConfig a batch implies for `target_sm`.
kernels::KernelConfig ConfigFor(const BatchSpec& spec, int target_sm);

}  // namespace normgrad::server::backend_internal

#endif  // NORMGRAD_SERVER_BACKEND_KERNEL_CHOICE_H_
