// rms_norm_backward_row_resident + rms_norm_backward_dgamma_reduce, as kernels/ emits them,
// executed by the interpreter (with its sanitizer: exact-size buffers, alignment, barriers,
// shuffles) against ReferenceBackward: dx within 1e-5 (f32) / 5e-4 (f16) / 4e-3 (bf16) relative to
// max(1, |ref|) (half an ulp of the element type plus the f32 error; the reference unrounded),
// dgamma (f32 partials, fixed-order sum) within 1e-5.
// Shapes cover hidden_dim 1, 3, 33, 4095, 4097, 16384 for every dtype, one row and many (more
// rows than blocks, so blocks loop), 16-byte-aligned buffers (vector path) and buffers offset by 4
// bytes (element path), rms recomputed and given. grad_gamma is bitwise reproducible.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
#include "kernels/launch.h"
#include "tests/ptxsim/backward_problem.h"
#include "tests/ptxsim/sim_harness.h"
#include "tests/ptxsim/sim_launcher.h"

namespace normgrad::ptxsim {
namespace {

using kernel_testing::BackwardProblem;
using kernel_testing::CheckClose;
using kernel_testing::DecodeElements;
using kernel_testing::DxTolerance;
using kernel_testing::EncodeElements;
using kernel_testing::MakeBackwardProblem;
using kernel_testing::ReferenceFor;
using kernel_testing::RoundToElement;
using kernels::BackwardArgs;
using kernels::BackwardPlan;
using kernels::DType;
using kernels::FindKernel;
using kernels::KernelConfig;

constexpr char kMain[] = "rms_norm_backward_row_resident";
constexpr char kReduce[] = "rms_norm_backward_dgamma_reduce";

struct Case {
  DType dtype;
  uint32_t hidden;
  uint32_t rows;
  bool offset = false;     // every buffer starts 4 bytes past a 16-byte boundary
  bool given_rms = false;  // the forward's rms is passed
  int target_sm = 80;
};

BackwardProblem MakeProblem(const Case& c) {
  return MakeBackwardProblem(c.dtype, c.rows, c.hidden);
}

struct Result {
  bool ok = false;
  std::vector<float> dx;
  std::vector<float> dgamma;        // f32 reduce (the plan's)
  std::vector<uint8_t> dgamma_raw;  // the reduce in the case's dtype, as stored
  uint32_t partial_rows = 0;
};

// Runs the row-resident plan (main kernel + f32 reduce) on the interpreter, then the reduce once
// more with a dtype output; sm_count 1 so that blocks loop over several rows.
Result RunBoth(const Case& c, const BackwardProblem& p, uint32_t sm_count = 1) {
  Result out;
  const kernels::Kernel* main = FindKernel(kMain);
  const kernels::Kernel* reduce = FindKernel(kReduce);
  if (main == nullptr || reduce == nullptr) {
    ADD_FAILURE() << "kernels not registered";
    return out;
  }
  KernelConfig config;
  config.hidden_dim = c.hidden;
  config.dtype = c.dtype;
  config.target_sm = c.target_sm;
  config.sm_count = sm_count;
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*main, config);
  if (!plan.ok()) {
    ADD_FAILURE() << plan.status();
    return out;
  }
  SimHarness sim;
  absl::StatusOr<SimLauncher> launcher = SimLauncher::ForPlan(&sim, *plan);
  absl::StatusOr<kernels::EmittedPtx> reduce_dtype = reduce->Emit(config);
  if (!launcher.ok() || !reduce_dtype.ok()) {
    ADD_FAILURE() << launcher.status() << " " << reduce_dtype.status();
    return out;
  }
  out.partial_rows = main->Geometry(config, c.rows).grid[0];

