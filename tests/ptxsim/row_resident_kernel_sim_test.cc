// rms_norm_backward_row_resident (one launch: dx and grad_gamma through its last-block-done
// tree), as kernels/ emits it, executed by the interpreter
// (with its sanitizer: exact-size buffers, alignment, barriers, shuffles) against
// ReferenceBackward: dx within 1e-5 (f32) / 5e-4 (f16) / 4e-3 (bf16) relative to max(1, |ref|)
// (half an ulp of the element type plus the f32 error; the reference unrounded), dgamma (f32
// partial sums, fixed-order tree) within 1e-5.
// Shapes cover hidden_dim 1, 3, 33, 4095, 4097, 16384 for every dtype, one row and many (more
// rows than blocks, so blocks loop), 16-byte-aligned buffers (vector path) and buffers offset by 4
// bytes (element path), rms recomputed and given. grad_gamma is bitwise reproducible, whichever
// block arrives last: the interpreter also runs the blocks in reverse order.
// Variants (gamma offset 0, 1, -0.5; no gamma; casting llama, gemma, none; f32, bf16, f16; held
// and streamed rows) against VariantReferenceFor, the spec's math with its roundings, within the
// same tolerances; dx written over dy (in place) gives the out-of-place bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/backward_kernel.h"
#include "tests/common/half_precision_bound.h"
#include "tests/ptxsim/backward_problem.h"
#include "tests/ptxsim/sim/sim_harness.h"
#include "tests/ptxsim/sim/sim_launcher.h"

