// Both seed kernels, as kernels/ emits them (the PTX text), executed by the interpreter: dx and
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
#include "kernels/kernel.h"
#include "kernels/reference.h"
#include "tests/ptxsim/sim_harness.h"

namespace normgrad::ptxsim {
namespace {

using kernels::BackwardInputs;
using kernels::DType;
using kernels::FindKernel;
using kernels::KernelConfig;
using kernels::LaunchGeometry;

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

// Element storage: f32 as is, f16/bf16 rounded to nearest even.
uint16_t ToBits16(float f, DType dtype) {
  if (dtype == DType::kF16) {
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBits16(uint16_t bits, DType dtype) {
  if (dtype == DType::kF16) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
  }
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float RoundToElement(float f, DType dtype) {
  return dtype == DType::kF32 ? f : FromBits16(ToBits16(f, dtype), dtype);
}
double DxTolerance(DType dtype) {
  return dtype == DType::kF32 ? 1e-5 : dtype == DType::kF16 ? 5e-4 : 4e-3;
}

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return absl::StrCat(std::string(s.kernel) == "rms_norm_backward" ? "warp" : "batched", "_",
                      kernels::DTypeName(s.dtype), "_h", s.hidden_dim, "_rows", s.rows, "_sm",
                      s.target_sm, s.eps == 1e-5f ? "" : "_eps1em2");
}

// Deterministic inputs in [-1, 1) (x, dy) and [0.5, 1.5) (gamma).
std::vector<float> Fill(size_t n, uint32_t seed, float lo, float hi) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 1;
  for (float& f : v) {
    s = s * 1664525u + 1013904223u;
    f = lo + (hi - lo) * static_cast<float>(s >> 8) / static_cast<float>(1u << 24);
  }
  return v;
}

struct Problem {
  std::vector<float> x, dy, gamma, rms;
  uint32_t rows = 0, hidden = 0;
  float eps = 1e-5f;
};

Problem MakeProblem(const Shape& s) {
  Problem p;
  p.rows = s.rows;
  p.hidden = s.hidden_dim;
  p.eps = s.eps;
  p.x = Fill(size_t{s.rows} * s.hidden_dim, 1 + s.hidden_dim, -1.0f, 1.0f);
  p.dy = Fill(size_t{s.rows} * s.hidden_dim, 7 + s.hidden_dim, -1.0f, 1.0f);
  p.gamma = Fill(s.hidden_dim, 13 + s.hidden_dim, 0.5f, 1.5f);
  for (std::vector<float>* v : {&p.x, &p.dy, &p.gamma}) {
    for (float& f : *v) f = RoundToElement(f, s.dtype);  // what the kernel will read
  }
  p.rms.resize(s.rows);
  for (uint32_t r = 0; r < s.rows; ++r) {
    double sum = 0;
    for (uint32_t i = 0; i < s.hidden_dim; ++i) {
      const double v = p.x[size_t{r} * s.hidden_dim + i];
      sum += v * v;
    }
    p.rms[r] = static_cast<float>(std::sqrt(sum / s.hidden_dim + s.eps));
  }
  return p;
}

struct Result {
  std::vector<float> dx, dgamma;
};

// Emits the kernel's PTX, launches it with the kernel's own geometry, returns dx (and dgamma).
Result RunOnInterpreter(const Shape& s, const Problem& p, LaunchReport* report) {
  const kernels::Kernel* kernel = FindKernel(s.kernel);
  EXPECT_NE(kernel, nullptr);
  KernelConfig config;
  config.hidden_dim = s.hidden_dim;
  config.target_sm = s.target_sm;
  config.dtype = s.dtype;
  absl::StatusOr<kernels::EmittedPtx> ptx = kernel->Emit(config);
  EXPECT_TRUE(ptx.ok()) << ptx.status();
  if (!ptx.ok()) return {};
  const LaunchGeometry g = kernel->Geometry(config, s.rows);

  SimHarness sim;
  const size_t n = size_t{p.rows} * p.hidden;
  const size_t elem = s.dtype == DType::kF32 ? 4 : 2;
  // x, dy, gamma, dx in the element type; rms and dgamma are f32 for every dtype.
  auto store = [&](const std::vector<float>& values) {
    uint8_t* buffer = sim.Alloc<uint8_t>(values.size() * elem);
    for (size_t i = 0; i < values.size(); ++i) {
      if (elem == 4) {
        std::memcpy(buffer + 4 * i, &values[i], 4);
      } else {
        const uint16_t bits = ToBits16(values[i], s.dtype);
        std::memcpy(buffer + 2 * i, &bits, 2);
      }
    }
    return buffer;
  };
  uint8_t* x = store(p.x);
  uint8_t* dy = store(p.dy);
  uint8_t* gamma = store(p.gamma);
  uint8_t* dx = sim.Alloc<uint8_t>(n * elem);
  float* rms = sim.Alloc<float>(p.rows);
  float* dgamma = sim.Alloc<float>(p.hidden);  // zeroed: the batched kernel accumulates
  std::copy(p.rms.begin(), p.rms.end(), rms);

  KernelArgs args;
  const bool warp_kernel = std::string(s.kernel) == "rms_norm_backward";
  if (warp_kernel) {
    args.Add(SimHarness::Address(x))
        .Add(SimHarness::Address(gamma))
        .Add(SimHarness::Address(rms))
        .Add(SimHarness::Address(dy))
        .Add(SimHarness::Address(dx))
        .Add(p.rows)
        .Add(p.hidden);
  } else {
    args.Add(SimHarness::Address(x))
        .Add(SimHarness::Address(gamma))
        .Add(SimHarness::Address(dy))
        .Add(SimHarness::Address(dx))
        .Add(SimHarness::Address(dgamma))
        .Add(p.rows)
        .Add(p.hidden)
        .Add(p.eps);
  }
  EXPECT_EQ(ptx->params.size(), warp_kernel ? 7u : 8u);
  absl::Status status = sim.Run(ptx->text, ptx->entry, {g.grid[0], g.grid[1], g.grid[2]},
                                {g.block[0], g.block[1], g.block[2]}, args, report, g.shared_bytes);
  EXPECT_TRUE(status.ok()) << status;
  Result out;
  out.dx.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (elem == 4) {
      std::memcpy(&out.dx[i], dx + 4 * i, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, dx + 2 * i, 2);
      out.dx[i] = FromBits16(bits, s.dtype);
    }
  }
  out.dgamma.assign(dgamma, dgamma + p.hidden);
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = tolerance * std::max(1.0, std::fabs(static_cast<double>(want[i])));
    if (std::fabs(static_cast<double>(got[i]) - want[i]) > bound && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", expected " << want[i]
                    << " (bound " << bound << ")";
    }
  }
}

