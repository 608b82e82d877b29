#include "kernels/launch.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"
#include "kernels/kernel_registry.h"
#include "kernels/rms_norm_backward.h"
#include "kernels/rms_norm_backward_row_resident.h"
#include "kernels/status_macros.h"

namespace normgrad::kernels {
namespace {

uint32_t CeilDivU32(uint64_t a, uint64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// BackwardPlan

BackwardPlan::BackwardPlan(Kind kind, std::vector<Step> steps)
    : kind_(kind),
      steps_(std::move(steps)),
      dgamma_output_(kind == Kind::kRowResident ? DgammaOutput::kWritten
                     : kind == Kind::kBatched   ? DgammaOutput::kAccumulated
                                                : DgammaOutput::kNone),
      reads_rms_(kind != Kind::kBatched),
      requires_rms_(kind == Kind::kWarp) {}

absl::StatusOr<BackwardPlan> BackwardPlan::Create(const Kernel& kernel,
                                                  const KernelConfig& config) {
  NORMGRAD_RETURN_IF_ERROR(kernel.CanImplement(config));
  if (dynamic_cast<const RowResidentRmsNormBackwardKernel*>(&kernel) != nullptr) {
    return BackwardPlan(Kind::kRowResident, {{&kernel, config}});
  }
  if (dynamic_cast<const BatchedRmsNormBackwardKernel*>(&kernel) != nullptr) {
    return BackwardPlan(Kind::kBatched, {{&kernel, config}});
  }
  if (dynamic_cast<const RmsNormBackwardKernel*>(&kernel) != nullptr) {
    return BackwardPlan(Kind::kWarp, {{&kernel, config}});
  }
  return absl::InvalidArgumentError(
      absl::StrCat(kernel.EntryName(), " is not a backward kernel a plan can run"));
}

uint64_t BackwardPlan::WorkspaceBytes(uint64_t rows) const {
  if (kind_ != Kind::kRowResident) return 0;
  const Step& main = steps_.front();
  const uint32_t blocks = main.kernel->Geometry(main.config, rows).grid[0];
  const uint64_t row_floats = RowResidentRmsNormBackwardKernel::TilingFor(main.config).capacity();
  return uint64_t{RowResidentRmsNormBackwardKernel::WorkspaceRows(main.config, blocks)} *
         row_floats * sizeof(float);
}

uint64_t BackwardPlan::SemaphoreBytes(uint64_t rows) const {
  if (kind_ != Kind::kRowResident) return 0;
  const Step& main = steps_.front();
  const uint32_t blocks = main.kernel->Geometry(main.config, rows).grid[0];
  return uint64_t{RowResidentRmsNormBackwardKernel::TreeSemaphores(blocks)} * sizeof(uint32_t);
}

absl::Status BackwardPlan::CanImplement(const BackwardArgs& args) const {
  const KernelConfig& config = steps_.front().config;
  if (args.hidden_dim != config.hidden_dim) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_dim ", args.hidden_dim,
                                                   " differs from the plan's ", config.hidden_dim));
  }
  if (kind_ == Kind::kRowResident && args.rows > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows ", args.rows, " exceed ", std::numeric_limits<uint32_t>::max(),
                     ", the most one launch of ", kernel().EntryName(), " takes"));
  }
  if (requires_rms_ && args.rms == 0 && args.rows != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel().EntryName(), " needs the forward's rms; rms is not given"));
  }
  if (WorkspaceBytes(args.rows) != 0 && args.workspace == 0) {
    return absl::InvalidArgumentError(absl::StrCat("workspace of ", WorkspaceBytes(args.rows),
                                                   " bytes for ", args.rows, " rows is not given"));
  }
  if (WorkspaceBytes(args.rows) != 0 && args.workspace % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace at 0x", absl::Hex(args.workspace), " is not 16-byte aligned"));
  }
  if (SemaphoreBytes(args.rows) != 0 && args.semaphores == 0) {
    return absl::InvalidArgumentError(absl::StrCat("semaphores of ", SemaphoreBytes(args.rows),
                                                   " bytes for ", args.rows,
                                                   " rows are not given"));
  }
  return absl::OkStatus();
}

absl::Status BackwardPlan::Run(const BackwardArgs& args, KernelLauncher& launcher) const {
  NORMGRAD_RETURN_IF_ERROR(CanImplement(args));
  if (args.rows == 0) return absl::OkStatus();
  return kind_ == Kind::kRowResident ? RunRowResident(args, launcher) : RunInPieces(args, launcher);
}

absl::Status BackwardPlan::LaunchStep(size_t step, const LaunchGeometry& geometry,
                                      const KernelParamValues& values,
                                      KernelLauncher& launcher) const {
  NORMGRAD_ASSIGN_OR_RETURN(PackedArgs packed, PackArgs(launcher.Params(step), values));
  return launcher.Launch(step, geometry, packed.pointers());
}

// The parameters every backward kernel reads, for rows [first, first + n) of `args`: their row
// pointers (and rms) offset to the first row.
KernelParamValues BackwardPlan::RowsOf(const BackwardArgs& args, uint64_t first, uint64_t n) const {
  const uint64_t offset = first * args.hidden_dim * DTypeBytes(steps_.front().config.dtype);
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

// The row-resident kernel: one launch of G blocks writes dx and, through its grad_gamma tree in
// the workspace and semaphores, the f32 dgamma.
absl::Status BackwardPlan::RunRowResident(const BackwardArgs& args,
                                          KernelLauncher& launcher) const {
  const Step& main = steps_[0];
  KernelParamValues rows = RowsOf(args, 0, args.rows);
  rows.dgamma = args.dgamma;
  rows.dgamma_partials = args.workspace;
  rows.semaphores = args.semaphores;
  return LaunchStep(0, main.kernel->Geometry(main.config, args.rows), rows, launcher);
}

// The seed kernels over args.rows rows, in pieces of at most 2^32-1 rows (their u32 num_rows)
// whose grid fits the device's grid.x limit.
absl::Status BackwardPlan::RunInPieces(const BackwardArgs& args, KernelLauncher& launcher) const {
  const Step& step = steps_.front();
  const uint32_t max_grid_x = std::max<uint32_t>(launcher.MaxGridX(), 1);
  uint64_t piece = std::min<uint64_t>(args.rows, std::numeric_limits<uint32_t>::max());
  while (piece > 1 && step.kernel->Geometry(step.config, piece).grid[0] > max_grid_x) {
    piece = CeilDivU32(piece, 2);
  }
  for (uint64_t first = 0; first < args.rows; first += piece) {
    const uint64_t n = std::min(piece, args.rows - first);
    KernelParamValues rows = RowsOf(args, first, n);
    rows.grad_gamma = args.dgamma;
    NORMGRAD_RETURN_IF_ERROR(LaunchStep(0, step.kernel->Geometry(step.config, n), rows, launcher));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::kernels