namespace normgrad::ptxsim {
namespace {

using kernel_testing::BackwardProblem;
using kernel_testing::CheckClose;
using kernel_testing::DecodeElements;
using kernel_testing::DxTolerance;
using kernel_testing::EncodeElements;
using kernel_testing::MakeBackwardProblem;
using kernel_testing::ReferenceFor;
using kernels::BackwardArgs;
using kernels::BackwardPlan;
using kernels::DType;
using kernels::DTypeName;
using kernels::FindKernel;
using kernels::KernelConfig;

constexpr char kMain[] = "rms_norm_backward_row_resident";

struct Case {
  DType dtype;
  uint32_t hidden;
  uint32_t rows;
  bool offset = false;     // every buffer starts 4 bytes past a 16-byte boundary
  bool given_rms = false;  // the forward's rms is passed
  int target_sm = 80;
  kernels::NormVariant variant = {};
  bool in_place = false;  // dx written over dy (grad_input_ptr == grad_output_ptr)
};

BackwardProblem MakeProblem(const Case& c) {
  return MakeBackwardProblem(c.dtype, c.rows, c.hidden);
}

struct Result {
  bool ok = false;
  std::vector<float> dx;
  std::vector<float> dgamma;  // f32 (the plan's)
  uint32_t blocks = 0;        // G
  bool semaphores_left_zero = false;
};

// Runs the row-resident plan (one launch) on the interpreter, `runs` times on the same
// semaphores (zeroed once, as the backend does), blocks in index order or reversed; sm_count 1
// so that blocks loop over several rows. The workspace starts as NaN: a tree row read before it
// was written would poison dgamma.
Result RunPlan(const Case& c, const BackwardProblem& p, uint32_t sm_count = 1,
               bool reverse_blocks = false, int runs = 1) {
  Result out;
  const kernels::BackwardKernel* main = FindKernel(kMain);
  if (main == nullptr) {
    ADD_FAILURE() << "kernel not registered";
    return out;
  }
  KernelConfig config;
  config.hidden_dim = c.hidden;
  config.dtype = c.dtype;
  config.target_sm = c.target_sm;
  config.sm_count = sm_count;
  config.variant = c.variant;
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*main, config);
  if (!plan.ok()) {
    ADD_FAILURE() << plan.status();
    return out;
  }
  SimHarness sim;
  sim.set_reverse_block_order(reverse_blocks);
  absl::StatusOr<SimLauncher> launcher = SimLauncher::ForPlan(&sim, *plan);
  if (!launcher.ok()) {
    ADD_FAILURE() << launcher.status();
    return out;
  }
  out.blocks = main->Geometry(config, c.rows).grid[0];

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
  const bool has_gamma = c.variant.has_gamma;
  BackwardArgs args;
  args.x = SimHarness::Address(store(p.x));
  uint8_t* dy = store(p.dy);
  args.dy = SimHarness::Address(dy);
  // Without gamma no gamma or dgamma is passed (0): the sanitizer fails any access to them.
  args.gamma = has_gamma ? SimHarness::Address(store(p.gamma)) : 0;
  uint8_t* dx = c.in_place ? dy : place(n * elem);
  args.dx = SimHarness::Address(dx);
  float* rms = sim.Alloc<float>(c.rows);
  std::copy(p.rms.begin(), p.rms.end(), rms);
  args.rms = c.given_rms ? SimHarness::Address(rms) : 0;
  // The workspace is 16-byte aligned (the plan's contract); dgamma shifts with the others.
  const size_t tree_floats = plan->WorkspaceBytes(c.rows) / sizeof(float);
  float* tree = tree_floats == 0 ? nullptr : sim.Alloc<float>(tree_floats);
  if (tree != nullptr) std::fill(tree, tree + tree_floats, std::nanf(""));
  args.workspace = tree == nullptr ? 0 : SimHarness::Address(tree);
  const size_t sem_count = plan->SemaphoreBytes(c.rows) / sizeof(uint32_t);
  uint32_t* sems = sem_count == 0 ? nullptr : sim.Alloc<uint32_t>(sem_count);
  args.semaphores = sems == nullptr ? 0 : SimHarness::Address(sems);
  float* dgamma =
      has_gamma ? reinterpret_cast<float*>(place(c.hidden * sizeof(float))) : nullptr;
  args.dgamma = has_gamma ? SimHarness::Address(dgamma) : 0;
  args.rows = c.rows;
  args.hidden_dim = c.hidden;
  args.eps = 1e-5f;
  for (int run = 0; run < runs; ++run) {
    if (has_gamma) std::fill(dgamma, dgamma + c.hidden, std::nanf(""));
    if (absl::Status s = plan->Run(args, *launcher); !s.ok()) {
      ADD_FAILURE() << s;
      return out;
    }
  }
  out.semaphores_left_zero = std::all_of(sems, sems + sem_count, [](uint32_t v) { return v == 0; });
  out.dx = DecodeElements(absl::MakeConstSpan(dx, n * elem), c.dtype);
  if (has_gamma) out.dgamma.assign(dgamma, dgamma + c.hidden);
  out.ok = true;
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const char* what) {
  const absl::Status s = CheckClose(got, want, tolerance, what);
  EXPECT_TRUE(s.ok()) << s.message();
}

// Whether `a` and `b` hold the same floats bit for bit.
bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);
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
  const Result r = RunPlan(c, p);
  ASSERT_TRUE(r.ok);
  const kernel_testing::BackwardReference want = ReferenceFor(p, c.given_rms);
  // Against the unrounded reference: half an ulp of the element type plus the f32 error.
  ExpectClose(r.dx, want.dx, DxTolerance(c.dtype), "dx");
  ExpectClose(r.dgamma, want.dgamma, 1e-5, "dgamma");
  EXPECT_TRUE(r.semaphores_left_zero);
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
    // Streamed rows (hidden_dim > 16384): one block loops over the rows (sm_count 1), so its
    // workspace row is started by the first row and added to by the others.
    for (uint32_t h : {16385u, 16392u, 65536u}) {
      out.push_back({d, h, 1});
      out.push_back({d, h, 3, /*offset=*/h == 16392});
    }
    out.push_back({d, 20000, 3, false, /*given_rms=*/true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowResidentOnInterpreter, ::testing::ValuesIn(Cases()), CaseName);

TEST(RowResidentDeterminism, TwoRunsGiveTheSameBits) {
  for (DType d : {DType::kF32, DType::kBF16}) {
    const Case c{d, 4097, 23};
    const BackwardProblem p = MakeProblem(c);
    const Result a = RunPlan(c, p);
    const Result b = RunPlan(c, p);
    ASSERT_TRUE(a.ok && b.ok);
    ASSERT_TRUE(SameBits(a.dgamma, b.dgamma));
    ASSERT_TRUE(SameBits(a.dx, b.dx));
  }
}

// Runs `c` on `sm_count` SMs with the blocks in index order and reversed: `blocks` blocks,
// dgamma within 1e-5 of the reference, the same dgamma and dx bits in either order and the
// semaphores left zero. `forward` receives the run in index order.
void ExpectTheSameBitsInEitherBlockOrder(const Case& c, const BackwardProblem& p, uint32_t sm_count,
                                         uint32_t blocks, Result* forward) {
  *forward = RunPlan(c, p, sm_count);
  const Result reversed = RunPlan(c, p, sm_count, /*reverse_blocks=*/true);
  ASSERT_TRUE(forward->ok && reversed.ok);
  EXPECT_EQ(forward->blocks, blocks);
  ExpectClose(forward->dgamma, ReferenceFor(p, false).dgamma, 1e-5, "dgamma");
  ASSERT_TRUE(SameBits(forward->dgamma, reversed.dgamma));
  ASSERT_TRUE(SameBits(forward->dx, reversed.dx));
  EXPECT_TRUE(forward->semaphores_left_zero && reversed.semaphores_left_zero);
}

TEST(RowResidentDgammaTree, WhicheverBlockArrivesLastTheBitsAreTheSame) {
  // 300 blocks (hidden 33: 256 threads, 4 per SM, 75 SMs): a tree of 300 -> 19 -> 2 -> 1. Run
  // in index order the highest block of each group arrives last; reversed, the lowest. Both
  // must add the same rows in the same order.
  for (DType d : {DType::kF32, DType::kBF16}) {
    const Case c{d, 33, 300};
    const BackwardProblem p = MakeProblem(c);
    Result forward;
    ASSERT_NO_FATAL_FAILURE(ExpectTheSameBitsInEitherBlockOrder(c, p, 75, 300, &forward));
  }
}

TEST(RowResidentDgammaTree, StreamedRowsTreeGivesTheSameBitsInEitherBlockOrder) {
  // Streamed rows (hidden 16392, one 1024-thread block per SM): 40 SMs and 45 rows give 40
  // blocks, a tree of 40 -> 3 -> 1 whose level-0 rows are the blocks' own workspace rows (five
  // of them hold two rows' sums); either block order adds the same rows in the same order.
  for (DType d : {DType::kF32, DType::kBF16}) {
    const Case c{d, 16392, 45};
    const BackwardProblem p = MakeProblem(c);
    Result forward;
    ASSERT_NO_FATAL_FAILURE(ExpectTheSameBitsInEitherBlockOrder(c, p, 40, 40, &forward));
    ExpectClose(forward.dx, ReferenceFor(p, false).dx, DxTolerance(d), "dx");
    // Launched again on the same semaphores: the same bits.
    const Result twice = RunPlan(c, p, 40, false, /*runs=*/2);
    ASSERT_TRUE(twice.ok);
    ASSERT_TRUE(SameBits(forward.dgamma, twice.dgamma));
  }
}

TEST(RowResidentDgammaTree, SemaphoresZeroedOnceServeLaunchAfterLaunch) {
  // Three launches on the same semaphores, never zeroed again: each leaves them zero, so each
  // gives the bits of a launch on fresh ones (a semaphore left at 1 would make a later group
  // finish early, before its last member, and read a NaN row).
  const Case c{DType::kF32, 896, 40};
  const BackwardProblem p = MakeProblem(c);
  const Result once = RunPlan(c, p, 5);
  const Result thrice = RunPlan(c, p, 5, false, /*runs=*/3);
  ASSERT_TRUE(once.ok && thrice.ok);
  EXPECT_EQ(once.blocks, 20u);
  EXPECT_TRUE(thrice.semaphores_left_zero);
  ASSERT_TRUE(SameBits(once.dgamma, thrice.dgamma));
}

TEST(RowResidentDeterminism, DxDoesNotDependOnTheGridAndDgammaStaysWithinTolerance) {
  // G changes with sm_count: dx is per row (the same bits); dgamma is summed in another grouping,
  // so it may differ in the last bits but stays within the f32 tolerance of the reference.
  const Case c{DType::kF32, 896, 29};
  const BackwardProblem p = MakeProblem(c);
  const Result one = RunPlan(c, p, 1);
  const Result many = RunPlan(c, p, 3);
  ASSERT_TRUE(one.ok && many.ok);
  EXPECT_NE(one.blocks, many.blocks);
  ASSERT_TRUE(SameBits(one.dx, many.dx));
  ExpectClose(one.dgamma, many.dgamma, 1e-5, "dgamma across grids");
}

TEST(RowResidentVectorPath, AlignedAndOffsetBuffersGiveTheSameBits) {
  // The 16-byte path and the element path compute the same f32 operations in the same order.
  for (DType d : {DType::kF32, DType::kF16}) {
    Case aligned{d, 4096, 5};
    Case offset = aligned;
    offset.offset = true;
    const BackwardProblem p = MakeProblem(aligned);
    const Result a = RunPlan(aligned, p);
    const Result b = RunPlan(offset, p);
    ASSERT_TRUE(a.ok && b.ok);
    ASSERT_TRUE(SameBits(a.dx, b.dx));
    ASSERT_TRUE(SameBits(a.dgamma, b.dgamma));
  }
}

// ---------------------------------------------------------------------------------------------
// Variants (docs/kernels.md, "Variants"): gamma offset, no gamma, casting modes.

std::string VariantCaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string offset = absl::StrCat(c.variant.gamma_offset);
  std::replace(offset.begin(), offset.end(), '-', 'm');
  std::replace(offset.begin(), offset.end(), '.', 'p');
  return absl::StrCat(kernels::DTypeName(c.dtype), "_", kernels::CastingModeName(c.variant.casting),
                      c.variant.has_gamma ? absl::StrCat("_off", offset) : "_nogamma", "_h",
                      c.hidden, "_rows", c.rows, c.given_rms ? "_rms" : "");
}

