// Validation of a RawBackwardArgs before anything is sent: counts, buffer sizes against the
// sizes the counts imply (overflow-checked), and the device form's handles. Internal to the
// client library; the fuzzer in tests/fuzz/ drives it with hostile counts.
//
//   if (absl::Status s = client_internal::ValidateRaw(args); !s.ok()) return s;
#pragma once

#include "absl/status/status.h"
#include "normgrad/client.h"

namespace normgrad::client_internal {

// OK when every buffer has exactly the bytes num_rows, hidden_dim and type imply (rms optional),
// or, for the device form, when x, dy, rms and dx are empty and each handle is well formed.
// INVALID_ARGUMENT naming the field and the numbers otherwise, including counts whose byte size
// overflows 64 bits or int64_t. Also the variant (gamma_offset finite, 0 with no_gamma, whose
// gamma and dgamma are empty; a known casting_mode) and where dx is: apart from x and dy, or
// with in_place exactly dy.
absl::Status ValidateRaw(const RawBackwardArgs& a);

}  // namespace normgrad::client_internal
