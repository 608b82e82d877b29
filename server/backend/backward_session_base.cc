#include "server/backend/backward_session_base.h"

#include <chrono>
#include <utility>

#include "base/status_macros.h"
#include "server/backend/batch_checks.h"
#include "server/host_rows/element_conversion.h"

namespace normgrad::server::backend_internal {

BackwardSessionBase::BackwardSessionBase(const kernels::BackwardRequest& spec, std::vector<double> dgamma_sum)
    : spec_(spec), dgamma_sum_(std::move(dgamma_sum)) {
  dgamma_sum_.assign(spec.hidden_dim, 0.0);
}

absl::Status BackwardSessionBase::Compute(uint64_t rows,
                                          const std::function<absl::Status()>& compute) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = compute();
  compute_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) {
    broken_ = s;
    return s;
  }
  rows_done_ += rows;
  return absl::OkStatus();
}

absl::Status BackwardSessionBase::Finish(absl::Span<uint8_t> dgamma) {
  NORMGRAD_RETURN_IF_ERROR(broken_);
  NORMGRAD_RETURN_IF_ERROR(CheckFinish(spec_, rows_done_, dgamma.size()));
  if (!spec_.variant.has_gamma) return absl::OkStatus();
  std::vector<float> rounded(dgamma_sum_.begin(), dgamma_sum_.end());
  host_rows::ConvertFromF32(spec_.dtype, rounded.data(), dgamma.data(), rounded.size());
  return absl::OkStatus();
}

}  // namespace normgrad::server::backend_internal
