// The bound bf16 and f16 outputs are held to, on every backend (docs/kernels.md, "The bound for
// bf16 and f16 outputs"), the reference it is measured from, and the hard cases it is tested on.
//
//   const HalfInputs in = MakeHardInputs(DType::kBF16, /*rows=*/12, /*hidden=*/4099, variant, 7);
//   const HalfReference want = HalfReferenceFor(in, variant, /*with_rms=*/false, {});
//   ... run a backend, decode dx and grad_gamma to float ...
//   EXPECT_EQ(CountOutsideBound(DType::kBF16, got_dx, want.dx, want.dx_tol), 0u);
//
// Every output element o with reference value e (computed in double from the stored inputs) and
// tolerance t: o is what rounding some value within t of e to the output dtype gives (through
// f32, as every backend rounds), so |o - e| <= one unit of the dtype + t, where
//   dx:         t = 2^-19 * r * (|m| + C * |x|)  +  2^-149 * r * (1 + r^2 * |x|)
//   grad_gamma: t = 2^-19 * sum over rows |dy * n|  +  2^-149 * sum over rows r
// with r = 1/rms, m = dy * scale (rounded as the casting mode says), C = r^2 * mean(|m * x|)
// (the correction's terms), n = x * r. 2^-19 is 32 roundings of float32 (2^-24 each) of the
// terms that enter the element; 2^-149 is float32's smallest step, what a term below its normal
// range (2^-126) rounds to a multiple of.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/kernel_config.h"

