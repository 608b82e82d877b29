#include "client/src/raw_args.h"

#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"

namespace normgrad::client_internal {

absl::Status ValidateRaw(const RawBackwardArgs& a) {
  const uint64_t elem = ElementBytes(a.type);
  if (a.hidden_dim == 0) return absl::InvalidArgumentError("hidden_dim: must be > 0, got 0");
  if (a.num_rows == 0) return absl::InvalidArgumentError("num_rows: must be > 0, got 0");
  // Every size below is a product of caller-given counts: checked for overflow first, so a
  // wrapped product can never match a short buffer (num_rows = 2^60 + 8, hidden_dim = 4, f32).
  uint64_t tensor = 0, row_bytes = 0, rms_bytes = 0;
  if (__builtin_mul_overflow(uint64_t{a.hidden_dim}, elem, &row_bytes) ||
      __builtin_mul_overflow(a.num_rows, row_bytes, &tensor) ||
      __builtin_mul_overflow(a.num_rows, uint64_t{4}, &rms_bytes) ||
      tensor > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_rows * hidden_dim: ", a.num_rows, " x ", a.hidden_dim, " elements of ", elem,
        " bytes overflow a 64-bit byte count"));
  }
  auto check = [](const char* name, uint64_t got, uint64_t want) {
    if (got == want) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", got, " bytes, expected ", want));
  };
  if (a.device.has_value()) {
    const CudaIpcTensors& d = *a.device;
    if (!a.x.empty() || !a.dy.empty() || !a.rms.empty() || !a.dx.empty()) {
      return absl::InvalidArgumentError(
          "device: set, so x, dy, rms and dx must be empty (they are in device memory)");
    }
    if (d.device_uuid.size() != 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("device.device_uuid: ", d.device_uuid.size(), " bytes, expected 16"));
    }
    absl::Status s = check("device.x.handle", d.x.handle.size(), 64);
    if (s.ok()) s = check("device.dy.handle", d.dy.handle.size(), 64);
    if (s.ok()) s = check("device.dx.handle", d.dx.handle.size(), 64);
    if (s.ok() && d.rms.has_value()) s = check("device.rms.handle", d.rms->handle.size(), 64);
    if (s.ok()) s = check("gamma", a.gamma.size(), row_bytes);
    if (s.ok()) s = check("dgamma", a.dgamma.size(), row_bytes);
    return s;
  }
  absl::Status s = check("x", a.x.size(), tensor);
  if (s.ok()) s = check("dy", a.dy.size(), tensor);
  if (s.ok()) s = check("gamma", a.gamma.size(), row_bytes);
  if (s.ok() && !a.rms.empty()) s = check("rms", a.rms.size(), rms_bytes);
  if (s.ok()) s = check("dx", a.dx.size(), tensor);
  if (s.ok()) s = check("dgamma", a.dgamma.size(), row_bytes);
  return s;
}

}  // namespace normgrad::client_internal
