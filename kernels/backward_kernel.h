// The kernel interface: what every RMSNorm-backward kernel says about itself, how it is emitted
// and how it is launched. Modelled on CUTLASS's operations: a kernel says whether it can implement
// a configuration (CanImplement) and given arguments (CheckArgs), emits deterministic PTX for it
// (Emit, keyed by ConfigKey), says how much workspace the arguments need and what it reads and
// writes (DataFlow), and issues every launch of a request through a launcher the caller supplies
// (the CUDA backend's launcher calls cuLaunchKernel on a stream; the tests' launchers run the PTX
// interpreter or record). A BackwardPlan binds a kernel to one configuration. Kernels are found
// in kernels/rmsnorm/kernel_registry.h; which kernel a request gets: kernels/rmsnorm/kernel_choice.h.
//
//   const BackwardKernel* k = FindKernel("batched_rms_norm_backward");
//   KernelConfig config{.hidden_dim = 896, .target_sm = 90};
//   NORMGRAD_RETURN_IF_ERROR(k->CanImplement(config));   // cheap, no emission
//   absl::StatusOr<EmittedPtx> ptx = k->Emit(config);     // deterministic bytes
//   uint32_t t = k->BlockThreads(config);                 // the PTX's `.maxntid t, 1, 1`
//   std::string key = k->ConfigKey(config);               // what the PTX bakes in
//
// Contract: a value is either a run-time kernel parameter or part of ConfigKey(), never half of
// each. Two configs with equal ConfigKey() emit byte-identical PTX.
//
//   absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*k, config);
//   ... load plan->kernel().Emit(plan->config()) into a launcher
//   BackwardArgs args{.x = d_x, .dy = d_dy, .dx = d_dx, .gamma = d_gamma, .dgamma = d_dgamma,
//                     .rows = rows, .hidden_dim = h, .eps = 1e-5f};
//   args.workspace = Allocate(plan->WorkspaceBytes(rows));         // 16-byte aligned
//   args.semaphores = AllocateZeroed(plan->SemaphoreBytes(rows));  // once: Run leaves them zero
//   absl::Status s = plan->Run(args, launcher);
//
// Arguments are packed from each built kernel's own parameter list (EmittedPtx::params, in the
// order the kernel's Build declared them) by kernels/kernel_params.h's PackArgs, so a
// parameter's name and type are written once, in kernels/kernel_params.cc, and nothing outside
// kernels/ knows them.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"
#include "kernels/kernel_params.h"

namespace normgrad::kernels {

// What a caller hands a backward kernel: device memory of one request (or chunk).
struct BackwardArgs {
  uint64_t x = 0;          // rows x hidden_dim elements of the config's dtype
  uint64_t dy = 0;         // same
  uint64_t dx = 0;         // same (written)
  uint64_t gamma = 0;      // hidden_dim elements of the dtype
  uint64_t rms = 0;        // rows f32, the forward's rms (contains eps); 0: recompute from x, eps
  uint64_t dgamma = 0;     // hidden_dim f32, written when DataFlow().writes_dgamma; else ignored
  uint64_t workspace = 0;  // WorkspaceBytes(rows) bytes, 16-byte aligned (ignored when that is 0)
  // SemaphoreBytes(rows) bytes (ignored when that is 0), zero before Run; a Run whose launches
  // completed leaves them zero, so their owner zeroes them once, when it allocates them. Runs
  // that may overlap (other streams) need their own.
  uint64_t semaphores = 0;
  uint64_t rows = 0;
  uint32_t hidden_dim = 0;
  float eps = 1e-5f;
};

// Where a kernel's launches go: one loaded module of the kernel, in order on one stream (so each
// launch and fill sees the previous one's writes).
class KernelLauncher {
 public:
  virtual ~KernelLauncher() = default;
  // The loaded module's parameter list (EmittedPtx::params).
  virtual absl::Span<const KernelParam> Params() const = 0;
  // The device's largest grid.x (CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X).
  virtual uint32_t MaxGridX() const { return kMaxGridX; }

  // One launch of the module's entry with `args` (cuLaunchKernel's kernelParams).
  virtual absl::Status Launch(const LaunchGeometry& geometry, void** args) = 0;
  // Sets `bytes` (a multiple of 4) of device memory at `address` to zero, in stream order.
  virtual absl::Status ZeroFill(uint64_t address, uint64_t bytes) = 0;
};

// What a backward kernel reads and writes besides x, dy, gamma and dx: what its caller must
// provide, and what is left to the caller.
struct BackwardDataFlow {
  bool reads_rms = false;     // a given BackwardArgs::rms is used; else rms comes from x and eps
  bool requires_rms = false;  // BackwardArgs::rms must be given
  // BackwardArgs::dgamma receives the rows' grad_gamma (f32); false: the caller computes it, or,
  // for a config without gamma (NormVariant::has_gamma false, BackwardPlan::DataFlow), there is
  // no grad_gamma at all: nothing writes it, nobody computes it, and dgamma is ignored.
  bool writes_dgamma = false;
  // The grad_gamma sum has a fixed order (same inputs and grid, same bits); false: atomics.
  bool reproducible_dgamma = false;
};

// An RMSNorm-backward kernel. Every kernel of the registry is one (kernels/rmsnorm/kernel_registry.h).
// Stateless: every method may be called concurrently from any thread.
class BackwardKernel {
 public:
  virtual ~BackwardKernel() = default;

  virtual absl::string_view EntryName() const = 0;
  // The entry's parameters in declaration order, as the emitted PTX declares them.
  virtual std::vector<KernelParam> Params() const = 0;

