// A kernels::KernelLauncher that runs a plan's launches on the PTX interpreter: the same
// BackwardPlan the CUDA backend runs, with the interpreter's sanitizer (exact-size buffers,
// alignment, barriers, shuffles) on every launch.
//
//   SimHarness sim;
//   absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(name), config);
//   absl::StatusOr<SimLauncher> launcher = SimLauncher::ForPlan(&sim, *plan);
//   BackwardArgs args{...};   // addresses of sim.Alloc'd buffers (SimHarness::Address)
//   absl::Status s = plan->Run(args, *launcher);
#ifndef NORMGRAD_TESTS_PTXSIM_SIM_LAUNCHER_H_
#define NORMGRAD_TESTS_PTXSIM_SIM_LAUNCHER_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernel.h"
#include "kernels/launch.h"
#include "tests/ptxsim/sim_harness.h"

namespace normgrad::ptxsim {

class SimLauncher : public kernels::KernelLauncher {
 public:
  // modules[i]: the emitted PTX of step i.
  SimLauncher(SimHarness* sim, std::vector<kernels::EmittedPtx> modules)
      : sim_(sim), modules_(std::move(modules)) {}

  // Emits every step of `plan` (each step's kernel at its config).
  static absl::StatusOr<SimLauncher> ForPlan(SimHarness* sim, const kernels::BackwardPlan& plan) {
    std::vector<kernels::EmittedPtx> modules;
    for (const kernels::BackwardPlan::Step& step : plan.steps()) {
      absl::StatusOr<kernels::EmittedPtx> ptx = step.kernel->Emit(step.config);
      if (!ptx.ok()) return ptx.status();
      modules.push_back(*std::move(ptx));
    }
    return SimLauncher(sim, std::move(modules));
  }

  // A device limit to exercise the plan's piecewise launches (default: the real limit).
  void set_max_grid_x(uint32_t n) { max_grid_x_ = n; }
  // Every launch's report is kept, in order.
  const std::vector<LaunchReport>& reports() const { return reports_; }
  const std::vector<kernels::LaunchGeometry>& geometries() const { return geometries_; }

  absl::Span<const kernels::KernelParam> Params(size_t step) const override {
    return modules_[step].params;
  }
  uint32_t MaxGridX() const override { return max_grid_x_; }
  absl::Status Launch(size_t step, const kernels::LaunchGeometry& g, void** args) override {
    const kernels::EmittedPtx& m = modules_[step];
    reports_.emplace_back();
    geometries_.push_back(g);
    return sim_->Run(m.text, m.entry, {g.grid[0], g.grid[1], g.grid[2]},
                     {g.block[0], g.block[1], g.block[2]}, args, &reports_.back(), g.shared_bytes);
  }

 private:
  SimHarness* sim_;
  std::vector<kernels::EmittedPtx> modules_;
  uint32_t max_grid_x_ = kernels::kMaxGridX;
  std::vector<LaunchReport> reports_;
  std::vector<kernels::LaunchGeometry> geometries_;
};

}  // namespace normgrad::ptxsim

#endif  // NORMGRAD_TESTS_PTXSIM_SIM_LAUNCHER_H_
