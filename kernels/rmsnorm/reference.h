// Plain C++ RMSNorm backward: the oracle every backend and kernel is tested against.
//
// Forward (per row r):  rms_r = sqrt(mean_i(x_ri^2) + eps),  y_ri = x_ri / rms_r * gamma_i
// Backward:
//   dx_ri     = (1/rms_r) * (gamma_i * dy_ri - x_ri / rms_r^2 * mean_j(x_rj * dy_rj * gamma_j))
//   dgamma_i  = sum_r dy_ri * x_ri / rms_r
// When the forward's rms is given it is used as is (it already contains eps).
// All sums are accumulated in double; results are rounded to float once.
//
//   std::vector<float> dx(rows * hidden), dgamma(hidden);
//   ReferenceBackward({x, dy, gamma, {}, rows, hidden, 1e-5f}, dx, dgamma);
#pragma once

#include <cstdint>

#include "absl/types/span.h"

namespace normgrad::kernels {

struct BackwardInputs {
  absl::Span<const float> x;      // num_rows * hidden_dim, row-major
  absl::Span<const float> dy;     // num_rows * hidden_dim
  absl::Span<const float> gamma;  // hidden_dim
  absl::Span<const float> rms;    // num_rows, or empty to recompute from x and eps
  uint64_t num_rows = 0;
  uint32_t hidden_dim = 0;
  float eps = 1e-5f;
};

// Writes dx (num_rows * hidden_dim) and dgamma (hidden_dim; overwritten, not accumulated).
// Preconditions (checked with a crash, callers validate first): sizes as documented above.
void ReferenceBackward(const BackwardInputs& in, absl::Span<float> dx, absl::Span<float> dgamma);

// Forward loss L = sum_ri y_ri * w_ri (so dL/dy = w): what the finite-difference tests
// differentiate. rms is recomputed from x and eps.
double ReferenceForwardLoss(absl::Span<const float> x, absl::Span<const float> gamma,
                            absl::Span<const float> w, uint64_t num_rows, uint32_t hidden_dim,
                            float eps);

}  // namespace normgrad::kernels