  // Cheap validity check of `config` (no emission): INVALID_ARGUMENT naming the field, the
  // value and the limit.
  virtual absl::Status CanImplement(const KernelConfig& config) const = 0;

  // Threads per block of every launch at `config` (blocks are 1-D: Geometry's block.x). The
  // emitted entry declares it as `.maxntid <threads>, 1, 1`: ptxas, whole-program or
  // relocatable (as nvJitLink runs it), must then fit registers * threads into the 65,536
  // registers of an SM, so every cubin made from the PTX launches at this block size; the driver
  // refuses a larger block (CUDA_ERROR_INVALID_VALUE), which the kernels' fixed tiling could
  // not process anyway. Depends only on what ConfigKey() names.
  virtual uint32_t BlockThreads(const KernelConfig& config) const = 0;

  // Grid, block and dynamic shared memory to process `num_rows` rows; block = (BlockThreads, 1,
  // 1). Never launches a full-mask shuffle with fewer than 32 live threads.
  virtual LaunchGeometry Geometry(const KernelConfig& config, uint64_t num_rows) const = 0;

  // Stable text naming everything baked into the emitted PTX (entry, specialised values,
  // dtype, target, PTX version, generator version). Used as the module cache key.
  virtual std::string ConfigKey(const KernelConfig& config) const = 0;

  // The module's text. Fails with CanImplement's status, or INVALID_ARGUMENT when an
  // explicit ptx_version is below what the target and instructions need (saying which).
  virtual absl::StatusOr<EmittedPtx> Emit(const KernelConfig& config) const = 0;

  // What the kernel reads and writes besides x, dy, gamma and dx.
  virtual BackwardDataFlow DataFlow() const = 0;

  // Device memory Run needs besides the arguments' own buffers, for `rows` rows.
  virtual uint64_t WorkspaceBytes(const KernelConfig& config, uint64_t rows) const { return 0; }
  // u32 counters Run needs for `rows` rows (BackwardArgs::semaphores).
  virtual uint64_t SemaphoreBytes(const KernelConfig& config, uint64_t rows) const { return 0; }

  // Cheap check of `args` against `config`: hidden_dim equal to the config's, rows within what
  // one Run takes, rms given where required, workspace and semaphores present when needed.
  // INVALID_ARGUMENT naming the field and the numbers.
  absl::Status CheckArgs(const KernelConfig& config, const BackwardArgs& args) const;

  // CheckArgs, then every launch (and fill) of the request through `launcher`, whose module is
  // this kernel emitted at `config`. Stops at the first failure and returns it.
  absl::Status Run(const KernelConfig& config, const BackwardArgs& args,
                   KernelLauncher& launcher) const;

 protected:
  // The most rows one Run takes.
  virtual uint64_t MaxRows() const { return std::numeric_limits<uint64_t>::max(); }
  // Run's launches for args.rows >= 1 rows, after CheckArgs.
  virtual absl::Status Launch(const KernelConfig& config, const BackwardArgs& args,
                              KernelLauncher& launcher) const = 0;

  // The parameters every backward kernel reads, for rows [first, first + n) of `args`: their
  // row pointers (and rms) offset to the first row.
  static KernelParamValues RowValues(const KernelConfig& config, const BackwardArgs& args,
                                     uint64_t first, uint64_t n);
  // One launch of `launcher`'s module with `values` packed in its parameters' order.
  static absl::Status LaunchWith(const LaunchGeometry& geometry, const KernelParamValues& values,
                                 KernelLauncher& launcher);
  // Launches over args.rows rows in pieces of at most 2^32-1 rows (a u32 num_rows) whose grid
  // fits the launcher's grid.x limit, each with RowValues of its rows completed by `complete`.
  absl::Status LaunchInPieces(const KernelConfig& config, const BackwardArgs& args,
                              KernelLauncher& launcher,
                              const std::function<void(KernelParamValues&)>& complete) const;
};

// A backward kernel bound to one configuration (what its module is emitted and cached with).
// Immutable; Run may be called concurrently with different launchers.
class BackwardPlan {
 public:
  // The plan of `kernel` at `config`: the kernel's CanImplement status.
  static absl::StatusOr<BackwardPlan> Create(const BackwardKernel& kernel,
                                             const KernelConfig& config);

  const BackwardKernel& kernel() const { return *kernel_; }
  const KernelConfig& config() const { return config_; }
  // The kernel's data flow at this config: without gamma, no grad_gamma (writes_dgamma false).
  BackwardDataFlow DataFlow() const {
    BackwardDataFlow flow = kernel_->DataFlow();
    flow.writes_dgamma = flow.writes_dgamma && config_.variant.has_gamma;
    return flow;
  }
  uint64_t WorkspaceBytes(uint64_t rows) const { return kernel_->WorkspaceBytes(config_, rows); }
  uint64_t SemaphoreBytes(uint64_t rows) const { return kernel_->SemaphoreBytes(config_, rows); }
  absl::Status CheckArgs(const BackwardArgs& args) const {
    return kernel_->CheckArgs(config_, args);
  }
  absl::Status Run(const BackwardArgs& args, KernelLauncher& launcher) const {
    return kernel_->Run(config_, args, launcher);
  }

 private:
  BackwardPlan(const BackwardKernel& kernel, const KernelConfig& config)
      : kernel_(&kernel), config_(config) {}

  const BackwardKernel* kernel_;
  KernelConfig config_;
};

}  // namespace normgrad::kernels
