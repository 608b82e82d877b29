#include "kernels/backward_kernel.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace normgrad::kernels {

absl::StatusOr<BackwardPlan> BackwardPlan::Create(const BackwardKernel& kernel,
                                                  const KernelConfig& config) {
  NORMGRAD_RETURN_IF_ERROR(kernel.CanImplement(config));
  return BackwardPlan(kernel, config);
}

absl::Status BackwardKernel::CheckArgs(const KernelConfig& config, const BackwardArgs& args) const {
  if (args.hidden_dim != config.hidden_dim) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_dim ", args.hidden_dim,
                                                   " differs from the plan's ", config.hidden_dim));
  }
  if (args.rows > MaxRows()) {
    return absl::InvalidArgumentError(absl::StrCat("rows ", args.rows, " exceed ", MaxRows(),
                                                   ", the most one launch of ", EntryName(),
                                                   " takes"));
  }
  if (DataFlow().requires_rms && args.rms == 0 && args.rows != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(EntryName(), " needs the forward's rms; rms is not given"));
  }
  const uint64_t workspace_bytes = WorkspaceBytes(config, args.rows);
  if (workspace_bytes != 0 && args.workspace == 0) {
    return absl::InvalidArgumentError(absl::StrCat("workspace of ", workspace_bytes, " bytes for ",
                                                   args.rows, " rows is not given"));
  }
  if (workspace_bytes != 0 && args.workspace % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace at 0x", absl::Hex(args.workspace), " is not 16-byte aligned"));
  }
  const uint64_t semaphore_bytes = SemaphoreBytes(config, args.rows);
  if (semaphore_bytes != 0 && args.semaphores == 0) {
    return absl::InvalidArgumentError(absl::StrCat("semaphores of ", semaphore_bytes, " bytes for ",
                                                   args.rows, " rows are not given"));
  }
  return absl::OkStatus();
}

absl::Status BackwardKernel::Run(const KernelConfig& config, const BackwardArgs& args,
                                 KernelLauncher& launcher) const {
  NORMGRAD_RETURN_IF_ERROR(CheckArgs(config, args));
  if (args.rows == 0) return absl::OkStatus();
  return Launch(config, args, launcher);
}

KernelParamValues BackwardKernel::RowValues(const KernelConfig& config, const BackwardArgs& args,
                                            uint64_t first, uint64_t n) {
  const uint64_t offset = first * args.hidden_dim * DTypeBytes(config.dtype);
  KernelParamValues v;
  v.input = args.x + offset;
  v.grad_output = args.dy + offset;
  v.grad_input = args.dx + offset;
  v.gamma = args.gamma;
  v.rms = args.rms == 0 ? 0 : args.rms + first * sizeof(float);
  v.num_rows = static_cast<uint32_t>(n);
  v.hidden_dim = args.hidden_dim;
  v.eps = args.eps;
  return v;
}

absl::Status BackwardKernel::LaunchWith(const LaunchGeometry& geometry,
                                        const KernelParamValues& values, KernelLauncher& launcher) {
  NORMGRAD_ASSIGN_OR_RETURN(PackedArgs packed, PackArgs(launcher.Params(), values));
  return launcher.Launch(geometry, packed.pointers());
}

absl::Status BackwardKernel::LaunchInPieces(
    const KernelConfig& config, const BackwardArgs& args, KernelLauncher& launcher,
    const std::function<void(KernelParamValues&)>& complete) const {
  const uint32_t max_grid_x = std::max<uint32_t>(launcher.MaxGridX(), 1);
  uint64_t piece = std::min<uint64_t>(args.rows, std::numeric_limits<uint32_t>::max());
  while (piece > 1 && Geometry(config, piece).grid[0] > max_grid_x) piece = (piece + 1) / 2;
  for (uint64_t first = 0; first < args.rows; first += piece) {
    const uint64_t n = std::min(piece, args.rows - first);
    KernelParamValues values = RowValues(config, args, first, n);
    complete(values);
    NORMGRAD_RETURN_IF_ERROR(LaunchWith(Geometry(config, n), values, launcher));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::kernels