namespace normgrad::half_bound {

using kernels::CastingMode;
using kernels::DType;

// v rounded to nearest even in `type`'s precision (bf16: 8 significant bits, f16: 11, f32: 24)
// with its subnormal step; beyond the largest finite value of f16 and f32 it is infinite.
inline double RoundTo(DType type, double v) {
  if (v == 0 || !std::isfinite(v)) return v;
  const int bits = type == DType::kBF16 ? 8 : type == DType::kF16 ? 11 : 24;
  const int min_step_exp = type == DType::kBF16 ? -133 : type == DType::kF16 ? -24 : -149;
  int e = 0;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  const int step_exp = std::max(e - bits, min_step_exp);
  const double r = std::ldexp(std::nearbyint(std::ldexp(v, -step_exp)), step_exp);
  const double max = type == DType::kF16 ? 65504.0 : static_cast<double>(std::numeric_limits<float>::max());
  if (std::fabs(r) > max) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}

// Whether `got` is what an output path that rounds to f32 and then to `type` gives for some value
// within `tol` of `expected`.
// A reference beyond the dtype's range (f16 overflows to infinity) must be met exactly.
inline bool IsRoundedFrom(DType type, double got, double expected, double tol) {
  auto output = [type](double v) { return RoundTo(type, RoundTo(DType::kF32, v)); };
  if (!std::isfinite(output(expected))) return got == output(expected);
  return output(expected - tol) <= got && got <= output(expected + tol);
}

// Stored inputs (each value exact in the dtype) of `rows` x `hidden`.
struct HalfInputs {
  DType dtype = DType::kBF16;
  uint64_t rows = 0;
  uint32_t hidden = 0;
  float eps = 1e-5f;
  std::vector<float> x, dy, gamma;  // gamma empty without gamma
  std::vector<float> rms;           // the forward's rms of each row (f32 of the double value)
};

// Hard cases: magnitudes spread evenly in exponent over 2^-12 .. 2^12 (f16: 2^-12 .. 2^6, so that
// gamma*dy, which the casting modes round to f16, stays below 65504), either sign; and every
// third row one where gamma*dy and x*correction cancel (dy = a * x / scale, rounded to the
// dtype; x = 0 where that leaves the spread), so dx is a small difference of large terms.
inline HalfInputs MakeHardInputs(DType dtype, uint64_t rows, uint32_t hidden,
                                 const kernels::NormVariant& variant, uint32_t seed) {
  HalfInputs in;
  in.dtype = dtype;
  in.rows = rows;
  in.hidden = hidden;
  std::mt19937 gen(seed * 7919u + hidden);
  const double top = dtype == DType::kF16 ? 6.0 : 12.0;
  std::uniform_real_distribution<double> exponent(-12.0, top);
  std::bernoulli_distribution negative(0.5);
  auto value = [&] {
    const double v = std::exp2(exponent(gen));
    return static_cast<float>(RoundTo(dtype, negative(gen) ? -v : v));
  };
  if (variant.has_gamma) {
    in.gamma.resize(hidden);
    for (float& g : in.gamma) g = value();
  }
  auto scale = [&](uint32_t i) -> double {
    return variant.has_gamma ? static_cast<double>(variant.gamma_offset + in.gamma[i]) : 1.0;
  };
  in.x.resize(rows * hidden);
  in.dy.resize(rows * hidden);
  for (uint64_t r = 0; r < rows; ++r) {
    float* x = in.x.data() + r * hidden;
    float* dy = in.dy.data() + r * hidden;
    for (uint32_t i = 0; i < hidden; ++i) x[i] = value();
    const bool cancels = r % 3 == 2;
    const double a = std::exp2(exponent(gen) / 4);  // 2^-3 .. 2^3
    for (uint32_t i = 0; i < hidden; ++i) {
      const double s = scale(i);
      const double d = s != 0 ? std::fabs(a * x[i] / s) : 0;
      if (!cancels) {
        dy[i] = value();
      } else if (d >= 0x1p-12 && d <= std::exp2(top)) {
        dy[i] = static_cast<float>(RoundTo(dtype, a * x[i] / s));
      } else {  // outside the spread: an x of 0 keeps the row's cancellation
        x[i] = 0;
        dy[i] = value();
      }
    }
    double sum = 0;
    for (uint32_t i = 0; i < hidden; ++i) sum += static_cast<double>(x[i]) * x[i];
    in.rms.push_back(static_cast<float>(std::sqrt(sum / hidden + double{in.eps})));
  }
  return in;
}

// How a backend forms the casting modes' rounded values (the llama and none modes): from the
// product in double, rounded once (the CPU), or from the f32 product (the GPU kernels).
enum class Products { kDouble, kF32 };

struct HalfReference {
  std::vector<double> dx, dx_tol, dgamma, dgamma_tol;
};

// The math in double from the stored values, with the casting mode's roundings R (to the dtype):
// s = offset + gamma (one f32 add), or 1; m = dy * s (R(m) for llama and none); dx = r * (m - c*x)
// with c = r^2 * mean(m * x); grad_gamma += dy * n, n = x * r (R(n) for llama; the f32 x * 1/rms
// when products are kF32). The tolerances are the bound's (above).
inline HalfReference HalfReferenceFor(const HalfInputs& in, const kernels::NormVariant& v,
                                      bool with_rms, Products products) {
  const uint32_t h = in.hidden;
  const bool round_m = v.casting != CastingMode::kGemma;
  const bool round_n = v.casting == CastingMode::kLlama;
  constexpr double kTerms = 0x1p-19, kStep = 0x1p-149;
  HalfReference e;
  e.dx.resize(in.rows * h);
  e.dx_tol.resize(in.rows * h);
  e.dgamma.assign(v.has_gamma ? h : 0, 0.0);
  e.dgamma_tol.assign(v.has_gamma ? h : 0, 0.0);
  std::vector<double> m(h);
  for (uint64_t row = 0; row < in.rows; ++row) {
    const float* x = in.x.data() + row * h;
    const float* dy = in.dy.data() + row * h;
    double sum_sq = 0;
    for (uint32_t i = 0; i < h; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
    const double rms = with_rms ? in.rms[row] : std::sqrt(sum_sq / h + double{in.eps});
    const double r = 1.0 / rms;
    double sum_mx = 0, sum_abs_mx = 0;
    for (uint32_t i = 0; i < h; ++i) {
      const double s =
          v.has_gamma ? static_cast<double>(static_cast<float>(v.gamma_offset + in.gamma[i])) : 1;
      const double product = products == Products::kF32
                                 ? static_cast<double>(static_cast<float>(dy[i] * s))
                                 : dy[i] * s;
      m[i] = round_m ? RoundTo(in.dtype, product) : product;
      sum_mx += m[i] * x[i];
      sum_abs_mx += std::fabs(m[i] * x[i]);
    }
    const double c = r * r * sum_mx / h;
    const double c_abs = r * r * sum_abs_mx / h;
    const float r_f32 = static_cast<float>(r);
    for (uint32_t i = 0; i < h; ++i) {
      const size_t at = row * h + i;
      e.dx[at] = r * (m[i] - c * x[i]);
      e.dx_tol[at] = kTerms * std::fabs(r) * (std::fabs(m[i]) + c_abs * std::fabs(x[i])) +
                     kStep * std::fabs(r) * (1 + r * r * std::fabs(x[i]));
      if (!v.has_gamma) continue;
      double n = products == Products::kF32 ? static_cast<double>(x[i] * r_f32) : x[i] * r;
      if (round_n) n = RoundTo(in.dtype, n);
      e.dgamma[i] += dy[i] * n;
      e.dgamma_tol[i] += kTerms * std::fabs(dy[i] * n) + kStep * std::fabs(r);
    }
  }
  return e;
}

// How many of `got` are outside the bound (IsRoundedFrom `want` within `tol`) for output `dtype`.
inline size_t CountOutsideBound(DType dtype, const std::vector<float>& got,
                                const std::vector<double>& want, const std::vector<double>& tol,
                                size_t* first_bad = nullptr) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (IsRoundedFrom(dtype, got[i], want[i], tol[i])) continue;
    if (bad++ == 0 && first_bad != nullptr) *first_bad = i;
  }
  return bad + (got.size() == want.size() ? 0 : 1);
}

}  // namespace normgrad::half_bound
