#include "server/process/device_self_test.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/rmsnorm/reference.h"
#include "base/status_macros.h"

namespace normgrad::server {
namespace {

template <typename T>
absl::Span<const uint8_t> Bytes(const std::vector<T>& v) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T));
}

// The first element of `got` further than the tolerance from `want`, as a message; "" if none.
std::string FirstMismatch(const char* name, const std::vector<float>& got,
                          const std::vector<float>& want) {
  double scale = 0;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  scale = std::max(scale, 1e-30);
  for (size_t i = 0; i < want.size(); ++i) {
    const double error = std::fabs(static_cast<double>(got[i]) - want[i]) / scale;
    if (!(error <= kSelfTestTolerance)) {  // NaN fails too
      return absl::StrCat(name, "[", i, "] = ", got[i], " differs from the CPU reference ",
                          want[i], " (error ", error, " of the largest |", name, "| ", scale,
                          ", tolerance ", kSelfTestTolerance, ")");
    }
  }
  return "";
}

}  // namespace

absl::Status RunDeviceSelfTest(Backend& backend) {
  const uint64_t rows = kSelfTestRows;
  const uint32_t hidden = kSelfTestHiddenDim;
  // Smooth, sign-changing data of magnitude ~1 (no value near 0 dominates the scale).
  std::vector<float> x(rows * hidden), dy(rows * hidden), gamma(hidden);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 0.5));
    dy[i] = static_cast<float>(std::cos(0.23 * static_cast<double>(i) + 0.1));
  }
  for (size_t i = 0; i < gamma.size(); ++i) {
    gamma[i] = static_cast<float>(1.0 + 0.5 * std::sin(0.11 * static_cast<double>(i)));
  }
  kernels::BackwardRequest spec;
  spec.num_rows = rows;
  spec.hidden_dim = hidden;
  spec.eps = 1e-5f;
  spec.dtype = kernels::DType::kF32;

  std::vector<float> dx(x.size()), dgamma(hidden);
  {
    NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<BackwardSession> session,
                              backend.StartBackward(spec, Bytes(gamma)));
    NORMGRAD_RETURN_IF_ERROR(session->ProcessChunk(
        Bytes(x), Bytes(dy), {}, rows,
        absl::MakeSpan(reinterpret_cast<uint8_t*>(dx.data()), dx.size() * sizeof(float))));
    NORMGRAD_RETURN_IF_ERROR(session->Finish(
        absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma.data()), dgamma.size() * sizeof(float))));
  }
  std::vector<float> want_dx(x.size()), want_dgamma(hidden);
  kernels::ReferenceBackward({x, dy, gamma, {}, rows, hidden, spec.eps}, absl::MakeSpan(want_dx),
                             absl::MakeSpan(want_dgamma));
  std::string mismatch = FirstMismatch("dx", dx, want_dx);
  if (mismatch.empty()) mismatch = FirstMismatch("grad_gamma", dgamma, want_dgamma);
  if (!mismatch.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "self-test of the ", backend.Name(), " backend on ", backend.Device().name, " (", rows,
        " x ", hidden, " f32): ", mismatch));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::server
