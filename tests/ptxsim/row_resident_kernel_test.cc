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
#include "kernels/reference.h"
#include "tests/ptxsim/sim_harness.h"

namespace normgrad::ptxsim {
namespace {

using kernels::DType;
using kernels::FindKernel;
using kernels::KernelConfig;
using kernels::LaunchGeometry;

constexpr char kMain[] = "rms_norm_backward_row_resident";
constexpr char kReduce[] = "rms_norm_backward_dgamma_reduce";

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

std::vector<float> Fill(size_t n, uint32_t seed, float lo, float hi) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 1;
  for (float& f : v) {
    s = s * 1664525u + 1013904223u;
    f = lo + (hi - lo) * static_cast<float>(s >> 8) / static_cast<float>(1u << 24);
  }
  return v;
}

struct Case {
  DType dtype;
  uint32_t hidden;
  uint32_t rows;
  bool offset = false;     // every buffer starts 4 bytes past a 16-byte boundary
  bool given_rms = false;  // the forward's rms is passed
  int target_sm = 80;
};

struct Problem {
  std::vector<float> x, dy, gamma, rms;
};

Problem MakeProblem(const Case& c) {
  Problem p;
  const size_t n = size_t{c.rows} * c.hidden;
  p.x = Fill(n, 1 + c.hidden, -1.0f, 1.0f);
  p.dy = Fill(n, 7 + c.hidden, -1.0f, 1.0f);
  p.gamma = Fill(c.hidden, 13 + c.hidden, 0.5f, 1.5f);
  for (std::vector<float>* v : {&p.x, &p.dy, &p.gamma}) {
    for (float& f : *v) f = RoundToElement(f, c.dtype);
  }
  p.rms.resize(c.rows);
  for (uint32_t r = 0; r < c.rows; ++r) {
    double sum = 0;
    for (uint32_t i = 0; i < c.hidden; ++i) {
      const double v = p.x[size_t{r} * c.hidden + i];
      sum += v * v;
    }
    p.rms[r] = static_cast<float>(std::sqrt(sum / c.hidden + 1e-5));
  }
  return p;
}

struct Result {
  bool ok = false;
  std::vector<float> dx;
  std::vector<float> dgamma;        // f32 reduce
  std::vector<uint8_t> dgamma_raw;  // the reduce in the case's dtype, as stored
  uint32_t partial_rows = 0;
};

// Runs both kernels with their own geometry; sm_count 1 so that blocks loop over several rows.
Result RunBoth(const Case& c, const Problem& p, uint32_t sm_count = 1) {
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
  absl::StatusOr<kernels::EmittedPtx> ptx = main->Emit(config);
  if (!ptx.ok()) {
    ADD_FAILURE() << ptx.status();
    return out;
  }
  KernelConfig f32_config = config;
  f32_config.dtype = DType::kF32;
  absl::StatusOr<kernels::EmittedPtx> reduce_f32 = reduce->Emit(f32_config);
  absl::StatusOr<kernels::EmittedPtx> reduce_dtype = reduce->Emit(config);
  if (!reduce_f32.ok() || !reduce_dtype.ok()) {
    ADD_FAILURE() << reduce_f32.status() << " " << reduce_dtype.status();
    return out;
  }
  const LaunchGeometry g = main->Geometry(config, c.rows);
  out.partial_rows = g.grid[0];

  SimHarness sim;
  const size_t elem = c.dtype == DType::kF32 ? 4 : 2;
  const size_t shift = c.offset ? 4 : 0;
  // With `shift`, a buffer starts 4 bytes past a 16-byte boundary (the element path).
  auto place = [&](size_t bytes) -> uint8_t* {
    if (shift == 0) return sim.Alloc<uint8_t>(bytes);
    // Alloc registers exactly what it is asked for; ask for shift + bytes and skip the shift.
    uint8_t* base = sim.Alloc<uint8_t>(bytes + shift);
    return base + shift;
  };
  auto store = [&](const std::vector<float>& values) {
    uint8_t* b = place(values.size() * elem);
    for (size_t i = 0; i < values.size(); ++i) {
      if (elem == 4) {
        std::memcpy(b + 4 * i, &values[i], 4);
      } else {
        const uint16_t bits = ToBits16(values[i], c.dtype);
        std::memcpy(b + 2 * i, &bits, 2);
      }
    }
    return b;
  };
  const size_t n = size_t{c.rows} * c.hidden;
  uint8_t* x = store(p.x);
  uint8_t* dy = store(p.dy);
  uint8_t* gamma = store(p.gamma);
  uint8_t* dx = place(n * elem);
  float* rms = sim.Alloc<float>(c.rows);
  std::copy(p.rms.begin(), p.rms.end(), rms);
  float* partials = sim.Alloc<float>(size_t{g.grid[0]} * c.hidden);
  std::fill(partials, partials + size_t{g.grid[0]} * c.hidden, std::nanf(""));
  float* dgamma = sim.Alloc<float>(c.hidden);
  uint8_t* dgamma_dtype = sim.Alloc<uint8_t>(c.hidden * elem);

  KernelArgs args;
  args.Add(SimHarness::Address(x))
      .Add(SimHarness::Address(gamma))
      .Add(SimHarness::Address(dy))
      .Add(SimHarness::Address(dx))
      .Add(c.given_rms ? SimHarness::Address(rms) : uint64_t{0})
      .Add(SimHarness::Address(partials))
      .Add(c.rows)
      .Add(c.hidden)
      .Add(1e-5f);
  absl::Status s = sim.Run(ptx->text, ptx->entry, {g.grid[0], g.grid[1], g.grid[2]},
                           {g.block[0], g.block[1], g.block[2]}, args, nullptr, g.shared_bytes);
  if (!s.ok()) {
    ADD_FAILURE() << s;
    return out;
  }
  const LaunchGeometry rg = reduce->Geometry(config, c.rows);
  for (const auto& [emitted, target] :
       {std::make_pair(&*reduce_f32, static_cast<void*>(dgamma)),
        std::make_pair(&*reduce_dtype, static_cast<void*>(dgamma_dtype))}) {
    KernelArgs rargs;
    rargs.Add(SimHarness::Address(partials))
        .Add(reinterpret_cast<uint64_t>(target))
        .Add(g.grid[0])
        .Add(c.hidden);
    s = sim.Run(emitted->text, emitted->entry, {rg.grid[0], 1, 1}, {rg.block[0], 1, 1}, rargs);
    if (!s.ok()) {
      ADD_FAILURE() << s;
      return out;
    }
  }
  out.dx.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (elem == 4) {
      std::memcpy(&out.dx[i], dx + 4 * i, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, dx + 2 * i, 2);
      out.dx[i] = FromBits16(bits, c.dtype);
    }
  }
  out.dgamma.assign(dgamma, dgamma + c.hidden);
  out.dgamma_raw.assign(dgamma_dtype, dgamma_dtype + c.hidden * elem);
  out.ok = true;
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = tolerance * std::max(1.0, std::fabs(static_cast<double>(want[i])));
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= bound) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", expected " << want[i]
                    << " (bound " << bound << ")";
    }
  }
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat(kernels::DTypeName(c.dtype), "_h", c.hidden, "_rows", c.rows,
                      c.offset ? "_offset4" : "_aligned", c.given_rms ? "_rms" : "");
}

