// A kernels::KernelLauncher that runs a plan's launches on the PTX interpreter: the same
// BackwardPlan the CUDA backend runs, with the interpreter's sanitizer (exact-size buffers,
// alignment, barriers, shuffles) on every launch; its zero fills are memsets of the host memory
// the harness hands out.
//
//   SimHarness sim;
//   absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(name), config);
//   absl::StatusOr<SimLauncher> launcher = SimLauncher::ForPlan(&sim, *plan);
//   BackwardArgs args{...};   // addresses of sim.Alloc'd buffers (SimHarness::Address)
//   absl::Status s = plan->Run(args, *launcher);
//
// AllocBackwardF32 registers one problem's f32 buffers and their parameter values, for a test
// that launches a single kernel (its own PTX, perhaps mutated) with kernels::PackArgs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"
#include "kernels/kernel_params.h"
#include "kernels/backward_kernel.h"
#include "tests/ptxsim/sim/sim_harness.h"

namespace normgrad::ptxsim {

// f32 buffers of one backward problem registered in a SimHarness (zero-filled, exact sizes), and
// the parameter values every backward kernel takes for them, for tests that launch one kernel
// directly (kernels::PackArgs(ptx.params, buffers.values)).
struct SimBackwardBuffers {
  float* x;
  float* dy;
  float* gamma;
  float* rms;
  float* dx;
  float* dgamma;
  kernels::KernelParamValues values;
};

inline SimBackwardBuffers AllocBackwardF32(SimHarness& sim, uint32_t rows, uint32_t hidden,
                                           float eps = 1e-5f) {
  const size_t n = size_t{rows} * hidden;
  SimBackwardBuffers b{sim.Alloc<float>(n),         sim.Alloc<float>(n), sim.Alloc<float>(hidden),
                       sim.Alloc<float>(rows),      sim.Alloc<float>(n), sim.Alloc<float>(hidden),
                       kernels::KernelParamValues{}};
  b.values.input = SimHarness::Address(b.x);
  b.values.grad_output = SimHarness::Address(b.dy);
  b.values.gamma = SimHarness::Address(b.gamma);
  b.values.rms = SimHarness::Address(b.rms);
  b.values.grad_input = SimHarness::Address(b.dx);
  b.values.grad_gamma = SimHarness::Address(b.dgamma);
  b.values.num_rows = rows;
  b.values.hidden_dim = hidden;
  b.values.eps = eps;
  return b;
}

class SimLauncher : public kernels::KernelLauncher {
 public:
  // module: the emitted PTX the launches run.
  SimLauncher(SimHarness* sim, kernels::EmittedPtx module) : sim_(sim), module_(std::move(module)) {}

  // Emits the plan's kernel at its config.
  static absl::StatusOr<SimLauncher> ForPlan(SimHarness* sim, const kernels::BackwardPlan& plan) {
    absl::StatusOr<kernels::EmittedPtx> ptx = plan.kernel().Emit(plan.config());
    if (!ptx.ok()) return ptx.status();
    return SimLauncher(sim, *std::move(ptx));
  }

  // A device limit to exercise the plan's piecewise launches (default: the real limit).
  void set_max_grid_x(uint32_t n) { max_grid_x_ = n; }
  // Every launch's report is kept, in order.
  const std::vector<LaunchReport>& reports() const { return reports_; }
  const std::vector<kernels::LaunchGeometry>& geometries() const { return geometries_; }

  absl::Span<const kernels::KernelParam> Params() const override { return module_.params; }
  uint32_t MaxGridX() const override { return max_grid_x_; }
  absl::Status Launch(const kernels::LaunchGeometry& g, void** args) override {
    const kernels::EmittedPtx& m = module_;
    reports_.emplace_back();
    geometries_.push_back(g);
    return sim_->Run(m.text, m.entry, {g.grid[0], g.grid[1], g.grid[2]},
                     {g.block[0], g.block[1], g.block[2]}, args, &reports_.back(), g.shared_bytes);
  }
  absl::Status ZeroFill(uint64_t address, uint64_t bytes) override {
    std::memset(reinterpret_cast<void*>(static_cast<uintptr_t>(address)), 0, bytes);
    return absl::OkStatus();
  }

 private:
  SimHarness* sim_;
  kernels::EmittedPtx module_;
  uint32_t max_grid_x_ = kernels::kMaxGridX;
  std::vector<LaunchReport> reports_;
  std::vector<kernels::LaunchGeometry> geometries_;
};

}  // namespace normgrad::ptxsim
