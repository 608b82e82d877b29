// Both trueno-compatible kernels, as kernels/ emits them (the PTX text), executed by the interpreter: dx and
// (batched) dgamma via atomics match ReferenceBackward within |a - b| <= 1e-5 * max(1, |ref|),
// and central finite differences of the forward loss within 1e-4 * max(1, |fd|). With f16/bf16
// elements (f32 math, f32 rms and dgamma) dx is compared after its one rounding to the element
// type: within half an ulp of it plus the f32 error, i.e. 5e-4 (f16) or 4e-3 (bf16) relative.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/backward_kernel.h"
#include "kernels/rmsnorm/reference.h"
#include "tests/ptxsim/backward_problem.h"
#include "tests/ptxsim/sim/sim_harness.h"
#include "tests/ptxsim/sim/sim_launcher.h"

namespace normgrad::ptxsim {
namespace {

using kernel_testing::BackwardProblem;
using kernel_testing::DxTolerance;
using kernels::BackwardArgs;
using kernels::BackwardPlan;
using kernels::DType;
using kernels::FindKernel;
using kernels::KernelConfig;

constexpr double kRelativeTolerance = 1e-5;
constexpr double kFiniteDifferenceTolerance = 1e-4;

struct Shape {
  const char* kernel;
  uint32_t hidden_dim;
  uint32_t rows;
  int target_sm;
  float eps;
  DType dtype = DType::kF32;
};

bool IsWarpKernel(const Shape& s) { return std::string(s.kernel) == "rms_norm_backward"; }

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return absl::StrCat(IsWarpKernel(s) ? "warp" : "batched", "_", kernels::DTypeName(s.dtype), "_h",
                      s.hidden_dim, "_rows", s.rows, "_sm", s.target_sm,
                      s.eps == 1e-5f ? "" : "_eps1em2");
}

BackwardProblem MakeProblem(const Shape& s) {
  return kernel_testing::MakeBackwardProblem(s.dtype, s.rows, s.hidden_dim, s.eps);
}

struct Result {
  std::vector<float> dx, dgamma;
  std::vector<LaunchReport> reports;  // one per launch
};

// Runs the kernel's BackwardPlan on the interpreter (the launches the CUDA backend makes), with
// the device's grid limit lowered to `max_grid_x` when given; returns dx (and dgamma). In place:
// dx is written over dy (grad_input_ptr == grad_output_ptr).
Result RunOnInterpreter(const Shape& s, const BackwardProblem& p,
                        uint32_t max_grid_x = kernels::kMaxGridX, bool in_place = false) {
  const kernels::BackwardKernel* kernel = FindKernel(s.kernel);
  EXPECT_NE(kernel, nullptr);
  if (kernel == nullptr) return {};
  KernelConfig config;
  config.hidden_dim = s.hidden_dim;
  config.target_sm = s.target_sm;
  config.dtype = s.dtype;
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*kernel, config);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  SimHarness sim;
  absl::StatusOr<SimLauncher> launcher = SimLauncher::ForPlan(&sim, *plan);
  EXPECT_TRUE(launcher.ok()) << launcher.status();
  if (!launcher.ok()) return {};
  launcher->set_max_grid_x(max_grid_x);

  const size_t n = size_t{p.rows} * p.hidden;
  const size_t elem = kernels::DTypeBytes(s.dtype);
  // x, dy, gamma, dx in the element type; rms and dgamma are f32 for every dtype.
  auto store = [&](const std::vector<float>& values) {
    const std::vector<uint8_t> bytes = kernel_testing::EncodeElements(values, s.dtype);
    uint8_t* buffer = sim.Alloc<uint8_t>(bytes.size());
    std::copy(bytes.begin(), bytes.end(), buffer);
    return SimHarness::Address(buffer);
  };
  BackwardArgs args;
  args.x = store(p.x);
  args.dy = store(p.dy);
  args.gamma = store(p.gamma);
  uint8_t* dx = in_place ? reinterpret_cast<uint8_t*>(args.dy) : sim.Alloc<uint8_t>(n * elem);
  args.dx = SimHarness::Address(dx);
  float* rms = sim.Alloc<float>(p.rows);
  std::copy(p.rms.begin(), p.rms.end(), rms);
  args.rms = plan->DataFlow().reads_rms ? SimHarness::Address(rms) : 0;
  float* dgamma = sim.Alloc<float>(p.hidden);
  std::fill(dgamma, dgamma + p.hidden, -1.0f);  // the batched kernel's Run zeroes it first
  args.dgamma = SimHarness::Address(dgamma);
  args.rows = p.rows;
  args.hidden_dim = p.hidden;
  args.eps = p.eps;
  EXPECT_EQ(plan->DataFlow().writes_dgamma, !IsWarpKernel(s));
  const absl::Status status = plan->Run(args, *launcher);
  EXPECT_TRUE(status.ok()) << status;
  Result out;
  out.dx = kernel_testing::DecodeElements(absl::MakeConstSpan(dx, n * elem), s.dtype);
  out.dgamma.assign(dgamma, dgamma + p.hidden);
  out.reports = launcher->reports();
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const char* what) {
  const absl::Status s = kernel_testing::CheckClose(got, want, tolerance, what);
  EXPECT_TRUE(s.ok()) << s.message();
}

