// Correctness of the backend under test (NORMGRAD_TEST_BACKEND, default cpu) against
// kernels::ReferenceBackward, and its refusal of inconsistent calls.
//
// Tolerance: the CPU backend must agree element by element within 1e-5 relative. The CUDA
// backend's trueno-compatible kernels sum in f32 (grad_gamma with atomics), so an element that is the
// difference of two nearly equal terms carries the f32 rounding of the terms, not of the
// result: it is held to 1e-5 relative plus 1e-5 of the magnitude of the terms it is made of,
//   dx_ri:     inv_rms_r * (|gamma_i dy_ri| + |x_ri| inv_rms_r^2 mean_j |x_rj dy_rj gamma_j|)
//   dgamma_i:  sum_r |dy_ri x_ri| inv_rms_r
#include "server/backend/backend.h"

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/rmsnorm/reference.h"
#include "tests/server/backend/backend_test_util.h"

// In the test utilities' namespace: Batch, MakeBatch, RunF32... without qualification.
namespace normgrad::server::testing {
namespace {

bool IsCpu() { return BackendUnderTestName() == "cpu"; }

Gradients Reference(const Batch& b) {
  Gradients g;
  g.dx.resize(b.rows * b.hidden);
  g.dgamma.resize(b.hidden);
  kernels::ReferenceBackward({b.x, b.dy, b.gamma, b.rms, b.rows, b.hidden, b.eps},
                             absl::MakeSpan(g.dx), absl::MakeSpan(g.dgamma));
  return g;
}

// Magnitudes of the terms each output element is computed from (see the top of the file).
struct TermScales {
  std::vector<double> dx, dgamma;
};

TermScales Scales(const Batch& b) {
  TermScales t;
  t.dx.resize(b.rows * b.hidden);
  t.dgamma.assign(b.hidden, 0.0);
  for (uint64_t r = 0; r < b.rows; ++r) {
    const float* x = b.x.data() + r * b.hidden;
    const float* dy = b.dy.data() + r * b.hidden;
    double sum_sq = 0, sum_abs = 0;
    for (uint32_t i = 0; i < b.hidden; ++i) {
      sum_sq += double{x[i]} * x[i];
      sum_abs += std::fabs(double{x[i]} * dy[i] * b.gamma[i]);
    }
    const double rms = b.rms.empty() ? std::sqrt(sum_sq / b.hidden + b.eps) : b.rms[r];
    const double inv = 1.0 / rms;
    for (uint32_t i = 0; i < b.hidden; ++i) {
      t.dx[r * b.hidden + i] = inv * (std::fabs(double{b.gamma[i]} * dy[i]) +
                                      std::fabs(x[i]) * inv * inv * sum_abs / b.hidden);
      t.dgamma[i] += std::fabs(double{dy[i]} * x[i]) * inv;
    }
  }
  return t;
}

// Counts elements of `got` outside the tolerance described at the top.
int CountMismatches(const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<double>& scale, std::string* first) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double abs_tol = IsCpu() ? 1e-30 : 1e-5 * scale[i];
    const double diff = std::fabs(double{got[i]} - double{want[i]});
    if (!(diff <= 1e-5 * std::fabs(want[i]) + abs_tol)) {
      if (bad++ == 0) *first = absl::StrCat("index ", i, ": got ", got[i], ", want ", want[i]);
    }
  }
  return bad;
}

// dx and grad_gamma of `got` within the tolerance described at the top.
void ExpectNearReference(const Batch& b, const Gradients& got) {
  const Gradients want = Reference(b);
  const TermScales scale = Scales(b);
  std::string first;
  EXPECT_EQ(CountMismatches(got.dx, want.dx, scale.dx, &first), 0) << "dx " << first;
  EXPECT_EQ(CountMismatches(got.dgamma, want.dgamma, scale.dgamma, &first), 0)
      << "dgamma " << first;
}

// INVALID_ARGUMENT with `text` in the message.
void ExpectInvalidArgument(const absl::Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(text), std::string::npos) << s;
}

class BackendShapeTest : public ::testing::TestWithParam<
                             std::tuple<uint32_t /*hidden*/, uint64_t /*rows*/, bool /*rms*/>> {};