class RowResidentOnInterpreter : public ::testing::TestWithParam<Case> {};

TEST_P(RowResidentOnInterpreter, MatchesTheReference) {
  const Case& c = GetParam();
  const Problem p = MakeProblem(c);
  const Result r = RunBoth(c, p);
  ASSERT_TRUE(r.ok);
  std::vector<float> want_dx(p.x.size()), want_dgamma(c.hidden);
  kernels::ReferenceBackward(
      {p.x, p.dy, p.gamma, c.given_rms ? p.rms : std::vector<float>{}, c.rows, c.hidden, 1e-5f},
      absl::MakeSpan(want_dx), absl::MakeSpan(want_dgamma));
  // Against the unrounded reference: half an ulp of the element type plus the f32 error.
  ExpectClose(r.dx, want_dx, DxTolerance(c.dtype), "dx");
  ExpectClose(r.dgamma, want_dgamma, 1e-5, "dgamma");
  // The dtype output of the reduce is the f32 sum rounded once to nearest even.
  for (uint32_t i = 0; i < c.hidden; ++i) {
    float got;
    if (c.dtype == DType::kF32) {
      std::memcpy(&got, &r.dgamma_raw[4 * i], 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &r.dgamma_raw[2 * i], 2);
      got = FromBits16(bits, c.dtype);
    }
    ASSERT_EQ(got, RoundToElement(r.dgamma[i], c.dtype)) << "dgamma in dtype, column " << i;
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
    const Problem p = MakeProblem(c);
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
  const Problem p = MakeProblem(c);
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
    const Problem p = MakeProblem(c);
    const Result a = RunBoth(c, p, 40);
    const Result b = RunBoth(c, p, 40);
    ASSERT_TRUE(a.ok && b.ok);
    EXPECT_EQ(a.partial_rows, 300u);
    std::vector<float> want_dx(p.x.size()), want_dgamma(c.hidden);
    kernels::ReferenceBackward({p.x, p.dy, p.gamma, {}, c.rows, c.hidden, 1e-5f},
                               absl::MakeSpan(want_dx), absl::MakeSpan(want_dgamma));
    ExpectClose(a.dgamma, want_dgamma, 1e-5, "dgamma");
    ASSERT_EQ(0, std::memcmp(a.dgamma.data(), b.dgamma.data(), 4 * c.hidden));
  }
}

TEST(RowResidentVectorPath, AlignedAndOffsetBuffersGiveTheSameBits) {
  // The 16-byte path and the element path compute the same f32 operations in the same order.
  for (DType d : {DType::kF32, DType::kF16}) {
    Case aligned{d, 4096, 5};
    Case offset = aligned;
    offset.offset = true;
    const Problem p = MakeProblem(aligned);
    const Result a = RunBoth(aligned, p);
    const Result b = RunBoth(offset, p);
    ASSERT_TRUE(a.ok && b.ok);
    ASSERT_EQ(0, std::memcmp(a.dx.data(), b.dx.data(), 4 * a.dx.size()));
    ASSERT_EQ(0, std::memcmp(a.dgamma.data(), b.dgamma.data(), 4 * a.dgamma.size()));
  }
}

}  // namespace
}  // namespace normgrad::ptxsim