class TruenoKernelOnInterpreter : public ::testing::TestWithParam<Shape> {};

TEST_P(TruenoKernelOnInterpreter, MatchesReferenceBackward) {
  const Shape& s = GetParam();
  const BackwardProblem p = MakeProblem(s);
  const Result got = RunOnInterpreter(s, p);
  ASSERT_EQ(got.reports.size(), 1u);
  EXPECT_EQ(got.reports[0].finding, Finding::kNone);
  EXPECT_GT(got.reports[0].thread_instructions, 0u);

  // The warp kernel takes the forward's rms.
  const kernel_testing::BackwardReference want = kernel_testing::ReferenceFor(p, IsWarpKernel(s));
  ExpectClose(got.dx, want.dx, DxTolerance(s.dtype), "dx");
  if (!IsWarpKernel(s)) ExpectClose(got.dgamma, want.dgamma, kRelativeTolerance, "dgamma");
}

// A device whose grid.x limit is below what the rows need: the plan launches in pieces, each
// with its rows' pointers, and the result is the same as one launch.
TEST(TruenoKernelPieces, ALowGridLimitSplitsTheLaunchWithoutChangingTheResult) {
  for (const Shape& s : {Shape{"batched_rms_norm_backward", 33, 7, 90, 1e-5f},
                         Shape{"rms_norm_backward", 17, 29, 90, 1e-5f, DType::kF16}}) {
    const BackwardProblem p = MakeProblem(s);
    const Result whole = RunOnInterpreter(s, p);
    const Result pieces = RunOnInterpreter(s, p, /*max_grid_x=*/2);
    // batched: one block per row, so 7 rows in pieces of 2; warp: 8 rows per block, 29 rows
    // in pieces of 15 and 14 rows (2 blocks each).
    EXPECT_EQ(whole.reports.size(), 1u) << s.kernel;
    EXPECT_EQ(pieces.reports.size(), IsWarpKernel(s) ? 2u : 4u) << s.kernel;
    EXPECT_EQ(pieces.dx, whole.dx) << s.kernel;
    ExpectClose(pieces.dgamma, whole.dgamma, kRelativeTolerance, "dgamma");
    ExpectClose(pieces.dx, kernel_testing::ReferenceFor(p, IsWarpKernel(s)).dx,
                DxTolerance(s.dtype), "dx");
  }
}

TEST(TruenoKernelInPlace, DxOverDyGivesTheOutOfPlaceBits) {
  // Each lane reads the dy of its columns before it writes their dx (the warp kernel: one column
  // per lane; the batched kernel: the same lane's columns in both passes), and no lane writes a
  // column another reads.
  for (const Shape& s : {Shape{"rms_norm_backward", 7, 19, 80, 1e-5f},
                         Shape{"rms_norm_backward", 32, 9, 80, 1e-5f, DType::kBF16},
                         Shape{"batched_rms_norm_backward", 33, 5, 80, 1e-5f},
                         Shape{"batched_rms_norm_backward", 1000, 3, 80, 1e-5f, DType::kBF16}}) {
    const BackwardProblem p = MakeProblem(s);
    const Result apart = RunOnInterpreter(s, p);
    const Result over = RunOnInterpreter(s, p, kernels::kMaxGridX, /*in_place=*/true);
    ASSERT_EQ(apart.dx.size(), over.dx.size());
    EXPECT_EQ(std::memcmp(apart.dx.data(), over.dx.data(), 4 * apart.dx.size()), 0)
        << ShapeName({s, 0});
    if (IsWarpKernel(s)) continue;
    // The batched kernel's grad_gamma is a sum of atomics: compare within the f32 tolerance.
    ExpectClose(over.dgamma, apart.dgamma, kRelativeTolerance, "dgamma in place");
  }
}

INSTANTIATE_TEST_SUITE_P(WarpKernelAllHiddenDims, TruenoKernelOnInterpreter, ::testing::ValuesIn([] {
                           std::vector<Shape> shapes;
                           for (uint32_t h = 1; h <= 32; ++h)
                             shapes.push_back({"rms_norm_backward", h, 7, 90, 1e-5f});
                           shapes.push_back({"rms_norm_backward", 32, 9, 75, 1e-5f});
                           shapes.push_back({"rms_norm_backward", 17, 1, 100, 1e-5f});
                           return shapes;
                         }()),
                         ShapeName);

