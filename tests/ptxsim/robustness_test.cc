// Damaged PTX never crashes the parser or the interpreter: thousands of deterministic mutations
// of a real kernel's text each end in a parse error with a line number, or parse and then run to
// completion or to a diagnosed finding (every memory access is checked, hangs hit the
// instruction limit).
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/backward_kernel.h"
#include "tests/ptxsim/sim/sim_harness.h"
#include "tests/ptxsim/sim/sim_launcher.h"

namespace normgrad::ptxsim {
namespace {

std::string Mutate(const std::string& text, std::mt19937& rng) {
  std::string out = text;
  auto pos = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  static const char* kInserts[] = {
      ";", "{", "}", "%r1",          "[", "]", "@", "!", "-", "0x", "0f", ".v4", ".rz", "bra", "<",
      ">", ",", "|", "9999999999999"};
  const int edits = 1 + static_cast<int>(pos(3));
  for (int e = 0; e < edits && !out.empty(); ++e) {
    switch (pos(4)) {
      case 0:
        out.erase(pos(out.size()), 1 + pos(8));
        break;
      case 1:
        out.insert(pos(out.size()), kInserts[pos(sizeof(kInserts) / sizeof(kInserts[0]))]);
        break;
      case 2:
        std::swap(out[pos(out.size())], out[pos(out.size())]);
        break;
      case 3:
        out[pos(out.size())] = static_cast<char>(32 + pos(95));
        break;
    }
  }
  return out;
}

TEST(PtxRobustness, MutatedKernelTextIsRefusedOrRunsWithoutCrashing) {
  kernels::KernelConfig config;
  config.hidden_dim = 40;
  absl::StatusOr<kernels::EmittedPtx> ptx =
      kernels::FindKernel("batched_rms_norm_backward")->Emit(config);
  ASSERT_TRUE(ptx.ok()) << ptx.status();
  SimHarness sim;
  constexpr uint32_t kRows = 2;
  const SimBackwardBuffers buffers = AllocBackwardF32(sim, kRows, 40);
  absl::StatusOr<kernels::PackedArgs> args = kernels::PackArgs(ptx->params, buffers.values);
  ASSERT_TRUE(args.ok()) << args.status();
  std::mt19937 rng(20261202);
  int refused = 0, ran = 0, diagnosed = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::string text = Mutate(ptx->text, rng);
    absl::StatusOr<Module> module = ParsePtx(text);
    if (!module.ok()) {
      ++refused;
      EXPECT_TRUE(absl::StartsWith(module.status().message(), "line ")) << module.status();
      continue;
    }
    const Entry* entry = module->FindEntry("batched_rms_norm_backward");
    if (entry == nullptr || entry->params.size() != 8) continue;  // the mutation renamed things
    LaunchConfig launch;
    launch.grid = {kRows, 1, 1};
    launch.block = {32, 1, 1};
    launch.max_warp_instructions = 200000;
    LaunchReport report;
    const absl::Status s = Launch(*entry, launch, args->pointers(), sim.memory(), &report);
    if (s.ok()) {
      ++ran;
    } else {
      ++diagnosed;
      EXPECT_NE(report.finding, Finding::kNone) << s;
    }
  }
  // The mix shows the mutations reach every outcome.
  EXPECT_GT(refused, 100);
  EXPECT_GT(ran, 10);
  EXPECT_GT(diagnosed, 10);
}

}  // namespace
}  // namespace normgrad::ptxsim
