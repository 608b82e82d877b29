// Two RMSNorm-backward kernels with the entry names and parameter lists of trueno-gpu 0.4.29's, so
// PTX consumers written for trueno can use ours unchanged.
//
// Math (per row r, H = hidden_dim):
//   rms_r = sqrt(mean_i(x_ri^2) + eps)
//   dx_ri = (1/rms_r) * (gamma_i * dy_ri - x_ri / rms_r^2 * mean_j(x_rj * dy_rj * gamma_j))
//   dgamma_i = sum_r dy_ri * x_ri / rms_r
//
// Element types: x, gamma, dy and grad_input are config.dtype in memory (f32, f16, bf16; bf16 needs
// sm_80); all math is f32; rms and grad_gamma are f32 for every dtype.
//
//   const BackwardKernel* k = FindKernel("rms_norm_backward");
//   absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = 32, .target_sm = 80});
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/built_kernel.h"
#include "kernels/kernel_config.h"
#include "kernels/ptx/ptx_builder.h"

namespace normgrad::kernels {

// `rms_norm_backward`: hidden_dim <= 32, one warp per row, rms from the forward pass (already
// containing eps; used as is), writes grad_input only.
// Params: input_ptr, gamma_ptr, rms_ptr, grad_output_ptr, grad_input_ptr (u64),
//         num_rows, hidden_dim (u32).
// Launch: kRowsPerBlock warps per block (block.x = 32 * kRowsPerBlock), row = global warp index.
// A warp whose row is past num_rows exits as a whole (the row test depends only on the warp
// index); lanes past hidden_dim stay alive with zeros, so every full-mask shuffle has 32 lanes.
class RmsNormBackwardKernel : public BuiltKernel {
 public:
  static constexpr uint32_t kMaxHiddenDim = 32;
  static constexpr uint32_t kRowsPerBlock = 8;

  static constexpr absl::string_view kEntryName = "rms_norm_backward";

  RmsNormBackwardKernel()
      : BuiltKernel(kEntryName, kMaxHiddenDim,
                    " (one warp per row); use batched_rms_norm_backward") {}
  // 32 * kRowsPerBlock. (The kernel reads the block size from %ntid.x, so a smaller block of
  // whole warps computes too; `.maxntid` refuses a larger one.)
  uint32_t BlockThreads(const KernelConfig& config) const override { return 32 * kRowsPerBlock; }
  // grid.x = ceil(num_rows / kRowsPerBlock) (at least 1, at most 2^31-1); callers split row
  // ranges above kRowsPerBlock * (2^31-1) or above the u32 num_rows parameter.
  LaunchGeometry Geometry(const KernelConfig& config, uint64_t num_rows) const override;
  absl::StatusOr<Module> Build(const KernelConfig& config) const override;
  // Reads the given rms (required); grad_gamma is left to the caller.
  BackwardDataFlow DataFlow() const override;

 protected:
  // Launches in pieces that fit the device's grid (each with its rows' rms).
  absl::Status Launch(const KernelConfig& config, const BackwardArgs& args,
                      KernelLauncher& launcher) const override;
};

// `batched_rms_norm_backward`: any hidden_dim, one 32-thread block per row, rms recomputed from x
// with the eps parameter, writes grad_input and accumulates grad_gamma with atom.global.add.f32
// (the caller zeroes grad_gamma first; the sum order across rows is not reproducible).
// Params: input_ptr, gamma_ptr, grad_output_ptr, grad_input_ptr, grad_gamma_ptr (u64),
//         num_rows, hidden_dim (u32), eps (f32).
class BatchedRmsNormBackwardKernel : public BuiltKernel {
 public:
  static constexpr uint32_t kMaxHiddenDim = 1u << 31;  // keeps the strided index below 2^32

  static constexpr absl::string_view kEntryName = "batched_rms_norm_backward";

  BatchedRmsNormBackwardKernel() : BuiltKernel(kEntryName, kMaxHiddenDim) {}
  // 32: one warp per row, columns strided by 32.
  uint32_t BlockThreads(const KernelConfig& config) const override { return 32; }
  // grid.x = num_rows (at least 1); block.x = 32. grid.x is capped at 2^31-1: callers split
  // launches (offsetting the row pointers) when num_rows exceeds it.
  LaunchGeometry Geometry(const KernelConfig& config, uint64_t num_rows) const override;
  absl::StatusOr<Module> Build(const KernelConfig& config) const override;
  // rms recomputed (a given one is not read); grad_gamma written by atomics (not reproducible).
  BackwardDataFlow DataFlow() const override;

 protected:
  // Zeroes dgamma, then launches in pieces that fit the device's grid, all adding into it.
  absl::Status Launch(const KernelConfig& config, const BackwardArgs& args,
                      KernelLauncher& launcher) const override;
};

}  // namespace normgrad::kernels
