// What every backend's BackwardSession shares, written once: the batch's spec, the rows done, the
// time spent computing, grad_gamma accumulated in double over the chunks (rounded once by
// Finish), and a failed chunk ending the session. A backend's session derives from it and
// computes its chunks inside Compute.
//
//   absl::Status ProcessChunk(...) override {
//     NORMGRAD_RETURN_IF_ERROR(broken_);
//     NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckChunk(spec_, rows_done_, rows, ...));
//     return Compute(rows, [&] { ... dgamma_sum_[i] += ...; return absl::OkStatus(); });
//   }
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/backend/backend.h"

namespace normgrad::server::backend_internal {

class BackwardSessionBase : public BackwardSession {
 public:
  // broken_, else CheckFinish, then dgamma_sum_ rounded to the batch's dtype.
  absl::Status Finish(absl::Span<uint8_t> dgamma) final;
  double ComputeSeconds() const final { return compute_seconds_; }

 protected:
  // `dgamma_sum`: storage to reuse (a pool's); resized to hidden_dim zeros.
  explicit BackwardSessionBase(const kernels::BackwardRequest& spec, std::vector<double> dgamma_sum = {});

  // Runs `compute` and adds its time to ComputeSeconds; on success `rows` more rows are done, on
  // failure the session is broken (the chunk may be half done): every later call returns it.
  absl::Status Compute(uint64_t rows, const std::function<absl::Status()>& compute);

  const kernels::BackwardRequest spec_;
  uint64_t rows_done_ = 0;
  std::vector<double> dgamma_sum_;  // the batch's grad_gamma so far
  absl::Status broken_;             // OK until a chunk failed

 private:
  double compute_seconds_ = 0;
};

}  // namespace normgrad::server::backend_internal
