// The launch contract: how a backward computation on device memory becomes kernel launches.
// Modelled on CUTLASS's operations: a plan is created for a kernel configuration, says whether it
// can implement given arguments, how much workspace they need, which modules it launches, and
// runs every launch of a request through a launcher the caller supplies (the CUDA backend's
// launcher calls cuLaunchKernel; the tests' launcher runs the PTX interpreter).
//
//   absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(name), config);
//   for (const BackwardPlan::Step& step : plan->steps()) ... load step.kernel->Emit(step.config)
//   BackwardArgs args{.x = d_x, .dy = d_dy, .dx = d_dx, .gamma = d_gamma, .dgamma = d_dgamma,
//                     .rows = rows, .hidden_dim = h, .eps = 1e-5f};
//   args.workspace = Allocate(plan->WorkspaceBytes(rows));     // 16-byte aligned
//   args.semaphores = AllocateZeroed(plan->SemaphoreBytes(rows));  // once: Run leaves them zero
//   if (plan->dgamma_output() == DgammaOutput::kAccumulated) zero args.dgamma first;
//   absl::Status s = plan->Run(args, launcher);
//
// Arguments are packed from each built kernel's own parameter list (EmittedPtx::params, in the
// order the kernel's Build declared them) by kernels/kernel_params.h's PackArgs, so a
// parameter's name and type are written once, in kernels/kernel_params.cc, and nothing outside
// kernels/ knows them.
#ifndef NORMGRAD_KERNELS_LAUNCH_H_
#define NORMGRAD_KERNELS_LAUNCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernel.h"
#include "kernels/kernel_params.h"

namespace normgrad::kernels {

// What a plan does with BackwardArgs::dgamma.
enum class DgammaOutput {
  kWritten,      // the chunk's grad_gamma, summed in a fixed order (bitwise reproducible)
  kAccumulated,  // added to with atomics: the caller zeroes it first (order not reproducible)
  kNone,         // not computed on the device: the caller computes grad_gamma itself
};

// What a caller hands a plan: device memory of one request (or chunk).
struct BackwardArgs {
  uint64_t x = 0;          // rows x hidden_dim elements of the config's dtype
  uint64_t dy = 0;         // same
  uint64_t dx = 0;         // same (written)
  uint64_t gamma = 0;      // hidden_dim elements of the dtype
  uint64_t rms = 0;        // rows f32, the forward's rms (contains eps); 0: recompute from x, eps
  uint64_t dgamma = 0;     // hidden_dim f32; see BackwardPlan::dgamma_output()
  uint64_t workspace = 0;  // WorkspaceBytes(rows) bytes, 16-byte aligned (ignored when that is 0)
  // SemaphoreBytes(rows) bytes (ignored when that is 0), zero before Run; a Run whose launches
  // completed leaves them zero, so their owner zeroes them once, when it allocates them. Runs
  // that may overlap (other streams) need their own.
  uint64_t semaphores = 0;
  uint64_t rows = 0;
  uint32_t hidden_dim = 0;
  float eps = 1e-5f;
};

// Where a plan's launches go. Step indices are those of BackwardPlan::steps().
class KernelLauncher {
 public:
  virtual ~KernelLauncher() = default;
  // The parameter list of step `step`'s loaded module (EmittedPtx::params).
  virtual absl::Span<const KernelParam> Params(size_t step) const = 0;
  // The device's largest grid.x (CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X).
  virtual uint32_t MaxGridX() const { return kMaxGridX; }

  // One launch of step `step`'s kernel with `args` (cuLaunchKernel's kernelParams).
  virtual absl::Status Launch(size_t step, const LaunchGeometry& geometry, void** args) = 0;
};

// Every launch of one backward request for one kernel configuration:
//   rms_norm_backward_row_resident: one launch writes dx and dgamma (f32, a fixed-order sum of
//     the blocks' partial sums through the workspace and semaphores: kWritten). rms optional.
//   batched_rms_norm_backward: dx, and grad_gamma by atomics (kAccumulated); rms is recomputed
//     (a given one is not read). Launched in pieces when the grid would pass the device's limit.
//   rms_norm_backward: dx from the given rms (required); grad_gamma is the caller's (kNone).
//     Launched in pieces likewise.
// Plans are immutable once created; Run may be called concurrently with different launchers.
class BackwardPlan {
 public:
  struct Step {
    const Kernel* kernel;
    KernelConfig config;  // what to emit (and cache) the step's module with
  };

  // The plan for backward kernel `kernel` (any of the three above) at `config`: the kernel's
  // and its companions' CanImplement status; INVALID_ARGUMENT for a kernel that is not a
  // backward kernel (the reduce alone).
  static absl::StatusOr<BackwardPlan> Create(const Kernel& kernel, const KernelConfig& config);

  const std::vector<Step>& steps() const { return steps_; }
  const Kernel& kernel() const { return *steps_.front().kernel; }
  DgammaOutput dgamma_output() const { return dgamma_output_; }
  // Whether BackwardArgs::rms is read (when non-zero) / must be given.
  bool reads_rms() const { return reads_rms_; }
  bool requires_rms() const { return requires_rms_; }

  // Device memory Run needs besides the arguments' own buffers, for `rows` rows.
  uint64_t WorkspaceBytes(uint64_t rows) const;
  // u32 counters Run needs for `rows` rows (BackwardArgs::semaphores): one per group of kFanIn
  // blocks per tree level, 4 * (G / 15 + 3) bytes at most (G: the grid).
  uint64_t SemaphoreBytes(uint64_t rows) const;

  // Cheap check of `args` against the plan: hidden_dim equal to the config's, rows within what
  // the kernels' u32 row counts take, rms given where required, workspace present when needed.
  // INVALID_ARGUMENT naming the field and the numbers.
  absl::Status CanImplement(const BackwardArgs& args) const;

  // CanImplement, then every launch in order through `launcher` (on one stream, so each sees the
  // previous one's writes). Stops at the first failure and returns it.
  absl::Status Run(const BackwardArgs& args, KernelLauncher& launcher) const;

 private:
  enum class Kind { kRowResident, kBatched, kWarp };
  BackwardPlan(Kind kind, std::vector<Step> steps);

  KernelParamValues RowsOf(const BackwardArgs& args, uint64_t first, uint64_t n) const;
  absl::Status LaunchStep(size_t step, const LaunchGeometry& geometry,
                          const KernelParamValues& values, KernelLauncher& launcher) const;
  absl::Status RunRowResident(const BackwardArgs& args, KernelLauncher& launcher) const;
  absl::Status RunInPieces(const BackwardArgs& args, KernelLauncher& launcher) const;

  Kind kind_;
  std::vector<Step> steps_;
  DgammaOutput dgamma_output_;
  bool reads_rms_;
  bool requires_rms_;
};

}  // namespace normgrad::kernels

#endif  // NORMGRAD_KERNELS_LAUNCH_H_