class SeedKernelOnInterpreter : public ::testing::TestWithParam<Shape> {};

TEST_P(SeedKernelOnInterpreter, MatchesReferenceBackward) {
  const Shape& s = GetParam();
  const Problem p = MakeProblem(s);
  LaunchReport report;
  const Result got = RunOnInterpreter(s, p, &report);
  EXPECT_EQ(report.finding, Finding::kNone);
  EXPECT_GT(report.thread_instructions, 0u);

  const bool warp_kernel = std::string(s.kernel) == "rms_norm_backward";
  std::vector<float> dx(p.x.size()), dgamma(p.hidden);
  BackwardInputs in{p.x, p.dy, p.gamma, {}, p.rows, p.hidden, p.eps};
  if (warp_kernel) in.rms = p.rms;  // the warp kernel takes the forward's rms
  kernels::ReferenceBackward(in, absl::MakeSpan(dx), absl::MakeSpan(dgamma));
  ExpectClose(got.dx, dx, DxTolerance(s.dtype), "dx");
  if (!warp_kernel) ExpectClose(got.dgamma, dgamma, kRelativeTolerance, "dgamma");
}

INSTANTIATE_TEST_SUITE_P(WarpKernelAllHiddenDims, SeedKernelOnInterpreter, ::testing::ValuesIn([] {
                           std::vector<Shape> shapes;
                           for (uint32_t h = 1; h <= 32; ++h)
                             shapes.push_back({"rms_norm_backward", h, 7, 90, 1e-5f});
                           shapes.push_back({"rms_norm_backward", 32, 9, 75, 1e-5f});
                           shapes.push_back({"rms_norm_backward", 17, 1, 100, 1e-5f});
                           return shapes;
                         }()),
                         ShapeName);

INSTANTIATE_TEST_SUITE_P(
    HalfPrecisionElements, SeedKernelOnInterpreter, ::testing::ValuesIn([] {
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
    BatchedKernelShapes, SeedKernelOnInterpreter, ::testing::ValuesIn([] {
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
class SeedKernelFiniteDifferences : public ::testing::TestWithParam<Shape> {};

TEST_P(SeedKernelFiniteDifferences, MatchCentralDifferencesOfTheForwardLoss) {
  const Shape& s = GetParam();
  const Problem p = MakeProblem(s);
  const Result got = RunOnInterpreter(s, p, nullptr);
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
  if (std::string(s.kernel) == "rms_norm_backward") return;
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

INSTANTIATE_TEST_SUITE_P(Shapes, SeedKernelFiniteDifferences,
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
