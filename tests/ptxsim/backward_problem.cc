#include "tests/ptxsim/backward_problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/rmsnorm/reference.h"
#include "tests/ptxsim/sim/float16.h"

namespace normgrad::kernel_testing {

using kernels::DType;
using ptxsim::FloatToHalf;
using ptxsim::HalfToFloat;

std::vector<float> Fill(size_t n, uint32_t seed, float lo, float hi) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 1;
  for (float& f : v) {
    s = s * 1664525u + 1013904223u;
    f = lo + (hi - lo) * static_cast<float>(s >> 8) / static_cast<float>(1u << 24);
  }
  return v;
}

uint16_t ToBits16(float f, DType dtype) {
  if (dtype == DType::kF16) {
    return FloatToHalf(f);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float FromBits16(uint16_t bits, DType dtype) {
  if (dtype == DType::kF16) {
    return HalfToFloat(bits);
  }
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float RoundToElement(float f, DType dtype) {
  return dtype == DType::kF32 ? f : FromBits16(ToBits16(f, dtype), dtype);
}

std::vector<uint8_t> EncodeElements(absl::Span<const float> values, DType dtype) {
  const size_t eb = kernels::DTypeBytes(dtype);
  std::vector<uint8_t> out(values.size() * eb);
  for (size_t i = 0; i < values.size(); ++i) {
    if (eb == 4) {
      std::memcpy(&out[4 * i], &values[i], 4);
    } else {
      const uint16_t bits = ToBits16(values[i], dtype);
      std::memcpy(&out[2 * i], &bits, 2);
    }
  }
  return out;
}

std::vector<float> DecodeElements(absl::Span<const uint8_t> bytes, DType dtype) {
  const size_t eb = kernels::DTypeBytes(dtype);
  std::vector<float> out(bytes.size() / eb);
  for (size_t i = 0; i < out.size(); ++i) {
    if (eb == 4) {
      std::memcpy(&out[i], &bytes[4 * i], 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &bytes[2 * i], 2);
      out[i] = FromBits16(bits, dtype);
    }
  }
  return out;
}

double DxTolerance(DType dtype) {
  return dtype == DType::kF32 ? 1e-5 : dtype == DType::kF16 ? 5e-4 : 4e-3;
}

double DgammaTolerance(uint32_t rows) { return 1e-5 * std::max(1.0, std::sqrt(rows / 64.0)); }

BackwardProblem MakeBackwardProblem(DType dtype, uint32_t rows, uint32_t hidden, float eps) {
  BackwardProblem p;
  p.dtype = dtype;
  p.rows = rows;
  p.hidden = hidden;
  p.eps = eps;
  const size_t n = size_t{rows} * hidden;
  p.x = Fill(n, 1 + hidden, -1.0f, 1.0f);
  p.dy = Fill(n, 7 + hidden, -1.0f, 1.0f);
  p.gamma = Fill(hidden, 13 + hidden, 0.5f, 1.5f);
  for (std::vector<float>* v : {&p.x, &p.dy, &p.gamma}) {
    for (float& f : *v) f = RoundToElement(f, dtype);  // what the kernel will read
  }
  p.rms.resize(rows);
  for (uint32_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (uint32_t i = 0; i < hidden; ++i) {
      const double v = p.x[size_t{r} * hidden + i];
      sum += v * v;
    }
    p.rms[r] = static_cast<float>(std::sqrt(sum / hidden + eps));
  }
  return p;
}

BackwardReference ReferenceFor(const BackwardProblem& p, bool with_rms) {
  BackwardReference want;
  want.dx.resize(p.x.size());
  want.dgamma.resize(p.hidden);
  kernels::ReferenceBackward(
      {p.x, p.dy, p.gamma, with_rms ? p.rms : std::vector<float>{}, p.rows, p.hidden, p.eps},
      absl::MakeSpan(want.dx), absl::MakeSpan(want.dgamma));
  return want;
}

BackwardReference VariantReferenceFor(const BackwardProblem& p, const kernels::NormVariant& v,
                                      bool with_rms) {
  const bool rounds = p.dtype != kernels::DType::kF32;
  const bool round_m = rounds && v.has_gamma && v.casting != kernels::CastingMode::kGemma;
  const bool round_n = rounds && v.casting == kernels::CastingMode::kLlama;
  const size_t h = p.hidden;
  BackwardReference out;
  out.dx.resize(size_t{p.rows} * h);
  std::vector<double> dgamma(h, 0.0);
  std::vector<double> m(h);
  for (uint32_t r = 0; r < p.rows; ++r) {
    const float* x = &p.x[r * h];
    const float* dy = &p.dy[r * h];
    double sum_sq = 0;
    for (size_t i = 0; i < h; ++i) sum_sq += double{x[i]} * x[i];
    const double rms = with_rms ? double{p.rms[r]} : std::sqrt(sum_sq / h + p.eps);
    const double inv = 1.0 / rms;
    const float inv_f32 = 1.0f / p.rms[r];
    double dot = 0;
    for (size_t i = 0; i < h; ++i) {
      const float scale = v.has_gamma ? v.gamma_offset + p.gamma[i] : 1.0f;
      const float product = dy[i] * scale;
      m[i] = round_m ? RoundToElement(product, p.dtype) : double{dy[i]} * scale;
      dot += m[i] * x[i];
    }
    const double c = inv * inv / h * dot;
    for (size_t i = 0; i < h; ++i) {
      out.dx[r * h + i] = static_cast<float>(inv * (m[i] - c * x[i]));
      const double n = round_n ? RoundToElement(x[i] * inv_f32, p.dtype) : x[i] * inv;
      dgamma[i] += dy[i] * n;
    }
  }
  if (v.has_gamma) out.dgamma.assign(dgamma.begin(), dgamma.end());
  return out;
}

double MaxRelativeError(absl::Span<const float> got, absl::Span<const float> want) {
  double worst = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double w = want[i];
    worst = std::max(worst, std::fabs(got[i] - w) / std::max(1.0, std::fabs(w)));
  }
  return worst;
}

absl::Status CheckClose(absl::Span<const float> got, absl::Span<const float> want, double tolerance,
                        const char* what) {
  if (got.size() != want.size()) {
    return absl::InternalError(
        absl::StrCat(what, " has ", got.size(), " elements, expected ", want.size()));
  }
  std::string failures;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = tolerance * std::max(1.0, std::fabs(static_cast<double>(want[i])));
    // Written so that a NaN fails.
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= bound) && reported++ < 5) {
      absl::StrAppend(&failures, "\n  ", what, "[", i, "] = ", got[i], ", expected ", want[i],
                      " (bound ", bound, ")");
    }
  }
  if (reported == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(reported, " of ", got.size(), " ", what,
                                          " elements outside the tolerance:", failures));
}

}  // namespace normgrad::kernel_testing