class VariantsOnInterpreter : public ::testing::TestWithParam<Case> {};

TEST_P(VariantsOnInterpreter, MatchesTheVariantReference) {
  const Case& c = GetParam();
  const BackwardProblem p = MakeProblem(c);
  // sm_count 2: two blocks, so the tree adds rows from both (and each block loops).
  const Result r = RunPlan(c, p, /*sm_count=*/2);
  ASSERT_TRUE(r.ok);
  const kernel_testing::BackwardReference want =
      kernel_testing::VariantReferenceFor(p, c.variant, c.given_rms);
  ExpectClose(r.dx, want.dx, DxTolerance(c.dtype), "dx");
  if (c.variant.has_gamma) {
    ExpectClose(r.dgamma, want.dgamma, 1e-5, "dgamma");
    EXPECT_TRUE(r.semaphores_left_zero);
  }
}

std::vector<Case> VariantCases() {
  using kernels::CastingMode;
  std::vector<Case> out;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (CastingMode mode : {CastingMode::kLlama, CastingMode::kGemma, CastingMode::kNone}) {
      std::vector<kernels::NormVariant> variants;
      for (float offset : {0.0f, 1.0f, -0.5f}) variants.push_back({offset, true, mode});
      variants.push_back({0.0f, false, mode});
      for (const kernels::NormVariant& v : variants) {
        // Held rows (1, 7, 33, 896, 1000, 4097) and streamed ones (16385), the rms given (llama's
        // grad_gamma needs the kernel's 1/rms) and, for the others, recomputed too.
        for (uint32_t h : {1u, 7u, 33u, 896u, 1000u, 4097u, 16385u}) {
          const uint32_t rows = h > 4096 ? 3 : 5;
          out.push_back({d, h, rows, /*offset=*/h == 1000, /*given_rms=*/true, 80, v});
          if (mode != CastingMode::kLlama && (h == 33 || h == 16385)) {
            out.push_back({d, h, rows, false, /*given_rms=*/false, 80, v});
          }
        }
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Variants, VariantsOnInterpreter, ::testing::ValuesIn(VariantCases()),
                         VariantCaseName);

TEST(RowResidentVariants, F32GivesTheSameBitsInEveryCastingMode) {
  // For f32 R() is the identity: one module (one key) and the same bits.
  using kernels::CastingMode;
  for (uint32_t h : {33u, 16385u}) {
    Result first;
    for (CastingMode mode : {CastingMode::kGemma, CastingMode::kLlama, CastingMode::kNone}) {
      Case c{DType::kF32, h, 3, false, true, 80, {1.0f, true, mode}};
      const Result r = RunPlan(c, MakeProblem(c), 2);
      ASSERT_TRUE(r.ok);
      if (mode == CastingMode::kGemma) {
        first = r;
        continue;
      }
      EXPECT_TRUE(SameBits(first.dx, r.dx)) << CastingModeName(mode) << " h" << h;
      EXPECT_TRUE(SameBits(first.dgamma, r.dgamma)) << CastingModeName(mode) << " h" << h;
    }
  }
}

TEST(RowResidentVariants, GradGammaIsReproducibleInEitherBlockOrder) {
  // Offset and llama casting change what is summed, not the tree: the same bits for the same G.
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (uint32_t h : {33u, 16392u}) {
      Case c{d, h, 45, false, true, 80, {-0.5f, true, kernels::CastingMode::kLlama}};
      const BackwardProblem p = MakeProblem(c);
      // 40 blocks either way: hidden 33 keeps 4 blocks per SM, streamed rows 1.
      const uint32_t sms = h == 33 ? 10 : 40;
      const Result forward = RunPlan(c, p, sms);
      const Result reversed = RunPlan(c, p, sms, /*reverse_blocks=*/true);
      ASSERT_TRUE(forward.ok && reversed.ok);
      EXPECT_EQ(forward.blocks, 40u);
      EXPECT_TRUE(SameBits(forward.dgamma, reversed.dgamma)) << DTypeName(d) << " h" << h;
      EXPECT_TRUE(SameBits(forward.dx, reversed.dx)) << DTypeName(d) << " h" << h;
    }
  }
}

// In place (dx == dy): every thread reads its columns' dy before it writes their dx, so the
// result is bit for bit the out-of-place one, held and streamed, vector and element paths.
TEST(RowResidentInPlace, DxOverDyGivesTheOutOfPlaceBits) {
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (uint32_t h : {33u, 4096u, 16385u, 16392u}) {
      for (bool no_gamma : {false, true}) {
        Case c{d, h, h > 4096 ? 3u : 7u, /*offset=*/h == 16385, false, 80};
        c.variant.has_gamma = !no_gamma;
        const BackwardProblem p = MakeProblem(c);
        const Result apart = RunPlan(c, p, 2);
        c.in_place = true;
        const Result over = RunPlan(c, p, 2);
        ASSERT_TRUE(apart.ok && over.ok);
        EXPECT_TRUE(SameBits(apart.dx, over.dx)) << DTypeName(d) << " h" << h;
        EXPECT_TRUE(SameBits(apart.dgamma, over.dgamma)) << DTypeName(d) << " h" << h;
      }
    }
  }
}

