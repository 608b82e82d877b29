#include "server/backend/batch_checks.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace normgrad::server::backend_internal {
namespace {

absl::Status CheckBufferBytes(absl::string_view field, size_t actual, uint64_t rows,
                              const kernels::BackwardRequest& spec) {
  const uint64_t expected = rows * spec.hidden_dim * ElementBytes(spec.dtype);
  if (actual == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " has ", actual, " bytes; expected rows (", rows, ") * hidden_dim (", spec.hidden_dim,
      ") * ", ElementBytes(spec.dtype), " bytes (", ElementName(spec.dtype), ") = ", expected));
}

}  // namespace

int ElementBytes(kernels::DType dtype) { return dtype == kernels::DType::kF32 ? 4 : 2; }

absl::string_view ElementName(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kF32:
      return "f32";
    case kernels::DType::kBF16:
      return "bf16";
    case kernels::DType::kF16:
      return "f16";
  }
  return "unknown";
}

absl::Status CheckBatch(const kernels::BackwardRequest& spec, size_t gamma_bytes) {
  if (spec.num_rows == 0) return absl::InvalidArgumentError("num_rows must be >= 1, got 0");
  if (spec.hidden_dim == 0) return absl::InvalidArgumentError("hidden_dim must be >= 1, got 0");
  NORMGRAD_RETURN_IF_ERROR(kernels::CheckEps(spec.eps, spec.rms_provided, /*kernel_reads_rms=*/true));
  if (!std::isfinite(spec.variant.gamma_offset)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gamma_offset must be finite, got ", spec.variant.gamma_offset));
  }
  if (!spec.variant.has_gamma) {
    if (gamma_bytes == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("gamma has ", gamma_bytes, " bytes; a batch without gamma takes none"));
  }
  const uint64_t expected = uint64_t{spec.hidden_dim} * ElementBytes(spec.dtype);
  if (gamma_bytes != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gamma has ", gamma_bytes, " bytes; expected hidden_dim (", spec.hidden_dim, ") * ",
        ElementBytes(spec.dtype), " bytes (", ElementName(spec.dtype), ") = ", expected));
  }
  return absl::OkStatus();
}

absl::Status CheckChunk(const kernels::BackwardRequest& spec, uint64_t rows_done, uint64_t rows, size_t x_bytes,
                        size_t dy_bytes, absl::Span<const float> rms, size_t dx_bytes) {
  if (rows == 0) return absl::InvalidArgumentError("a chunk must carry at least 1 row, got 0");
  if (rows > spec.num_rows - rows_done) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", rows, " rows after ", rows_done,
                                                   " rows exceeds num_rows (", spec.num_rows, ")"));
  }
  NORMGRAD_RETURN_IF_ERROR(CheckBufferBytes("x", x_bytes, rows, spec));
  NORMGRAD_RETURN_IF_ERROR(CheckBufferBytes("dy", dy_bytes, rows, spec));
  NORMGRAD_RETURN_IF_ERROR(CheckBufferBytes("dx", dx_bytes, rows, spec));
  const uint64_t expected_rms = spec.rms_provided ? rows : 0;
  if (rms.size() != expected_rms) {
    return absl::InvalidArgumentError(
        spec.rms_provided
            ? absl::StrCat("rms has ", rms.size(), " values; expected one per row (", rows, ")")
            : absl::StrCat("rms has ", rms.size(),
                           " values but the batch was declared without rms"));
  }
  for (size_t r = 0; r < rms.size(); ++r) {
    if (!(std::isfinite(rms[r]) && rms[r] > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rms of row ", rows_done + r, " is ", rms[r],
                       "; must be finite and > 0 (the forward pass's sqrt(mean(x^2) + eps))"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFinish(const kernels::BackwardRequest& spec, uint64_t rows_done, size_t dgamma_bytes) {
  if (rows_done != spec.num_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch ended after ", rows_done, " rows; num_rows declared ", spec.num_rows));
  }
  const uint64_t expected =
      spec.variant.has_gamma ? uint64_t{spec.hidden_dim} * ElementBytes(spec.dtype) : 0;
  if (dgamma_bytes != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("dgamma has ", dgamma_bytes, " bytes; expected ", expected,
                     spec.variant.has_gamma ? "" : " (a batch without gamma has no grad_gamma)"));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::server::backend_internal