TEST_P(BackendShapeTest, MatchesReferenceWithChunksThatDoNotDivideTheRows) {
  const auto [hidden, rows, with_rms] = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
  ASSERT_TRUE(backend.ok()) << backend.status();
  const Batch b = MakeBatch(rows, hidden, with_rms);
  const uint64_t chunk = std::max<uint64_t>(1, rows / 3 + 1);  // 3 chunks, the last shorter
  absl::StatusOr<Gradients> got = RunF32(**backend, b, chunk);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectNearReference(b, *got);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BackendShapeTest,
    ::testing::Combine(::testing::Values(1u, 7u, 31u, 32u, 33u, 896u, 4096u, 8192u),
                       ::testing::Values(uint64_t{1}, uint64_t{5}, uint64_t{67}),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<BackendShapeTest::ParamType>& info) {
      return absl::StrCat("hidden", std::get<0>(info.param), "_rows", std::get<1>(info.param),
                          std::get<2>(info.param) ? "_rms_given" : "_rms_recomputed");
    });

TEST(BackendTest, ManyRowsMatchReference) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
  ASSERT_TRUE(backend.ok()) << backend.status();
  const Batch b = MakeBatch(20011, 96, /*with_rms=*/false);
  absl::StatusOr<Gradients> got = RunF32(**backend, b, 4099);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectNearReference(b, *got);
}

TEST(BackendTest, GradGammaSameBitsForSameInputAndChunking) {
  // CPU: fixed partitions; CUDA: the default row-resident kernel's fixed-order partial rows.
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
  ASSERT_TRUE(backend.ok()) << backend.status();
  const Batch b = MakeBatch(3001, 896, false);
  absl::StatusOr<Gradients> first = RunF32(**backend, b, 1000);
  absl::StatusOr<Gradients> second = RunF32(**backend, b, 1000);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(0, std::memcmp(first->dgamma.data(), second->dgamma.data(), b.hidden * 4));
  EXPECT_EQ(0, std::memcmp(first->dx.data(), second->dx.data(), first->dx.size() * 4));
}

TEST(BackendTest, VariantsMatchTheReferenceOfTheirScale) {
  // f32: the casting mode changes nothing, and a variant's math is the plain RMSNorm's with
  // gamma replaced by its scale (offset + gamma in f32, or 1 without gamma). dx over dy (in
  // place) gives the out-of-place result.
  if (absl::StrContains(BackendUnderTestSetting(/*library_part=*/true), "scripted")) {
    GTEST_SKIP() << "the scripted driver computes the plain RMSNorm's math in C++, not the PTX; "
                    "the emulated driver runs the variants' PTX";
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
  ASSERT_TRUE(backend.ok()) << backend.status();
  for (bool with_rms : {false, true}) {
    const Batch b = MakeBatch(301, 896, with_rms);
    for (const kernels::NormVariant& v :
         {kernels::NormVariant{.gamma_offset = 1.0f, .casting = kernels::CastingMode::kLlama},
          kernels::NormVariant{.gamma_offset = -0.5f}, kernels::NormVariant{.has_gamma = false}}) {
      Batch scaled = b;
      for (float& g : scaled.gamma) g = v.has_gamma ? v.gamma_offset + g : 1.0f;
      absl::StatusOr<Gradients> got = RunF32(**backend, b, 100, "", v);
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<Gradients> over = RunF32(**backend, b, 100, "", v, /*in_place=*/true);
      ASSERT_TRUE(over.ok()) << over.status();
      EXPECT_EQ(got->dx, over->dx) << v.Describe();
      EXPECT_EQ(got->dgamma, over->dgamma) << v.Describe();
      if (!v.has_gamma) {
        EXPECT_TRUE(got->dgamma.empty());
        Gradients with_dgamma = *got;
        with_dgamma.dgamma = Reference(scaled).dgamma;  // only dx is compared
        ExpectNearReference(scaled, with_dgamma);
        continue;
      }
      ExpectNearReference(scaled, *got);
    }
  }
}

TEST(BackendTest, NanAndInfInTheDataAreComputedThrough) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
  ASSERT_TRUE(backend.ok()) << backend.status();
  Batch b = MakeBatch(3, 8, false);
  b.x[1] = std::nanf("");  // row 0 becomes NaN throughout
  b.dy[8 + 2] = INFINITY;  // row 1: dx has inf/nan, still computed
  absl::StatusOr<Gradients> got = RunF32(**backend, b, 3);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(std::isnan(got->dx[0]));
  EXPECT_FALSE(std::isfinite(got->dx[8 + 2]));
  const Gradients want = Reference(b);
  for (int i = 16; i < 24; ++i)
    EXPECT_NEAR(got->dx[i], want.dx[i], 1e-5 * std::fabs(want.dx[i]) + 1e-6);
}

