// The CPU backend's bf16 and f16 outputs against the bound of docs/kernels.md (one unit of the
// dtype plus float32's rounding of the terms; tests/common/half_precision_bound.h) on the hard
// cases: hidden 1, 7, 4099 and 65536, magnitudes spread over 2^-12 .. 2^12, rows where gamma*dy
// and x*correction cancel, every variant (gamma offset, no gamma, the three casting modes), rms
// given and recomputed. grad_gamma's bits do not depend on the thread count or on how rows are
// grouped; rows whose values would overflow float32 on the way are computed in double and still
// meet the bound (never an infinity where double gives a number).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "server/cpu/cpu_backend.h"
#include "server/host_rows/element_conversion.h"
#include "server/host_rows/host_rows.h"
#include "server/host_rows/simd_target.h"
#include "tests/common/half_precision_bound.h"

namespace normgrad::server {
namespace {

using half_bound::CountOutsideBound;
using half_bound::HalfInputs;
using half_bound::HalfReference;
using half_bound::HalfReferenceFor;
using half_bound::MakeHardInputs;
using half_bound::Products;
using kernels::CastingMode;
using kernels::DType;

struct Outputs {
  std::vector<float> dx, dgamma;
  std::vector<uint8_t> dgamma_bytes;
};

std::vector<uint8_t> Encode(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * kernels::DTypeBytes(dtype));
  host_rows::ConvertFromF32(dtype, values.data(), bytes.data(), values.size());
  return bytes;
}

std::vector<float> Decode(DType dtype, const std::vector<uint8_t>& bytes) {
  std::vector<float> values(bytes.size() / kernels::DTypeBytes(dtype));
  host_rows::ConvertToF32(dtype, bytes.data(), values.data(), values.size());
  return values;
}

// Through the CPU backend with `threads` threads, in chunks of `chunk_rows` rows.
Outputs RunOnCpu(const HalfInputs& in, const kernels::NormVariant& variant, bool with_rms,
                 int threads, uint64_t chunk_rows) {
  Outputs out;
  std::unique_ptr<Backend> cpu = NewCpuBackend({.threads = threads});
  const kernels::BackwardRequest spec{in.rows, in.hidden, in.eps, in.dtype, with_rms, "", variant};
  const std::vector<uint8_t> gamma = Encode(in.dtype, in.gamma);
  auto session = cpu->StartBackward(spec, absl::MakeConstSpan(gamma));
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return out;
  const std::vector<uint8_t> x = Encode(in.dtype, in.x), dy = Encode(in.dtype, in.dy);
  std::vector<uint8_t> dx(x.size());
  const size_t row_bytes = size_t{in.hidden} * kernels::DTypeBytes(in.dtype);
  for (uint64_t first = 0; first < in.rows; first += chunk_rows) {
    const uint64_t n = std::min(chunk_rows, in.rows - first);
    absl::Span<const float> rms;
    if (with_rms) rms = absl::MakeConstSpan(in.rms).subspan(first, n);
    const absl::Status s = (*session)->ProcessChunk(
        absl::MakeConstSpan(x).subspan(first * row_bytes, n * row_bytes),
        absl::MakeConstSpan(dy).subspan(first * row_bytes, n * row_bytes), rms, n,
        absl::MakeSpan(dx).subspan(first * row_bytes, n * row_bytes));
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return out;
  }
  out.dgamma_bytes.assign(variant.has_gamma ? row_bytes : 0, 0);
  const absl::Status finished = (*session)->Finish(absl::MakeSpan(out.dgamma_bytes));
  EXPECT_TRUE(finished.ok()) << finished;
  out.dx = Decode(in.dtype, dx);
  out.dgamma = Decode(in.dtype, out.dgamma_bytes);
  return out;
}

void ExpectWithinBound(const HalfInputs& in, const kernels::NormVariant& variant, bool with_rms,
                       const Outputs& got) {
  const HalfReference want = HalfReferenceFor(in, variant, with_rms, Products::kDouble);
  size_t first = 0;
  const size_t bad_dx = CountOutsideBound(in.dtype, got.dx, want.dx, want.dx_tol, &first);
  EXPECT_EQ(bad_dx, 0u) << "of " << want.dx.size() << "; first dx[" << first
                        << "] = " << (first < got.dx.size() ? got.dx[first] : NAN)
                        << ", reference " << want.dx[first] << " +- " << want.dx_tol[first];
  const size_t bad_dgamma =
      CountOutsideBound(in.dtype, got.dgamma, want.dgamma, want.dgamma_tol, &first);
  EXPECT_EQ(bad_dgamma, 0u) << "of " << want.dgamma.size() << "; first grad_gamma[" << first
                            << "] = " << (first < got.dgamma.size() ? got.dgamma[first] : NAN)
                            << ", reference " << (want.dgamma.empty() ? 0 : want.dgamma[first]);
}

std::vector<kernels::NormVariant> Variants() {
  std::vector<kernels::NormVariant> all;
  for (CastingMode casting : {CastingMode::kGemma, CastingMode::kLlama, CastingMode::kNone}) {
    for (float offset : {0.0f, 1.0f, -0.5f}) all.push_back({offset, /*has_gamma=*/true, casting});
    all.push_back({0.0f, /*has_gamma=*/false, casting});
  }
  return all;
}

void ExpectHardCasesWithinBound(DType dtype) {
  for (uint32_t hidden : {1u, 7u, 4099u, 65536u}) {
    const uint64_t rows = hidden >= 65536 ? 6 : hidden >= 4099 ? 12 : 60;
    for (const kernels::NormVariant& variant : Variants()) {
      for (bool with_rms : {false, true}) {
        if (hidden == 65536 && with_rms && variant.casting != CastingMode::kGemma) continue;
        SCOPED_TRACE(absl::StrCat(kernels::DTypeName(dtype), " hidden ", hidden, " ",
                                  variant.Describe(), with_rms ? ", rms given" : ""));
        const HalfInputs in = MakeHardInputs(dtype, rows, hidden, variant, /*seed=*/hidden);
        ExpectWithinBound(in, variant, with_rms,
                          RunOnCpu(in, variant, with_rms, /*threads=*/2, (rows + 1) / 2));
      }
    }
  }
}

TEST(HalfPrecisionBoundTest, Bf16HardCasesOfEveryVariantStayWithinTheBound) {
  ExpectHardCasesWithinBound(DType::kBF16);
}

TEST(HalfPrecisionBoundTest, F16HardCasesOfEveryVariantStayWithinTheBound) {
  ExpectHardCasesWithinBound(DType::kF16);
}

// Every SIMD target this CPU runs: their vectors differ in width, so their f32 sums group terms
// differently; each must meet the bound.
TEST(HalfPrecisionBoundTest, EverySimdTargetStaysWithinTheBound) {
  for (const std::string& target : host_rows::SupportedSimdTargets()) {
    SCOPED_TRACE(target);
    ASSERT_TRUE(host_rows::LimitSimdTarget(target));
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      for (uint32_t hidden : {7u, 4099u}) {
        const kernels::NormVariant variant{1.0f, true, CastingMode::kGemma};
        const HalfInputs in = MakeHardInputs(dtype, 12, hidden, variant, /*seed=*/hidden);
        ExpectWithinBound(in, variant, false, RunOnCpu(in, variant, false, 2, 12));
      }
    }
  }
  ASSERT_TRUE(host_rows::LimitSimdTarget(""));
}

