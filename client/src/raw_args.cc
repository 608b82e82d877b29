#include "client/src/raw_args.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"

namespace normgrad::client_internal {
namespace {

absl::Status ValidateVariant(const RawBackwardArgs& a) {
  if (!std::isfinite(a.gamma_offset)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gamma_offset: must be finite, got ", a.gamma_offset));
  }
  if (a.no_gamma && a.gamma_offset != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gamma_offset: ", a.gamma_offset, " with no_gamma; must be 0 (an offset scales gamma)"));
  }
  if (!v1::CastingMode_IsValid(a.casting_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("casting_mode: ", static_cast<int>(a.casting_mode),
                     " is not one of 0 (unspecified: gemma), 1 (llama), 2 (gemma), 3 (none)"));
  }
  return absl::OkStatus();
}

bool Overlap(absl::Span<const uint8_t> a, absl::Span<const uint8_t> b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.data()), b0 = reinterpret_cast<uintptr_t>(b.data());
  return !a.empty() && !b.empty() && a0 < b0 + b.size() && b0 < a0 + a.size();
}

// dx is written while x and dy are read: apart from both, or with in_place exactly dy.
absl::Status ValidateDxPlace(const RawBackwardArgs& a) {
  const absl::Span<const uint8_t> dx(a.dx.data(), a.dx.size());
  if (a.in_place && dx.data() != a.dy.data()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "in_place: dx must be exactly dy's span; dx starts ",
        reinterpret_cast<intptr_t>(dx.data()) - reinterpret_cast<intptr_t>(a.dy.data()),
        " bytes from dy"));
  }
  if (Overlap(dx, a.x)) {
    return absl::InvalidArgumentError(
        "dx: overlaps x (x is read while dx is written; only dy may be written over, in_place)");
  }
  if (!a.in_place && Overlap(dx, a.dy)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dx: overlaps dy (dx starts ",
        reinterpret_cast<intptr_t>(dx.data()) - reinterpret_cast<intptr_t>(a.dy.data()),
        " bytes from dy); set in_place to write dx over dy, as exactly dy's span"));
  }
  return absl::OkStatus();
}

}  // namespace

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
  if (absl::Status s = ValidateVariant(a); !s.ok()) return s;
  // gamma and grad_gamma: hidden_dim elements each, none without gamma.
  const uint64_t gamma_bytes = a.no_gamma ? 0 : row_bytes;
  const char* gamma_name = a.no_gamma ? "gamma (no_gamma)" : "gamma";
  const char* dgamma_name = a.no_gamma ? "dgamma (no_gamma)" : "dgamma";
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
    if (s.ok()) s = check(gamma_name, a.gamma.size(), gamma_bytes);
    if (s.ok()) s = check(dgamma_name, a.dgamma.size(), gamma_bytes);
    const bool over_dy = d.dx.handle == d.dy.handle && d.dx.offset == d.dy.offset;
    if (s.ok() && a.in_place && !over_dy) {
      return absl::InvalidArgumentError(
          absl::StrCat("in_place: device.dx must be device.dy (the same handle and offset); dx "
                       "is at offset ",
                       d.dx.offset, ", dy at ", d.dy.offset,
                       d.dx.handle == d.dy.handle ? " of the same handle" : " of another handle"));
    }
    if (s.ok() && !a.in_place && over_dy) {
      return absl::InvalidArgumentError("device.dx is device.dy: set in_place to write dx over dy");
    }
    return s;
  }
  absl::Status s = check("x", a.x.size(), tensor);
  if (s.ok()) s = check("dy", a.dy.size(), tensor);
  if (s.ok()) s = check(gamma_name, a.gamma.size(), gamma_bytes);
  if (s.ok() && !a.rms.empty()) s = check("rms", a.rms.size(), rms_bytes);
  if (s.ok()) s = check("dx", a.dx.size(), tensor);
  if (s.ok()) s = check(dgamma_name, a.dgamma.size(), gamma_bytes);
  if (s.ok()) s = ValidateDxPlace(a);
  return s;
}

}  // namespace normgrad::client_internal
