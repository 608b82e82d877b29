// Argument checks every backend applies in the same words (internal to the backends: server/cpu
// and server/cuda). The service validates the stream first; these keep a backend safe on its own.
// Which kernel a batch gets, and the checks of a named one, are kernels/rmsnorm/kernel_choice.h's.
//
//   NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckBatch(spec, gamma.size()));
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_choice.h"
#include "server/backend/backend.h"

namespace normgrad::server::backend_internal {

int ElementBytes(kernels::DType dtype);               // 4, 2, 2
absl::string_view ElementName(kernels::DType dtype);  // "f32", "bf16", "f16"

// num_rows >= 1, hidden_dim >= 1, gamma = hidden_dim elements, and eps finite and > 0 unless
// rms_provided (then eps is neither checked nor used, as docs/api.md says).
absl::Status CheckBatch(const kernels::BackwardRequest& spec, size_t gamma_bytes);

// One chunk of `rows` rows after `rows_done` rows of the batch: every buffer's size, the total
// not above num_rows, and each given rms finite and > 0 (anything else would give inf or
// sign-flipped gradients); the error names the row within the batch and its value. One pass over
// the rms values, none over x or dy (NaN and Inf there are computed through).
absl::Status CheckChunk(const kernels::BackwardRequest& spec, uint64_t rows_done, uint64_t rows, size_t x_bytes,
                        size_t dy_bytes, absl::Span<const float> rms, size_t dx_bytes);

// All num_rows rows processed, dgamma = hidden_dim elements.
absl::Status CheckFinish(const kernels::BackwardRequest& spec, uint64_t rows_done, size_t dgamma_bytes);

}  // namespace normgrad::server::backend_internal