// grad_gamma is added row after row in double: the same bits with 1, 2 or 3 threads, and whether
// host_rows takes the rows in groups (one block) or one at a time.
TEST(HalfPrecisionBoundTest, GradGammaBitsDoNotDependOnThreadsOrGrouping) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (uint32_t hidden : {7u, 1000u, 4099u}) {
      SCOPED_TRACE(absl::StrCat(kernels::DTypeName(dtype), " hidden ", hidden));
      const kernels::NormVariant variant{0.0f, true, CastingMode::kGemma};
      const HalfInputs in = MakeHardInputs(dtype, 67, hidden, variant, /*seed=*/11);
      const Outputs one = RunOnCpu(in, variant, false, 1, 67);
      for (int threads : {2, 3}) {
        const Outputs more = RunOnCpu(in, variant, false, threads, 67);
        EXPECT_EQ(one.dgamma_bytes, more.dgamma_bytes) << threads << " threads";
        EXPECT_EQ(0, std::memcmp(one.dx.data(), more.dx.data(), 4 * one.dx.size()));
      }
      // host_rows directly: 11 rows in one block (groups of four or two) against 11 blocks of one.
      const std::vector<uint8_t> x = Encode(dtype, in.x), dy = Encode(dtype, in.dy);
      std::vector<double> scale(in.gamma.begin(), in.gamma.end());
      const size_t row_bytes = size_t{hidden} * kernels::DTypeBytes(dtype);
      auto run = [&](uint64_t rows_per_block, std::vector<uint8_t>& dx,
                     std::vector<double>& dgamma) {
        dx.assign(11 * row_bytes, 0);
        dgamma.assign(hidden, 0.0);
        for (uint64_t first = 0; first < 11; first += rows_per_block) {
          host_rows::RowBlock block;
          block.x = x.data() + first * row_bytes;
          block.dy = dy.data() + first * row_bytes;
          block.dx = dx.data() + first * row_bytes;
          block.gamma_f64 = scale.data();
          block.dgamma = dgamma.data();
          block.num_rows = std::min<uint64_t>(rows_per_block, 11 - first);
          block.hidden_dim = hidden;
          block.eps = in.eps;
          block.storage = dtype;
          block.element = dtype;
          host_rows::BackwardRows(block);
        }
      };
      std::vector<uint8_t> dx_grouped, dx_alone;
      std::vector<double> dgamma_grouped, dgamma_alone;
      run(11, dx_grouped, dgamma_grouped);
      run(1, dx_alone, dgamma_alone);
      EXPECT_EQ(dx_grouped, dx_alone);
      EXPECT_EQ(0, std::memcmp(dgamma_grouped.data(), dgamma_alone.data(), 8 * hidden));
    }
  }
}