  const size_t elem = kernels::DTypeBytes(c.dtype);
  const size_t shift = c.offset ? 4 : 0;
  // With `shift`, a buffer starts 4 bytes past a 16-byte boundary (the element path).
  auto place = [&](size_t bytes) -> uint8_t* {
    if (shift == 0) return sim.Alloc<uint8_t>(bytes);
    // Alloc registers exactly what it is asked for; ask for shift + bytes and skip the shift.
    uint8_t* base = sim.Alloc<uint8_t>(bytes + shift);
    return base + shift;
  };
  auto store = [&](const std::vector<float>& values) {
    const std::vector<uint8_t> bytes = EncodeElements(values, c.dtype);
    uint8_t* b = place(bytes.size());
    std::copy(bytes.begin(), bytes.end(), b);
    return b;
  };
  const size_t n = size_t{c.rows} * c.hidden;
  BackwardArgs args;
  args.x = SimHarness::Address(store(p.x));
  args.dy = SimHarness::Address(store(p.dy));
  args.gamma = SimHarness::Address(store(p.gamma));
  uint8_t* dx = place(n * elem);
  args.dx = SimHarness::Address(dx);
  float* rms = sim.Alloc<float>(c.rows);
  std::copy(p.rms.begin(), p.rms.end(), rms);
  args.rms = c.given_rms ? SimHarness::Address(rms) : 0;
  const size_t partial_floats = plan->WorkspaceBytes(c.rows) / sizeof(float);
  float* partials = sim.Alloc<float>(partial_floats);
  std::fill(partials, partials + partial_floats, std::nanf(""));
  args.workspace = SimHarness::Address(partials);
  float* dgamma = sim.Alloc<float>(c.hidden);
  args.dgamma = SimHarness::Address(dgamma);
  args.rows = c.rows;
  args.hidden_dim = c.hidden;
  args.eps = 1e-5f;
  if (absl::Status s = plan->Run(args, *launcher); !s.ok()) {
    ADD_FAILURE() << s;
    return out;
  }