INSTANTIATE_TEST_SUITE_P(
    HalfPrecisionElements, TruenoKernelOnInterpreter, ::testing::ValuesIn([] {
      std::vector<Shape> shapes;
      for (DType dtype : {DType::kF16, DType::kBF16}) {
        for (uint32_t h : {1u, 7u, 32u})
          shapes.push_back({"rms_norm_backward", h, 9, 90, 1e-5f, dtype});
        for (uint32_t h : {1u, 33u, 100u, 896u}) {
          shapes.push_back({"batched_rms_norm_backward", h, 5, 80, 1e-5f, dtype});
        }
      }
      return shapes;
    }()),
    ShapeName);

INSTANTIATE_TEST_SUITE_P(
    BatchedKernelShapes, TruenoKernelOnInterpreter, ::testing::ValuesIn([] {
      std::vector<Shape> shapes;
      for (uint32_t h : {1u, 2u, 3u, 7u, 16u, 31u, 32u, 33u, 63u, 64u, 65u, 100u, 127u, 255u, 256u,
                         257u, 896u, 1024u}) {
        shapes.push_back({"batched_rms_norm_backward", h, 5, 90, 1e-5f});
      }
      shapes.push_back({"batched_rms_norm_backward", 4096, 3, 90, 1e-5f});
      shapes.push_back({"batched_rms_norm_backward", 8192, 2, 90, 1e-5f});
      shapes.push_back({"batched_rms_norm_backward", 896, 16, 80, 1e-5f});
      shapes.push_back({"batched_rms_norm_backward", 33, 1, 75, 1e-5f});
      shapes.push_back({"batched_rms_norm_backward", 100, 3, 100, 1e-2f});  // eps read at run time
      return shapes;
    }()),
    ShapeName);

// The interpreter's gradients against central finite differences of the forward loss
// L = sum y * dy, for dx (both kernels) and dgamma (batched).
class TruenoKernelFiniteDifferences : public ::testing::TestWithParam<Shape> {};

TEST_P(TruenoKernelFiniteDifferences, MatchCentralDifferencesOfTheForwardLoss) {
  const Shape& s = GetParam();
  const BackwardProblem p = MakeProblem(s);
  const Result got = RunOnInterpreter(s, p);
  ASSERT_EQ(got.dx.size(), p.x.size());
  auto loss = [&](const std::vector<float>& x, const std::vector<float>& gamma) {
    return kernels::ReferenceForwardLoss(x, gamma, p.dy, p.rows, p.hidden, p.eps);
  };
  const float h = 1e-3f;
  for (size_t i = 0; i < p.x.size(); ++i) {
    std::vector<float> plus = p.x, minus = p.x;
    plus[i] += h;
    minus[i] -= h;
    const double fd = (loss(plus, p.gamma) - loss(minus, p.gamma)) /
                      (static_cast<double>(plus[i]) - static_cast<double>(minus[i]));
    EXPECT_LE(std::fabs(got.dx[i] - fd), kFiniteDifferenceTolerance * std::max(1.0, std::fabs(fd)))
        << "dx[" << i << "]";
  }
  if (IsWarpKernel(s)) return;
  for (uint32_t i = 0; i < p.hidden; ++i) {
    std::vector<float> plus = p.gamma, minus = p.gamma;
    plus[i] += h;
    minus[i] -= h;
    const double fd = (loss(p.x, plus) - loss(p.x, minus)) /
                      (static_cast<double>(plus[i]) - static_cast<double>(minus[i]));
    EXPECT_LE(std::fabs(got.dgamma[i] - fd),
              kFiniteDifferenceTolerance * std::max(1.0, std::fabs(fd)))
        << "dgamma[" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TruenoKernelFiniteDifferences,
                         ::testing::Values(Shape{"rms_norm_backward", 1, 3, 90, 1e-5f},
                                           Shape{"rms_norm_backward", 13, 3, 90, 1e-5f},
                                           Shape{"rms_norm_backward", 32, 2, 90, 1e-5f},
                                           Shape{"batched_rms_norm_backward", 1, 3, 90, 1e-5f},
                                           Shape{"batched_rms_norm_backward", 7, 3, 90, 1e-5f},
                                           Shape{"batched_rms_norm_backward", 33, 2, 90, 1e-5f},
                                           Shape{"batched_rms_norm_backward", 100, 2, 90, 1e-5f}),
                         ShapeName);

}  // namespace
}  // namespace normgrad::ptxsim
