#include "tests/server/service/batch_test_util.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "kernels/rmsnorm/reference.h"

namespace normgrad::server::testing {

Batch RandomBatch(uint64_t rows, uint32_t hidden, uint32_t seed, bool with_rms) {
  Batch b;
  b.rows = rows;
  b.hidden = hidden;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  b.x.resize(rows * hidden);
  b.dy.resize(rows * hidden);
  b.gamma.resize(hidden);
  for (float& v : b.x) v = u(rng);
  for (float& v : b.dy) v = u(rng);
  for (float& v : b.gamma) v = 0.5f + u(rng);
  if (with_rms) {
    b.rms.resize(rows);
    for (uint64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (uint32_t i = 0; i < hidden; ++i) sum += double{b.x[r * hidden + i]} * b.x[r * hidden + i];
      b.rms[r] = static_cast<float>(std::sqrt(sum / hidden + b.eps));
    }
  }
  return b;
}

void ReferenceFor(const Batch& b, std::vector<float>& dx, std::vector<float>& dgamma) {
  dx.assign(b.rows * b.hidden, 0.0f);
  dgamma.assign(b.hidden, 0.0f);
  kernels::ReferenceBackward({b.x, b.dy, b.gamma, b.rms, b.rows, b.hidden, b.eps},
                             absl::MakeSpan(dx), absl::MakeSpan(dgamma));
}

v1::BackwardRequest HeaderFor(const Batch& b) {
  v1::BackwardRequest m;
  v1::BackwardHeader* h = m.mutable_header();
  h->set_num_rows(b.rows);
  h->set_hidden_dim(b.hidden);
  h->set_eps(b.eps);
  h->set_dtype(v1::DTYPE_F32);
  h->set_gamma(b.gamma.data(), b.gamma.size() * 4);
  h->set_rms_provided(!b.rms.empty());
  return m;
}

v1::BackwardRequest ChunkFor(const Batch& b, uint64_t first_row, uint64_t rows) {
  v1::BackwardRequest m;
  const size_t offset = first_row * b.hidden;
  const size_t bytes = rows * b.hidden * 4;
  m.set_x(reinterpret_cast<const char*>(b.x.data() + offset), bytes);
  m.set_dy(reinterpret_cast<const char*>(b.dy.data() + offset), bytes);
  if (!b.rms.empty()) m.set_rms(reinterpret_cast<const char*>(b.rms.data() + first_row), rows * 4);
  return m;
}

double MaxScaledError(const std::vector<float>& got, const std::vector<float>& want,
                      double min_scale) {
  if (got.size() != want.size()) return INFINITY;
  double scale = min_scale;
  for (float w : want) scale = std::max(scale, std::fabs(double{w}));
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(double{got[i]} - want[i]) / (std::fabs(double{want[i]}) + scale);
    if (!(e <= worst)) worst = e;  // NaN propagates as the worst
    if (std::isnan(e)) return INFINITY;
  }
  return worst;
}

double MaxDxError(const Batch& b, const std::vector<float>& got, const std::vector<float>& want) {
  double terms = 0;
  for (uint64_t r = 0; r < b.rows; ++r) {
    double rms;
    if (!b.rms.empty()) {
      rms = b.rms[r];
    } else {
      double sum = 0;
      for (uint32_t i = 0; i < b.hidden; ++i) sum += double{b.x[r * b.hidden + i]} * b.x[r * b.hidden + i];
      rms = std::sqrt(sum / b.hidden + b.eps);
    }
    for (uint32_t i = 0; i < b.hidden; ++i) {
      const double t = std::fabs(double{b.gamma[i]} * b.dy[r * b.hidden + i]) / rms;
      if (std::isfinite(t)) terms = std::max(terms, t);
    }
  }
  return MaxScaledError(got, want, terms);
}

}  // namespace normgrad::server::testing