// bf16 and f16: inputs rounded to the dtype, outputs within the dtype's rounding of the
// reference computed on the same rounded inputs (CPU: half an ulp of the format; CUDA: one ulp,
// since f32 arithmetic can move a value across a rounding boundary, plus the f32 term error).
uint16_t ToHalfBits(kernels::DType dtype, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (dtype == kernels::DType::kBF16) {
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // tiny values: not produced here
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | ((bits & 0x7fffffu) >> 13);
  const uint32_t rest = bits & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

float FromHalfBits(kernels::DType dtype, uint16_t h) {
  uint32_t bits;
  if (dtype == kernels::DType::kBF16) {
    bits = uint32_t{h} << 16;
  } else {
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
      const float v = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -v : v;
    }
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

struct HalfCase {
  kernels::DType dtype;
  uint64_t rows;
  uint32_t hidden;
  bool with_rms;
};

class BackendHalfPrecisionTest : public ::testing::TestWithParam<HalfCase> {};

TEST_P(BackendHalfPrecisionTest, MatchesReferenceOnRoundedInputs) {
  const HalfCase c = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
  ASSERT_TRUE(backend.ok()) << backend.status();
  Batch b = MakeBatch(c.rows, c.hidden, c.with_rms);
  auto round_all = [&](std::vector<float>& v, std::vector<uint16_t>& bits) {
    bits.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      bits[i] = ToHalfBits(c.dtype, v[i]);
      v[i] = FromHalfBits(c.dtype, bits[i]);
    }
  };
  std::vector<uint16_t> x16, dy16, g16;
  round_all(b.x, x16);
  round_all(b.dy, dy16);
  round_all(b.gamma, g16);
  const Gradients want = Reference(b);
  const TermScales scale = Scales(b);

  kernels::BackwardRequest spec;
  spec.num_rows = b.rows;
  spec.hidden_dim = b.hidden;
  spec.eps = b.eps;
  spec.dtype = c.dtype;
  spec.rms_provided = c.with_rms;
  auto session = (*backend)->StartBackward(spec, Bytes(g16));
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<uint16_t> dx16(b.x.size()), dgamma16(b.hidden);
  const uint64_t h = b.hidden;
  for (uint64_t first = 0; first < b.rows; first += 15) {
    const uint64_t n = std::min<uint64_t>(15, b.rows - first);
    absl::Span<const float> rms =
        c.with_rms ? absl::MakeConstSpan(b.rms).subspan(first, n) : absl::Span<const float>();
    ASSERT_TRUE((*session)
                    ->ProcessChunk(Bytes(x16).subspan(first * h * 2, n * h * 2),
                                   Bytes(dy16).subspan(first * h * 2, n * h * 2), rms, n,
                                   MutableBytes(dx16).subspan(first * h * 2, n * h * 2))
                    .ok());
  }
  ASSERT_TRUE((*session)->Finish(MutableBytes(dgamma16)).ok());
  const double half_ulp = c.dtype == kernels::DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
  const double relative = IsCpu() ? half_ulp : 2 * half_ulp;
  int bad = 0;
  for (size_t i = 0; i < want.dx.size(); ++i) {
    const double tol =
        relative * std::fabs(want.dx[i]) + (IsCpu() ? 1e-6 : 1e-5 * scale.dx[i] + 1e-6);
    if (!(std::fabs(FromHalfBits(c.dtype, dx16[i]) - want.dx[i]) <= tol)) ++bad;
  }
  EXPECT_EQ(bad, 0) << "dx elements off";
  for (size_t i = 0; i < want.dgamma.size(); ++i) {
    const double tol =
        relative * std::fabs(want.dgamma[i]) + (IsCpu() ? 1e-6 : 1e-5 * scale.dgamma[i] + 1e-6);
    EXPECT_LE(std::fabs(FromHalfBits(c.dtype, dgamma16[i]) - want.dgamma[i]), tol) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, BackendHalfPrecisionTest,
                         ::testing::Values(HalfCase{kernels::DType::kBF16, 40, 33, false},
                                           HalfCase{kernels::DType::kF16, 40, 33, false},
                                           HalfCase{kernels::DType::kBF16, 24, 16, true},
                                           HalfCase{kernels::DType::kF16, 24, 16, true},
                                           HalfCase{kernels::DType::kBF16, 20, 96, true},
                                           HalfCase{kernels::DType::kF16, 20, 96, true}),
                         [](const ::testing::TestParamInfo<HalfCase>& info) {
                           return absl::StrCat(
                               info.param.dtype == kernels::DType::kBF16 ? "bf16" : "f16",
                               "_hidden", info.param.hidden,
                               info.param.with_rms ? "_rms_given" : "_rms_recomputed");
                         });

class BackendRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackendUnderTest();
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    batch_ = MakeBatch(4, 8, false);
    spec_.num_rows = 4;
    spec_.hidden_dim = 8;
  }

  // StartBackward's status for spec_ with `gamma` (the batch's when not given).
  absl::Status StartStatus(const std::vector<float>& gamma) {
    return backend_->StartBackward(spec_, Bytes(gamma)).status();
  }
  absl::Status StartStatus() { return StartStatus(batch_.gamma); }

  std::unique_ptr<BackwardSession> Start() {
    absl::StatusOr<std::unique_ptr<BackwardSession>> s =
        backend_->StartBackward(spec_, Bytes(batch_.gamma));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  std::unique_ptr<Backend> backend_;
  Batch batch_;
  kernels::BackwardRequest spec_;
  std::vector<float> dx_ = std::vector<float>(32);
};

TEST_F(BackendRefusalTest, GammaOfWrongLengthIsInvalidArgument) {
  ExpectInvalidArgument(StartStatus(std::vector<float>(7)), "gamma has 28 bytes");
}

TEST_F(BackendRefusalTest, ZeroRowsOrBadEpsIsInvalidArgument) {
  spec_.num_rows = 0;
  EXPECT_EQ(StartStatus().code(), absl::StatusCode::kInvalidArgument);
  spec_.num_rows = 4;
  spec_.eps = -1;
  EXPECT_EQ(StartStatus().code(), absl::StatusCode::kInvalidArgument);
  spec_.eps = NAN;
  EXPECT_EQ(StartStatus().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(BackendRefusalTest, UnknownKernelIsInvalidArgument) {
  spec_.kernel = "no_such_kernel";
  ExpectInvalidArgument(StartStatus(), "no_such_kernel");
}

TEST_F(BackendRefusalTest, WarpKernelRefusesHiddenDimAbove32) {
  spec_.hidden_dim = 33;
  spec_.rms_provided = true;
  spec_.kernel = "rms_norm_backward";
  ExpectInvalidArgument(StartStatus(MakeBatch(2, 33, /*with_rms=*/true).gamma), "33");
}

TEST_F(BackendRefusalTest, WarpKernelWithoutRmsIsInvalidArgument) {
  spec_.kernel = "rms_norm_backward";
  ExpectInvalidArgument(StartStatus(), "needs the forward pass's rms");
}

TEST_F(BackendRefusalTest, NamedKernelsRunWhenTheyCan) {
  Batch narrow = MakeBatch(5, 16, /*with_rms=*/true);
  for (const char* kernel : {"rms_norm_backward", "batched_rms_norm_backward"}) {
    absl::StatusOr<Gradients> got = RunF32(*backend_, narrow, 2, kernel);
    ASSERT_TRUE(got.ok()) << kernel << ": " << got.status();
    const Gradients want = Reference(narrow);
    std::string first;
    EXPECT_EQ(CountMismatches(got->dx, want.dx, Scales(narrow).dx, &first), 0)
        << kernel << " " << first;
  }
}

TEST_F(BackendRefusalTest, ChunkWithMismatchedSizesIsInvalidArgument) {
  std::unique_ptr<BackwardSession> session = Start();
  ASSERT_NE(session, nullptr);
  absl::Span<const uint8_t> x = Bytes(batch_.x);
  ExpectInvalidArgument(session->ProcessChunk(x.subspan(0, 60), Bytes(batch_.dy).subspan(0, 64), {},
                                              2, MutableBytes(dx_).subspan(0, 64)),
                        "x has 60 bytes");
}

TEST_F(BackendRefusalTest, RmsGivenToABatchWithoutRmsIsInvalidArgument) {
  std::unique_ptr<BackwardSession> session = Start();
  ASSERT_NE(session, nullptr);
  std::vector<float> rms(4, 1.0f);
  absl::Status s =
      session->ProcessChunk(Bytes(batch_.x), Bytes(batch_.dy), rms, 4, MutableBytes(dx_));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(BackendRefusalTest, MoreRowsThanDeclaredIsInvalidArgument) {
  std::unique_ptr<BackwardSession> session = Start();
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(
      session->ProcessChunk(Bytes(batch_.x), Bytes(batch_.dy), {}, 4, MutableBytes(dx_)).ok());
  ExpectInvalidArgument(
      session->ProcessChunk(Bytes(batch_.x).subspan(0, 32), Bytes(batch_.dy).subspan(0, 32), {}, 1,
                            MutableBytes(dx_).subspan(0, 32)),
      "exceeds num_rows (4)");
}

// docs/api.md: eps is neither checked nor used when the forward's rms is given.
TEST_F(BackendRefusalTest, RmsProvidedWithEpsUnsetRunsAndIgnoresEps) {
  for (float eps : {0.0f, -1.0f, std::nanf("")}) {
    Batch b = MakeBatch(6, 16, /*with_rms=*/true);
    b.eps = eps;
    absl::StatusOr<Gradients> got = RunF32(*backend_, b, 4);
    ASSERT_TRUE(got.ok()) << eps << ": " << got.status();
    std::string first;
    EXPECT_EQ(CountMismatches(got->dx, Reference(b).dx, Scales(b).dx, &first), 0)
        << eps << " " << first;
  }
}

// The batched kernel recomputes rms from x and eps whatever is given, so it needs an eps.
TEST_F(BackendRefusalTest, BatchedKernelWithRmsAndNoEpsIsInvalidArgument) {
  spec_.rms_provided = true;
  spec_.eps = 0;
  spec_.kernel = "batched_rms_norm_backward";
  ExpectInvalidArgument(StartStatus(), "recomputes rms from x and eps");
}

// The batched kernel's contract: rms is recomputed from x and eps, a given rms is not read. Both
// backends answer one request alike: a given rms twice the true one changes nothing.
TEST_F(BackendRefusalTest, BatchedKernelIgnoresAGivenRmsOnEveryBackend) {
  Batch b = MakeBatch(7, 48, /*with_rms=*/true);
  for (float& r : b.rms) r *= 2.0f;
  absl::StatusOr<Gradients> got = RunF32(*backend_, b, 3, "batched_rms_norm_backward");
  ASSERT_TRUE(got.ok()) << got.status();
  Batch recomputed = b;
  recomputed.rms.clear();
  ExpectNearReference(recomputed, *got);
}

TEST_F(BackendRefusalTest, RmsThatIsNotFiniteAndPositiveIsInvalidArgumentNamingTheRow) {
  for (float bad : {0.0f, -0.0f, -1.5f, std::nanf(""), INFINITY, -INFINITY}) {
    Batch b = MakeBatch(4, 8, /*with_rms=*/true);
    b.rms[3] = bad;
    spec_.rms_provided = true;
    std::unique_ptr<BackwardSession> session = Start();
    ASSERT_NE(session, nullptr);
    absl::Span<const uint8_t> x = Bytes(b.x), dy = Bytes(b.dy);
    absl::Span<const float> rms = b.rms;
    ASSERT_TRUE(session
                    ->ProcessChunk(x.subspan(0, 64), dy.subspan(0, 64), rms.subspan(0, 2), 2,
                                   MutableBytes(dx_).subspan(0, 64))
                    .ok());
    // Row 3 of the batch is row 1 of the second chunk: the message names the batch's row.
    ExpectInvalidArgument(session->ProcessChunk(x.subspan(64), dy.subspan(64), rms.subspan(2), 2,
                                                MutableBytes(dx_).subspan(64)),
                          absl::StrCat("rms of row 3 is ", bad, ";"));
  }
}

TEST_F(BackendRefusalTest, LongKernelNameIsNotEchoedWhole) {
  spec_.kernel = std::string(100000, 'k');
  const absl::Status s = StartStatus();
  const std::string head(s.message().substr(0, 512));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << head;
  EXPECT_NE(s.message().find("(100000 bytes)"), std::string::npos) << head;
  EXPECT_LT(s.message().size(), 512u) << head;
}

TEST_F(BackendRefusalTest, FinishBeforeAllRowsIsInvalidArgument) {
  std::unique_ptr<BackwardSession> session = Start();
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session
                  ->ProcessChunk(Bytes(batch_.x).subspan(0, 64), Bytes(batch_.dy).subspan(0, 64),
                                 {}, 2, MutableBytes(dx_).subspan(0, 64))
                  .ok());
  std::vector<float> dgamma(8);
  ExpectInvalidArgument(session->Finish(MutableBytes(dgamma)), "after 2 rows; num_rows declared 4");
}

}  // namespace
}  // namespace normgrad::server::testing
