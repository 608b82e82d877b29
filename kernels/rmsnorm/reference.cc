#include "kernels/rmsnorm/reference.h"

#include <cmath>
#include <cstdlib>
#include <vector>

namespace normgrad::kernels {
namespace {

void Require(bool ok) {
  if (!ok) std::abort();  // a caller bug, not bad input: callers validate sizes first
}

}  // namespace

void ReferenceBackward(const BackwardInputs& in, absl::Span<float> dx, absl::Span<float> dgamma) {
  const uint64_t rows = in.num_rows;
  const uint64_t h = in.hidden_dim;
  Require(in.x.size() == rows * h && in.dy.size() == rows * h && in.gamma.size() == h);
  Require(in.rms.empty() || in.rms.size() == rows);
  Require(dx.size() == rows * h && dgamma.size() == h);

  std::vector<double> dgamma_acc(h, 0.0);
  for (uint64_t r = 0; r < rows; ++r) {
    const float* x = in.x.data() + r * h;
    const float* dy = in.dy.data() + r * h;
    double rms;
    if (in.rms.empty()) {
      double sum_sq = 0.0;
      for (uint64_t i = 0; i < h; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
      rms = std::sqrt(sum_sq / static_cast<double>(h) + static_cast<double>(in.eps));
    } else {
      rms = in.rms[r];
    }
    const double inv_rms = 1.0 / rms;
    double sum_xdyg = 0.0;
    for (uint64_t i = 0; i < h; ++i) {
      sum_xdyg += static_cast<double>(x[i]) * dy[i] * in.gamma[i];
    }
    const double mean_xdyg = sum_xdyg / static_cast<double>(h);
    const double correction = inv_rms * inv_rms * mean_xdyg;
    float* out = dx.data() + r * h;
    for (uint64_t i = 0; i < h; ++i) {
      out[i] = static_cast<float>(inv_rms * (static_cast<double>(in.gamma[i]) * dy[i] -
                                             static_cast<double>(x[i]) * correction));
      dgamma_acc[i] += static_cast<double>(dy[i]) * x[i] * inv_rms;
    }
  }
  for (uint64_t i = 0; i < h; ++i) dgamma[i] = static_cast<float>(dgamma_acc[i]);
}

double ReferenceForwardLoss(absl::Span<const float> x, absl::Span<const float> gamma,
                            absl::Span<const float> w, uint64_t num_rows, uint32_t hidden_dim,
                            float eps) {
  const uint64_t h = hidden_dim;
  Require(x.size() == num_rows * h && w.size() == num_rows * h && gamma.size() == h);
  double loss = 0.0;
  for (uint64_t r = 0; r < num_rows; ++r) {
    const float* xr = x.data() + r * h;
    const float* wr = w.data() + r * h;
    double sum_sq = 0.0;
    for (uint64_t i = 0; i < h; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(h) + eps);
    for (uint64_t i = 0; i < h; ++i)
      loss += static_cast<double>(xr[i]) * inv_rms * gamma[i] * wr[i];
  }
  return loss;
}

}  // namespace normgrad::kernels
