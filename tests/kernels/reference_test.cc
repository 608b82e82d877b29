// The CPU reference against central finite differences of the forward loss
// L = sum_ri y_ri * w_ri (so dL/dy = w), evaluated in double:
//   P-RMS-BACK-001  (rms from the forward pass given):  |dx - fd| <= 1e-5 * max(1, |fd|)
//   P-BRMS-BACK-001 (rms recomputed with eps):          |dx - fd| <= 1e-4 * max(1, |fd|)
// (same for dgamma), over hidden_dim 1..64, a spread to 1024, and 896, 4096, 8192. Rows come
// at three scales (1, 1e-2, 1e-3) so eps matters: at scale 1e-3, mean(x^2) is ~3e-7 against
// eps = 1e-5, and a formula that counts eps twice is off by far more than the tolerance (the
// test checks that it is caught).
#include "kernels/rmsnorm/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace normgrad::kernels {
namespace {

constexpr float kEps = 1e-5f;
constexpr double kRowScales[] = {1.0, 1e-2, 1e-3};

struct Problem {
  uint64_t rows = 0;
  uint32_t hidden = 0;
  std::vector<float> x, gamma, w, rms;  // rms: the forward's, rounded to float
};

// Deterministic across standard libraries: only mt19937's raw output is used.
double Uniform(std::mt19937& rng, double lo, double hi) {
  return lo + (hi - lo) * (static_cast<double>(rng()) / 4294967296.0);
}

double RowRms(const double* x, uint32_t h, double eps) {
  double sum_sq = 0.0;
  for (uint32_t i = 0; i < h; ++i) sum_sq += x[i] * x[i];
  return std::sqrt(sum_sq / h + eps);
}

Problem MakeProblem(uint32_t hidden, uint64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.rows = rows;
  p.hidden = hidden;
  p.x.resize(rows * hidden);
  p.w.resize(rows * hidden);
  p.gamma.resize(hidden);
  p.rms.resize(rows);
  for (uint32_t i = 0; i < hidden; ++i) p.gamma[i] = static_cast<float>(Uniform(rng, 0.5, 1.5));
  for (uint64_t r = 0; r < rows; ++r) {
    const double scale = kRowScales[r % 3];
    std::vector<double> xd(hidden);
    for (uint32_t i = 0; i < hidden; ++i) {
      p.x[r * hidden + i] = static_cast<float>(scale * Uniform(rng, -1.0, 1.0));
      p.w[r * hidden + i] = static_cast<float>(Uniform(rng, -1.0, 1.0));
      xd[i] = p.x[r * hidden + i];
    }
    p.rms[r] = static_cast<float>(RowRms(xd.data(), hidden, kEps));
  }
  return p;
}

// Row r of p.x, in double.
std::vector<double> RowInDouble(const Problem& p, uint64_t r) {
  return std::vector<double>(p.x.begin() + r * p.hidden, p.x.begin() + (r + 1) * p.hidden);
}

// Loss of one row in double: sum_i x_i / rms(x) * gamma_i * w_i.
double RowLoss(const std::vector<double>& x, const float* gamma, const float* w, double eps) {
  const double inv_rms = 1.0 / RowRms(x.data(), static_cast<uint32_t>(x.size()), eps);
  double loss = 0.0;
  for (size_t i = 0; i < x.size(); ++i) loss += x[i] * inv_rms * gamma[i] * w[i];
  return loss;
}

// Indices to check: all of them up to 1024, else 128 spread over the row (ends included).
std::vector<uint32_t> Sample(uint32_t hidden) {
  std::vector<uint32_t> out;
  if (hidden <= 1024) {
    for (uint32_t i = 0; i < hidden; ++i) out.push_back(i);
    return out;
  }
  for (uint32_t k = 0; k < 128; ++k)
    out.push_back(static_cast<uint32_t>(uint64_t{k} * (hidden - 1) / 127));
  return out;
}

using BackwardFn = std::function<void(const Problem&, bool rms_given, std::vector<float>& dx,
                                      std::vector<float>& dgamma)>;

void ReferenceFn(const Problem& p, bool rms_given, std::vector<float>& dx,
                 std::vector<float>& dgamma) {
  BackwardInputs in{p.x, p.w, p.gamma, {}, p.rows, p.hidden, kEps};
  if (rms_given) in.rms = p.rms;
  ReferenceBackward(in, absl::MakeSpan(dx), absl::MakeSpan(dgamma));
}

// trueno-gpu's small-kernel defect: sqrt(rms^2 + eps) from an rms that already contains eps.
void EpsTwiceFn(const Problem& p, bool, std::vector<float>& dx, std::vector<float>& dgamma) {
  std::vector<float> rms2(p.rows);
  for (uint64_t r = 0; r < p.rows; ++r) {
    rms2[r] = static_cast<float>(std::sqrt(double{p.rms[r]} * p.rms[r] + kEps));
  }
  BackwardInputs in{p.x, p.w, p.gamma, rms2, p.rows, p.hidden, kEps};
  ReferenceBackward(in, absl::MakeSpan(dx), absl::MakeSpan(dgamma));
}

// Forgets the term that flows through rms: dx = gamma * dy / rms.
void NoCorrectionFn(const Problem& p, bool rms_given, std::vector<float>& dx,
                    std::vector<float>& dgamma) {
  ReferenceFn(p, rms_given, dx, dgamma);
  for (uint64_t r = 0; r < p.rows; ++r) {
    for (uint32_t i = 0; i < p.hidden; ++i) {
      dx[r * p.hidden + i] = p.gamma[i] * p.w[r * p.hidden + i] / p.rms[r];
    }
  }
}

// Largest |analytic - fd| / max(1, |fd|) over dx and dgamma.
double MaxRelativeError(const Problem& p, const BackwardFn& fn, bool rms_given) {
  std::vector<float> dx(p.rows * p.hidden);
  std::vector<float> dgamma(p.hidden);
  fn(p, rms_given, dx, dgamma);
  const std::vector<uint32_t> idx = Sample(p.hidden);
  double worst = 0.0;
  const auto account = [&](double analytic, double fd) {
    worst = std::max(worst, std::abs(analytic - fd) / std::max(1.0, std::abs(fd)));
  };
  // dx: a row's loss depends only on that row's x.
  for (uint64_t r = 0; r < p.rows; ++r) {
    const float* g = p.gamma.data();
    const float* w = p.w.data() + r * p.hidden;
    std::vector<double> x = RowInDouble(p, r);
    const double h = 1e-4 * kRowScales[r % 3];
    for (uint32_t i : idx) {
      const double saved = x[i];
      x[i] = saved + h;
      const double plus = RowLoss(x, g, w, kEps);
      x[i] = saved - h;
      const double minus = RowLoss(x, g, w, kEps);
      x[i] = saved;
      account(dx[r * p.hidden + i], (plus - minus) / (2 * h));
    }
  }
  // dgamma: the loss summed over rows; gamma perturbed in double.
  std::vector<double> gd(p.gamma.begin(), p.gamma.end());
  const auto total_loss = [&]() {
    double loss = 0.0;
    for (uint64_t r = 0; r < p.rows; ++r) {
      const std::vector<double> x = RowInDouble(p, r);
      const double inv_rms = 1.0 / RowRms(x.data(), p.hidden, kEps);
      for (uint32_t i = 0; i < p.hidden; ++i)
        loss += x[i] * inv_rms * gd[i] * p.w[r * p.hidden + i];
    }
    return loss;
  };
  const double h = 1e-4;
  for (uint32_t i : idx) {
    const double saved = gd[i];
    gd[i] = saved + h;
    const double plus = total_loss();
    gd[i] = saved - h;
    const double minus = total_loss();
    gd[i] = saved;
    account(dgamma[i], (plus - minus) / (2 * h));
  }
  return worst;
}

std::vector<uint32_t> Shapes() {
  std::vector<uint32_t> dims;
  for (uint32_t h = 1; h <= 64; ++h) dims.push_back(h);
  for (uint32_t h :
       {96u, 127u, 128u, 200u, 256u, 384u, 512u, 640u, 768u, 896u, 1000u, 1024u, 4096u, 8192u}) {
    dims.push_back(h);
  }
  return dims;
}

// The reference's error against finite differences is within `tolerance` at every shape (3
// rows, seeded by seed_base + hidden_dim); prints the worst under `property`.
void ExpectReferenceWithin(const char* property, bool rms_given, uint32_t seed_base,
                           double tolerance) {
  double worst = 0.0;
  for (uint32_t h : Shapes()) {
    const Problem p = MakeProblem(h, 3, seed_base + h);
    const double err = MaxRelativeError(p, ReferenceFn, rms_given);
    EXPECT_LE(err, tolerance) << property << ", hidden_dim " << h;
    worst = std::max(worst, err);
  }
  std::cout << property << " worst relative error: " << worst << "\n";
}

TEST(ReferenceFiniteDifferenceTest, PRmsBack001WithForwardRmsWithin1e5) {
  ExpectReferenceWithin("P-RMS-BACK-001", /*rms_given=*/true, 1000, 1e-5);
}

TEST(ReferenceFiniteDifferenceTest, PBrmsBack001WithRecomputedRmsWithin1e4) {
  ExpectReferenceWithin("P-BRMS-BACK-001", /*rms_given=*/false, 2000, 1e-4);
}

TEST(ReferenceFiniteDifferenceTest, CatchesEpsCountedTwice) {
  for (uint32_t h : {1u, 7u, 32u, 896u}) {
    const Problem p = MakeProblem(h, 3, 3000 + h);
    EXPECT_GT(MaxRelativeError(p, EpsTwiceFn, true), 1e-4) << "hidden_dim " << h;
  }
}

TEST(ReferenceFiniteDifferenceTest, CatchesAMissingCorrectionTerm) {
  for (uint32_t h : {2u, 32u, 1024u}) {
    const Problem p = MakeProblem(h, 3, 4000 + h);
    EXPECT_GT(MaxRelativeError(p, NoCorrectionFn, true), 1e-4) << "hidden_dim " << h;
  }
}

TEST(ReferenceBackwardTest, HiddenDimOneMatchesTheClosedForm) {
  // y = x / sqrt(x^2 + eps) * g  =>  dy/dx = g * eps / (x^2 + eps)^(3/2).
  const std::vector<float> x = {0.5f, -2.0f, 1e-3f};
  const std::vector<float> dy = {1.0f, 0.25f, -3.0f};
  const std::vector<float> gamma = {1.5f};
  std::vector<float> dx(3), dgamma(1);
  ReferenceBackward({x, dy, gamma, {}, 3, 1, kEps}, absl::MakeSpan(dx), absl::MakeSpan(dgamma));
  double dgamma_expected = 0.0;
  for (int r = 0; r < 3; ++r) {
    const double xr = x[r];
    const double v = xr * xr + kEps;
    const double expected = dy[r] * gamma[0] * kEps / (v * std::sqrt(v));
    EXPECT_NEAR(dx[r], expected, 1e-6 * std::max(1.0, std::abs(expected))) << r;
    dgamma_expected += dy[r] * xr / std::sqrt(v);
  }
  EXPECT_NEAR(dgamma[0], dgamma_expected, 1e-6 * std::max(1.0, std::abs(dgamma_expected)));
}

TEST(ReferenceBackwardTest, DgammaIsOverwrittenNotAccumulated) {
  const Problem p = MakeProblem(8, 2, 7);
  std::vector<float> dx(16), first(8), second(8, 123.0f);
  ReferenceBackward({p.x, p.w, p.gamma, {}, 2, 8, kEps}, absl::MakeSpan(dx), absl::MakeSpan(first));
  ReferenceBackward({p.x, p.w, p.gamma, {}, 2, 8, kEps}, absl::MakeSpan(dx),
                    absl::MakeSpan(second));
  EXPECT_EQ(first, second);
}

TEST(ReferenceBackwardTest, ForwardLossAgreesWithTheDoubleLoss) {
  const Problem p = MakeProblem(33, 3, 11);
  double expected = 0.0;
  for (uint64_t r = 0; r < p.rows; ++r) {
    expected += RowLoss(RowInDouble(p, r), p.gamma.data(), p.w.data() + r * 33, kEps);
  }
  const double got = ReferenceForwardLoss(p.x, p.gamma, p.w, p.rows, 33, kEps);
  EXPECT_NEAR(got, expected, 1e-12 * std::max(1.0, std::abs(expected)));
}

}  // namespace
}  // namespace normgrad::kernels