// Rows whose f32 products would overflow (x^2 above 2^128, gamma*dy above it, a huge 1/rms from a
// given rms) or whose 1/rms is too large for f32's subnormal steps go through double: finite
// where the reference is, and within the bound.
TEST(HalfPrecisionBoundTest, RowsBeyondFloat32sRangeAreComputedInDouble) {
  const kernels::NormVariant variant{0.0f, true, CastingMode::kGemma};
  HalfInputs in = MakeHardInputs(DType::kBF16, 8, 1000, variant, /*seed=*/5);
  const uint32_t h = in.hidden;
  for (uint32_t i = 0; i < h; ++i) {
    in.x[1 * h + i] *= 0x1p70f;   // x^2 overflows f32
    in.dy[2 * h + i] *= 0x1p110f;  // gamma * dy overflows f32 (dy up to 2^122, gamma to 2^12)
    in.x[3 * h + i] *= 0x1p-60f;   // 1/rms about 2^20 with eps 1e-12 (below)
    in.x[5 * h + i] *= 0x1p-100f;  // and x^2 below f32's range
  }
  in.eps = 1e-12f;
  for (uint64_t r = 0; r < in.rows; ++r) {
    double sum = 0;
    for (uint32_t i = 0; i < h; ++i) sum += double{in.x[r * h + i]} * in.x[r * h + i];
    in.rms[r] = static_cast<float>(std::sqrt(sum / h + double{in.eps}));
  }
  for (bool with_rms : {false, true}) {
    SCOPED_TRACE(with_rms ? "rms given" : "rms recomputed");
    const Outputs got = RunOnCpu(in, variant, with_rms, 2, in.rows);
    const HalfReference want = HalfReferenceFor(in, variant, with_rms, Products::kDouble);
    size_t infinite_where_finite = 0;
    for (size_t i = 0; i < want.dx.size(); ++i) {
      const double rounded = half_bound::RoundTo(DType::kBF16, want.dx[i]);
      infinite_where_finite += std::isfinite(rounded) && !std::isfinite(got.dx[i]);
    }
    EXPECT_EQ(infinite_where_finite, 0u);
    ExpectWithinBound(in, variant, with_rms, got);
  }
}

}  // namespace
}  // namespace normgrad::server
