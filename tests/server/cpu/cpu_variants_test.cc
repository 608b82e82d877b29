// The CPU backend computes every RMSNorm variant (kernels::NormVariant: gamma offset, no gamma,
// the casting modes llama, gemma and none) for f32, bf16 and f16, against a reference in double
// written here that applies the roundings of each casting mode; and dx written over dy (in
// place) gives the bits of dx in a buffer of its own.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "server/cpu/cpu_backend.h"
#include "server/host_rows/element_conversion.h"
#include "tests/common/half_precision_bound.h"

namespace normgrad::server {
namespace {

using kernels::CastingMode;
using kernels::DType;

using half_bound::IsRoundedFrom;
using half_bound::RoundTo;

struct Case {
  DType dtype = DType::kF32;
  uint32_t hidden = 0;
  kernels::NormVariant variant;
  bool with_rms = false;
};

std::string Describe(const Case& c) {
  return absl::StrCat(kernels::DTypeName(c.dtype), " hidden ", c.hidden, " offset ",
                      c.variant.gamma_offset, c.variant.has_gamma ? "" : " no gamma", " ",
                      kernels::CastingModeName(c.variant.casting), c.with_rms ? " rms" : "");
}

// Inputs as `dtype` bytes, and the values they hold (exact in double).
struct Inputs {
  uint64_t rows = 0;
  std::vector<uint8_t> x, dy, gamma;
  std::vector<double> xv, dyv, gammav;
  std::vector<float> rms;
  float eps = 1e-5f;
};

std::vector<uint8_t> AsType(DType dtype, const std::vector<float>& f, std::vector<double>& exact) {
  std::vector<uint8_t> bytes(f.size() * kernels::DTypeBytes(dtype));
  host_rows::ConvertFromF32(dtype, f.data(), bytes.data(), f.size());
  std::vector<float> back(f.size());
  host_rows::ConvertToF32(dtype, bytes.data(), back.data(), f.size());
  exact.assign(back.begin(), back.end());
  return bytes;
}

Inputs MakeInputs(const Case& c, uint64_t rows) {
  Inputs in;
  in.rows = rows;
  std::mt19937 gen(c.hidden * 131u + static_cast<uint32_t>(c.dtype));
  std::uniform_real_distribution<float> values(-2.0f, 2.0f), scales(0.5f, 1.5f);
  std::vector<float> x(rows * c.hidden), dy(rows * c.hidden), gamma(c.hidden);
  for (float& v : x) v = values(gen);
  for (float& v : dy) v = values(gen);
  for (float& v : gamma) v = scales(gen);
  in.x = AsType(c.dtype, x, in.xv);
  in.dy = AsType(c.dtype, dy, in.dyv);
  if (c.variant.has_gamma) in.gamma = AsType(c.dtype, gamma, in.gammav);
  if (c.with_rms) {
    for (uint64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (uint32_t i = 0; i < c.hidden; ++i)
        sum += in.xv[r * c.hidden + i] * in.xv[r * c.hidden + i];
      in.rms.push_back(static_cast<float>(std::sqrt(sum / c.hidden + in.eps)));
    }
  }
  return in;
}

// The spec's math in double: s = offset + gamma (one f32 add) or 1; m = dy*s, rounded to the
// element type for llama and none; dx = r*(m - c*x); grad_gamma adds dy*x*r, x*r rounded for
// llama. f32 rounds nothing but the output. Also each dx's size of terms, for the tolerance.
struct Expected {
  std::vector<double> dx, dx_terms, dgamma, dgamma_terms;
};

Expected Reference(const Case& c, const Inputs& in) {
  const uint32_t h = c.hidden;
  const bool rounds = c.dtype != DType::kF32;
  const bool round_m = rounds && c.variant.casting != CastingMode::kGemma;
  const bool round_n = rounds && c.variant.casting == CastingMode::kLlama;
  Expected e;
  e.dx.resize(in.rows * h);
  e.dx_terms.resize(in.rows * h);
  e.dgamma.assign(h, 0.0);
  e.dgamma_terms.assign(h, 0.0);
  std::vector<double> m(h);
  for (uint64_t r = 0; r < in.rows; ++r) {
    const double* x = in.xv.data() + r * h;
    const double* dy = in.dyv.data() + r * h;
    double sum_sq = 0;
    for (uint32_t i = 0; i < h; ++i) sum_sq += x[i] * x[i];
    const double rms = c.with_rms ? in.rms[r] : std::sqrt(sum_sq / h + double{in.eps});
    const double inv = 1.0 / rms;
    double sum_mx = 0, sum_abs_mx = 0;
    for (uint32_t i = 0; i < h; ++i) {
      const double s =
          c.variant.has_gamma
              ? static_cast<float>(c.variant.gamma_offset + static_cast<float>(in.gammav[i]))
              : 1.0;
      m[i] = round_m ? RoundTo(c.dtype, dy[i] * s) : dy[i] * s;
      sum_mx += m[i] * x[i];
      sum_abs_mx += std::fabs(m[i] * x[i]);
    }
    const double corr = inv * inv * sum_mx / h;
    const double corr_abs = inv * inv * sum_abs_mx / h;
    for (uint32_t i = 0; i < h; ++i) {
      e.dx[r * h + i] = inv * (m[i] - corr * x[i]);
      e.dx_terms[r * h + i] = inv * (std::fabs(m[i]) + corr_abs * std::fabs(x[i]));
      const double n = round_n ? RoundTo(c.dtype, x[i] * inv) : x[i] * inv;
      e.dgamma[i] += dy[i] * n;
      e.dgamma_terms[i] += std::fabs(dy[i] * n);
    }
  }
  return e;
}

struct Got {
  std::vector<float> dx, dgamma;
};

// Through the backend in chunks of `chunk_rows`; with `in_place` dx is written over a copy of dy.
absl::StatusOr<Got> RunOnCpu(const Case& c, const Inputs& in, uint64_t chunk_rows, bool in_place,
                             int threads = 2) {
  std::unique_ptr<Backend> cpu = NewCpuBackend({.threads = threads});
  const kernels::BackwardRequest spec{in.rows, c.hidden, in.eps, c.dtype, c.with_rms, "", c.variant};
  absl::StatusOr<std::unique_ptr<BackwardSession>> session =
      cpu->StartBackward(spec, absl::MakeConstSpan(in.gamma));
  if (!session.ok()) return session.status();
  const size_t row_bytes = size_t{c.hidden} * kernels::DTypeBytes(c.dtype);
  std::vector<uint8_t> dy = in.dy;
  std::vector<uint8_t> dx_own(in.dy.size());
  std::vector<uint8_t>& dx = in_place ? dy : dx_own;
  for (uint64_t first = 0; first < in.rows; first += chunk_rows) {
    const uint64_t n = std::min(chunk_rows, in.rows - first);
    absl::Span<const float> rms;
    if (c.with_rms) rms = absl::MakeConstSpan(in.rms).subspan(first, n);
    if (absl::Status s = (*session)->ProcessChunk(
            absl::MakeConstSpan(in.x).subspan(first * row_bytes, n * row_bytes),
            absl::MakeConstSpan(dy).subspan(first * row_bytes, n * row_bytes), rms, n,
            absl::MakeSpan(dx).subspan(first * row_bytes, n * row_bytes));
        !s.ok()) {
      return s;
    }
  }
  std::vector<uint8_t> dgamma(c.variant.has_gamma ? row_bytes : 0);
  if (absl::Status s = (*session)->Finish(absl::MakeSpan(dgamma)); !s.ok()) return s;
  Got got;
  got.dx.resize(in.rows * c.hidden);
  host_rows::ConvertToF32(c.dtype, dx.data(), got.dx.data(), got.dx.size());
  got.dgamma.resize(c.variant.has_gamma ? c.hidden : 0);
  host_rows::ConvertToF32(c.dtype, dgamma.data(), got.dgamma.data(), got.dgamma.size());
  return got;
}

// Each output is the reference rounded as the backend rounds outputs, the reference moved by at
// most a multiple of the size of its terms: 1e-12 where the CPU computes in double (f32 rows,
// and the casting modes that round), 2^-19 (32 roundings of f32) for bf16/f16 with gemma, which
// it computes in f32 (tests/common/half_precision_bound.h; its hard cases are in
// half_precision_bound_test.cc). A casting mode computed as another moves values by up to half
// a unit of the dtype: many land elsewhere.
void ExpectMatchesReference(const Case& c, uint64_t rows) {
  SCOPED_TRACE(Describe(c));
  const Inputs in = MakeInputs(c, rows);
  const Expected e = Reference(c, in);
  absl::StatusOr<Got> got = RunOnCpu(c, in, /*chunk_rows=*/(rows + 1) / 2, /*in_place=*/false);
  ASSERT_TRUE(got.ok()) << got.status();
  const double bound = c.dtype != DType::kF32 && c.variant.casting == CastingMode::kGemma
                           ? 0x1p-19
                           : 1e-12;
  int bad_dx = 0, bad_dgamma = 0;
  for (size_t i = 0; i < e.dx.size(); ++i) {
    if (!IsRoundedFrom(c.dtype, got->dx[i], e.dx[i], bound * e.dx_terms[i])) {
      if (++bad_dx <= 3) ADD_FAILURE() << "dx[" << i << "] " << got->dx[i] << " vs " << e.dx[i];
    }
  }
  if (!c.variant.has_gamma) {
    EXPECT_TRUE(got->dgamma.empty());
  } else {
    for (size_t i = 0; i < e.dgamma.size(); ++i) {
      if (!IsRoundedFrom(c.dtype, got->dgamma[i], e.dgamma[i], bound * e.dgamma_terms[i])) {
        if (++bad_dgamma <= 3) {
          ADD_FAILURE() << "dgamma[" << i << "] " << got->dgamma[i] << " vs " << e.dgamma[i];
        }
      }
    }
  }
  EXPECT_EQ(bad_dx, 0);
  EXPECT_EQ(bad_dgamma, 0);
}

std::vector<kernels::NormVariant> Variants() {
  std::vector<kernels::NormVariant> all;
  for (CastingMode casting : {CastingMode::kLlama, CastingMode::kGemma, CastingMode::kNone}) {
    for (float offset : {0.0f, 1.0f, -0.5f}) {
      all.push_back({offset, /*has_gamma=*/true, casting});
    }
    all.push_back({0.0f, /*has_gamma=*/false, casting});
  }
  return all;
}

void ExpectEveryVariantMatches(DType dtype) {
  for (uint32_t hidden : {1u, 7u, 33u, 1000u, 4097u}) {
    for (const kernels::NormVariant& variant : Variants()) {
      Case c{dtype, hidden, variant, /*with_rms=*/hidden % 2 == 0};
      ExpectMatchesReference(c, hidden > 1000 ? 6 : 21);
    }
  }
}

TEST(CpuVariantsTest, F32EveryVariantMatchesTheReference) {
  ExpectEveryVariantMatches(DType::kF32);
}
TEST(CpuVariantsTest, BF16EveryVariantMatchesTheReference) {
  ExpectEveryVariantMatches(DType::kBF16);
}
TEST(CpuVariantsTest, F16EveryVariantMatchesTheReference) {
  ExpectEveryVariantMatches(DType::kF16);
}

TEST(CpuVariantsTest, GivenRmsAndRecomputedRmsBothFollowTheVariant) {
  for (bool with_rms : {false, true}) {
    ExpectMatchesReference({DType::kBF16, 1000, {1.0f, true, CastingMode::kLlama}, with_rms}, 9);
    ExpectMatchesReference({DType::kF16, 33, {0.0f, false, CastingMode::kNone}, with_rms}, 9);
  }
}

// For f32 the three casting modes are the same math: the same bits.
TEST(CpuVariantsTest, F32CastingModesGiveTheSameBits) {
  for (float offset : {0.0f, 1.0f}) {
    Case c{DType::kF32, 1000, {offset, true, CastingMode::kGemma}, false};
    const Inputs in = MakeInputs(c, 40);
    absl::StatusOr<Got> gemma = RunOnCpu(c, in, 40, false);
    ASSERT_TRUE(gemma.ok()) << gemma.status();
    for (CastingMode casting : {CastingMode::kLlama, CastingMode::kNone}) {
      c.variant.casting = casting;
      absl::StatusOr<Got> other = RunOnCpu(c, in, 40, false);
      ASSERT_TRUE(other.ok()) << other.status();
      EXPECT_EQ(0, std::memcmp(gemma->dx.data(), other->dx.data(), gemma->dx.size() * 4));
      EXPECT_EQ(0, std::memcmp(gemma->dgamma.data(), other->dgamma.data(), 1000 * 4));
    }
  }
}

// dx written over dy gives the bits of dx written apart, on every path: f32 used directly (rows
// four and two at a time, with and without streaming stores: 2200 x 1000 f32 is 8.8 MB, above
// kStreamDxBytes), f32 one byte off alignment and bf16/f16 staged, the rounding casting modes.
TEST(CpuVariantsTest, InPlaceGivesTheBitsOfOutOfPlace) {
  const struct {
    Case c;
    uint64_t rows, chunk_rows;
  } cases[] = {
      {{DType::kF32, 1000, {}, false}, 2200, 2200},
      {{DType::kF32, 1000, {}, true}, 37, 20},
      {{DType::kF32, 4097, {1.0f, true, CastingMode::kGemma}, false}, 9, 5},
      {{DType::kF32, 33, {0.0f, false, CastingMode::kGemma}, false}, 300, 300},
      {{DType::kBF16, 1000, {}, false}, 300, 170},
      {{DType::kBF16, 1000, {-0.5f, true, CastingMode::kLlama}, true}, 30, 30},
      {{DType::kF16, 7, {0.0f, false, CastingMode::kNone}, false}, 50, 50},
  };
  for (const auto& [c, rows, chunk_rows] : cases) {
    SCOPED_TRACE(Describe(c));
    const Inputs in = MakeInputs(c, rows);
    absl::StatusOr<Got> apart = RunOnCpu(c, in, chunk_rows, /*in_place=*/false);
    absl::StatusOr<Got> over_dy = RunOnCpu(c, in, chunk_rows, /*in_place=*/true);
    ASSERT_TRUE(apart.ok() && over_dy.ok());
    EXPECT_EQ(0, std::memcmp(apart->dx.data(), over_dy->dx.data(), apart->dx.size() * 4));
    ASSERT_EQ(apart->dgamma.size(), over_dy->dgamma.size());
    if (!apart->dgamma.empty()) {  // none without gamma
      EXPECT_EQ(0, std::memcmp(apart->dgamma.data(), over_dy->dgamma.data(),
                               apart->dgamma.size() * 4));
    }
  }
}

TEST(CpuVariantsTest, InPlaceF32OffAlignmentIsStagedAndStillExact) {
  const Case c{DType::kF32, 37, {}, false};
  const Inputs in = MakeInputs(c, 50);
  absl::StatusOr<Got> apart = RunOnCpu(c, in, 50, /*in_place=*/false);
  ASSERT_TRUE(apart.ok());
  std::unique_ptr<Backend> cpu = NewCpuBackend({.threads = 2});
  const kernels::BackwardRequest spec{50, 37, in.eps, DType::kF32, false, "", {}};
  absl::StatusOr<std::unique_ptr<BackwardSession>> session =
      cpu->StartBackward(spec, absl::MakeConstSpan(in.gamma));
  ASSERT_TRUE(session.ok());
  // One byte ahead of each row block, so that the f32 rows sit off their 4-byte alignment. Built
  // by insertion rather than memcpy into a vector of size()+1: GCC -O3 cannot rule out that +1
  // wrapping and warned (-Warray-bounds, -Wstringop-overflow) about a SIZE_MAX-byte copy.
  std::vector<uint8_t> x{0}, dy{0};
  x.insert(x.end(), in.x.begin(), in.x.end());
  dy.insert(dy.end(), in.dy.begin(), in.dy.end());
  ASSERT_TRUE((*session)
                  ->ProcessChunk(absl::MakeConstSpan(x).subspan(1),
                                 absl::MakeConstSpan(dy).subspan(1), {}, 50,
                                 absl::MakeSpan(dy).subspan(1))
                  .ok());
  EXPECT_EQ(0, std::memcmp(dy.data() + 1, apart->dx.data(), in.dy.size()));
}

TEST(CpuVariantsTest, NoGammaTakesNoGammaAndWritesNoGradGamma) {
  const Case c{DType::kF32, 8, {0.0f, false, CastingMode::kGemma}, false};
  std::unique_ptr<Backend> cpu = NewCpuBackend({.threads = 1});
  const kernels::BackwardRequest spec{1, 8, 1e-5f, DType::kF32, false, "", c.variant};
  std::vector<uint8_t> gamma(32);
  absl::StatusOr<std::unique_ptr<BackwardSession>> refused =
      cpu->StartBackward(spec, absl::MakeConstSpan(gamma));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<BackwardSession>> session = cpu->StartBackward(spec, {});
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> x(8, 1.0f), dy(8, 1.0f), dx(8);
  ASSERT_TRUE((*session)
                  ->ProcessChunk({reinterpret_cast<const uint8_t*>(x.data()), 32},
                                 {reinterpret_cast<const uint8_t*>(dy.data()), 32}, {}, 1,
                                 {reinterpret_cast<uint8_t*>(dx.data()), 32})
                  .ok());
  std::vector<uint8_t> dgamma(32);
  EXPECT_EQ((*session)->Finish(absl::MakeSpan(dgamma)).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace normgrad::server