// bf16 and f16 against the bound of docs/kernels.md (one unit of the dtype plus float32's
// rounding of the terms; tests/common/half_precision_bound.h), the bound the CPU backend is held
// to, on the same hard cases: hidden 1, 7, 4099, 65536 (streamed rows), magnitudes over
// 2^-12 .. 2^12, rows where the two terms cancel, every variant. The kernels form the casting
// modes' rounded values from f32 products (Products::kF32), and grad_gamma is their f32 sum.
TEST(RowResidentHalfPrecisionBound, HardCasesOfEveryVariantStayWithinTheBound) {
  using half_bound::CountOutsideBound;
  using half_bound::HalfInputs;
  std::vector<kernels::NormVariant> variants;
  for (kernels::CastingMode casting : {kernels::CastingMode::kGemma, kernels::CastingMode::kLlama,
                                       kernels::CastingMode::kNone}) {
    for (float offset : {0.0f, 1.0f, -0.5f}) variants.push_back({offset, true, casting});
    variants.push_back({0.0f, false, casting});
  }
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (uint32_t hidden : {1u, 7u, 4099u, 65536u}) {
      for (size_t v = 0; v < variants.size(); ++v) {
        // The widest rows take one variant of each casting mode (the interpreter is slow).
        if (hidden == 65536 && v % 4 != 1) continue;
        const kernels::NormVariant& variant = variants[v];
        Case c{d, hidden, hidden >= 4099 ? 3u : 12u};
        c.variant = variant;
        // llama's n = R(x * 1/rms) rounds the kernel's own f32 1/rms: given, both use rcp(rms).
        c.given_rms = variant.casting == kernels::CastingMode::kLlama || v % 2 == 0;
        SCOPED_TRACE(absl::StrCat(DTypeName(d), " hidden ", hidden, " ", variant.Describe(),
                                  c.given_rms ? ", rms given" : ""));
        const HalfInputs in = half_bound::MakeHardInputs(d, c.rows, hidden, variant, hidden + 1);
        BackwardProblem p;
        p.dtype = d;
        p.rows = c.rows;
        p.hidden = hidden;
        p.eps = in.eps;
        p.x = in.x;
        p.dy = in.dy;
        p.gamma = variant.has_gamma ? in.gamma : std::vector<float>(hidden, 1.0f);
        p.rms = in.rms;
        const Result r = RunPlan(c, p);
        ASSERT_TRUE(r.ok);
        const half_bound::HalfReference want =
            half_bound::HalfReferenceFor(in, variant, c.given_rms, half_bound::Products::kF32);
        size_t first = 0;
        EXPECT_EQ(CountOutsideBound(d, r.dx, want.dx, want.dx_tol, &first), 0u)
            << "first dx[" << first << "] = " << r.dx[first] << ", reference " << want.dx[first]
            << " +- " << want.dx_tol[first];
        EXPECT_EQ(CountOutsideBound(DType::kF32, r.dgamma, want.dgamma, want.dgamma_tol, &first),
                  0u)
            << "first grad_gamma[" << first << "] = "
            << (r.dgamma.empty() ? 0.0f : r.dgamma[first]);
      }
    }
  }
}

}  // namespace
}  // namespace normgrad::ptxsim