  // The reduce alone, writing the case's dtype.
  uint8_t* dgamma_dtype = sim.Alloc<uint8_t>(c.hidden * elem);
  kernels::KernelParamValues values;
  values.dgamma_partials = SimHarness::Address(partials);
  values.dgamma = SimHarness::Address(dgamma_dtype);
  values.num_partials = out.partial_rows;
  values.hidden_dim = c.hidden;
  absl::StatusOr<kernels::PackedArgs> packed = kernels::PackArgs(reduce_dtype->params, values);
  if (!packed.ok()) {
    ADD_FAILURE() << packed.status();
    return out;
  }
  const kernels::LaunchGeometry rg = reduce->Geometry(config, out.partial_rows);
  if (absl::Status s = sim.Run(reduce_dtype->text, reduce_dtype->entry, {rg.grid[0], 1, 1},
                               {rg.block[0], 1, 1}, packed->pointers());
      !s.ok()) {
    ADD_FAILURE() << s;
    return out;
  }
  out.dx = DecodeElements(absl::MakeConstSpan(dx, n * elem), c.dtype);
  out.dgamma.assign(dgamma, dgamma + c.hidden);
  out.dgamma_raw.assign(dgamma_dtype, dgamma_dtype + c.hidden * elem);
  out.ok = true;
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const char* what) {
  const absl::Status s = CheckClose(got, want, tolerance, what);
  EXPECT_TRUE(s.ok()) << s.message();
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat(kernels::DTypeName(c.dtype), "_h", c.hidden, "_rows", c.rows,
                      c.offset ? "_offset4" : "_aligned", c.given_rms ? "_rms" : "");
}

class RowResidentOnInterpreter : public ::testing::TestWithParam<Case> {};

TEST_P(RowResidentOnInterpreter, MatchesTheReference) {
  const Case& c = GetParam();
  const BackwardProblem p = MakeProblem(c);
  const Result r = RunBoth(c, p);
  ASSERT_TRUE(r.ok);
  const kernel_testing::BackwardReference want = ReferenceFor(p, c.given_rms);
  // Against the unrounded reference: half an ulp of the element type plus the f32 error.
  ExpectClose(r.dx, want.dx, DxTolerance(c.dtype), "dx");
  ExpectClose(r.dgamma, want.dgamma, 1e-5, "dgamma");
  // The dtype output of the reduce is the f32 sum rounded once to nearest even.
  const std::vector<float> dgamma_dtype = DecodeElements(r.dgamma_raw, c.dtype);
  for (uint32_t i = 0; i < c.hidden; ++i) {
    ASSERT_EQ(dgamma_dtype[i], RoundToElement(r.dgamma[i], c.dtype))
        << "dgamma in dtype, column " << i;
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (uint32_t h : {1u, 3u, 33u, 4095u, 4097u, 16384u}) {
      const uint32_t many = h >= 4095 ? 11 : 37;
      out.push_back({d, h, 1});
      out.push_back({d, h, many});
      out.push_back({d, h, many, /*offset=*/true});
    }
    out.push_back({d, 896, 19, false, /*given_rms=*/true});
    out.push_back({d, 4096, 9, true, /*given_rms=*/true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowResidentOnInterpreter, ::testing::ValuesIn(Cases()), CaseName);

TEST(RowResidentDeterminism, TwoRunsGiveTheSameBits) {
  for (DType d : {DType::kF32, DType::kBF16}) {
    const Case c{d, 4097, 23};
    const BackwardProblem p = MakeProblem(c);
    const Result a = RunBoth(c, p);
    const Result b = RunBoth(c, p);
    ASSERT_TRUE(a.ok && b.ok);
    ASSERT_EQ(0, std::memcmp(a.dgamma.data(), b.dgamma.data(), 4 * c.hidden));
    ASSERT_EQ(0, std::memcmp(a.dx.data(), b.dx.data(), 4 * a.dx.size()));
  }
}

TEST(RowResidentDeterminism, DxDoesNotDependOnTheGridAndDgammaStaysWithinTolerance) {
  // G changes with sm_count: dx is per row (the same bits); dgamma is summed in another grouping,
  // so it may differ in the last bits but stays within the f32 tolerance of the reference.
  const Case c{DType::kF32, 896, 29};
  const BackwardProblem p = MakeProblem(c);
  const Result one = RunBoth(c, p, 1);
  const Result many = RunBoth(c, p, 3);
  ASSERT_TRUE(one.ok && many.ok);
  EXPECT_NE(one.partial_rows, many.partial_rows);
  ASSERT_EQ(0, std::memcmp(one.dx.data(), many.dx.data(), 4 * one.dx.size()));
  ExpectClose(one.dgamma, many.dgamma, 1e-5, "dgamma across grids");
}

TEST(RowResidentDgammaReduce, SumsHundredsOfPartialRowsInAFixedOrder) {
  // 40 SMs x 8 blocks: 300 rows give 300 partial rows, so every warp of the reduce loops several
  // times over its rows (16 groups x 8 loads per step) and some loads fall past the last row.
  for (DType d : {DType::kF32, DType::kBF16}) {
    const Case c{d, 33, 300};
    const BackwardProblem p = MakeProblem(c);
    const Result a = RunBoth(c, p, 40);
    const Result b = RunBoth(c, p, 40);
    ASSERT_TRUE(a.ok && b.ok);
    EXPECT_EQ(a.partial_rows, 300u);
    ExpectClose(a.dgamma, ReferenceFor(p, false).dgamma, 1e-5, "dgamma");
    ASSERT_EQ(0, std::memcmp(a.dgamma.data(), b.dgamma.data(), 4 * c.hidden));
  }
}

TEST(RowResidentVectorPath, AlignedAndOffsetBuffersGiveTheSameBits) {
  // The 16-byte path and the element path compute the same f32 operations in the same order.
  for (DType d : {DType::kF32, DType::kF16}) {
    Case aligned{d, 4096, 5};
    Case offset = aligned;
    offset.offset = true;
    const BackwardProblem p = MakeProblem(aligned);
    const Result a = RunBoth(aligned, p);
    const Result b = RunBoth(offset, p);
    ASSERT_TRUE(a.ok && b.ok);
    ASSERT_EQ(0, std::memcmp(a.dx.data(), b.dx.data(), 4 * a.dx.size()));
    ASSERT_EQ(0, std::memcmp(a.dgamma.data(), b.dgamma.data(), 4 * a.dgamma.size()));
  }
}

}  // namespace
}  // namespace normgrad::ptxsim
