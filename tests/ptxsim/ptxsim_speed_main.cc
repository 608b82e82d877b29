// ptxsim-speed: how fast the interpreter runs the trueno-compatible kernels, in instructions per second, and
// how that compares with the CPU reference on the same problem (measured in the same run).
//
//   build/bin/ptxsim-speed [--rows 256] [--hidden 4096] [--repeats 3]
//
// Prints one line per kernel: thread-instructions/s (each lane's executed instruction counts
// once), warp-instructions/s (one per issued instruction of a warp group), and the interpreter's
// time divided by ReferenceBackward's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/backward_kernel.h"
#include "kernels/rmsnorm/reference.h"
#include "tests/ptxsim/sim/sim_harness.h"
#include "tests/ptxsim/sim/sim_launcher.h"

namespace {

using normgrad::kernels::FindKernel;
using normgrad::kernels::KernelConfig;
using namespace normgrad::ptxsim;

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Prints `status` for kernel `entry`; the exit code.
int Failed(const char* entry, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", entry, std::string(status.message()).c_str());
  return 1;
}

int Run(const char* entry, uint32_t rows, uint32_t hidden, int repeats) {
  const normgrad::kernels::BackwardKernel* kernel = FindKernel(entry);
  KernelConfig config;
  config.hidden_dim = hidden;
  config.target_sm = 90;
  absl::StatusOr<normgrad::kernels::EmittedPtx> ptx = kernel->Emit(config);
  if (!ptx.ok()) return Failed(entry, ptx.status());
  const auto parse_start = std::chrono::steady_clock::now();
  absl::StatusOr<Module> module = ParsePtx(ptx->text);
  const double parse_seconds = Seconds(parse_start);
  if (!module.ok()) return Failed(entry, module.status());
  const normgrad::kernels::LaunchGeometry g = kernel->Geometry(config, rows);
  SimHarness sim;
  const size_t n = size_t{rows} * hidden;
  const SimBackwardBuffers buffers = AllocBackwardF32(sim, rows, hidden);
  float* const x = buffers.x;
  float* const dy = buffers.dy;
  float* const gamma = buffers.gamma;
  float* const rms = buffers.rms;
  float* const dgamma = buffers.dgamma;
  for (size_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
    dy[i] = static_cast<float>((i * 53) % 97) / 48.0f - 1.0f;
  }
  for (uint32_t i = 0; i < hidden; ++i) gamma[i] = 1.0f + static_cast<float>(i % 7) / 10.0f;
  for (uint32_t r = 0; r < rows; ++r) rms[r] = 0.6f;
  // Each kernel takes the parameters it declares, in its own order.
  const normgrad::kernels::KernelParamValues& values = buffers.values;
  absl::StatusOr<normgrad::kernels::PackedArgs> args =
      normgrad::kernels::PackArgs(ptx->params, values);
  if (!args.ok()) return Failed(entry, args.status());
  LaunchConfig launch;
  launch.grid = {g.grid[0], g.grid[1], g.grid[2]};
  launch.block = {g.block[0], g.block[1], g.block[2]};
  launch.dynamic_shared_bytes = g.shared_bytes;
  double best = 1e30;
  LaunchReport report;
  for (int k = 0; k < repeats; ++k) {
    std::fill(dgamma, dgamma + hidden, 0.0f);
    const auto start = std::chrono::steady_clock::now();
    absl::Status s =
        Launch(*module->FindEntry(ptx->entry), launch, args->pointers(), sim.memory(), &report);
    best = std::min(best, Seconds(start));
    if (!s.ok()) return Failed(entry, s);
  }
  std::vector<float> ref_dx(n), ref_dgamma(hidden);
  normgrad::kernels::BackwardInputs in{absl::MakeConstSpan(x, n),
                                       absl::MakeConstSpan(dy, n),
                                       absl::MakeConstSpan(gamma, hidden),
                                       {},
                                       rows,
                                       hidden,
                                       1e-5f};
  // rms_norm_backward reads the forward's rms; the batched kernel recomputes it.
  if (std::strcmp(entry, "rms_norm_backward") == 0) in.rms = absl::MakeConstSpan(rms, rows);
  double ref_best = 1e30;
  for (int k = 0; k < repeats; ++k) {
    const auto start = std::chrono::steady_clock::now();
    normgrad::kernels::ReferenceBackward(in, absl::MakeSpan(ref_dx), absl::MakeSpan(ref_dgamma));
    ref_best = std::min(ref_best, Seconds(start));
  }
  std::printf(
      "%-26s rows %6u hidden %5u: %8.2f ms, %7.1f M thread-instr/s, %6.2f M warp-instr/s "
      "(%llu thread-instr), parse %.3f ms for %zu instructions, %.0fx the CPU reference's time\n",
      entry, rows, hidden, best * 1e3, report.thread_instructions / best / 1e6,
      report.warp_instructions / best / 1e6,
      static_cast<unsigned long long>(report.thread_instructions), parse_seconds * 1e3,
      module->entries[0].code.size(), best / ref_best);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t rows = 256, hidden = 4096;
  int repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (value <= 0) {
      std::fprintf(stderr, "%s needs a positive value\n", flag.c_str());
      return 2;
    }
    if (flag == "--rows") {
      rows = static_cast<uint32_t>(value);
    } else if (flag == "--hidden") {
      hidden = static_cast<uint32_t>(value);
    } else if (flag == "--repeats") {
      repeats = value;
    } else {
      std::fprintf(stderr, "usage: ptxsim-speed [--rows N] [--hidden N] [--repeats N]\n");
      return 2;
    }
  }
  int rc = Run("batched_rms_norm_backward", rows, hidden, repeats);
  rc |= Run("rms_norm_backward", rows * 16, std::min<uint32_t>(hidden, 32), repeats);
  return rc;
}
