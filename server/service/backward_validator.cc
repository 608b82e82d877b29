#include "server/service/backward_validator.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/bounded_quote.h"
#include "base/status_macros.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_choice.h"
#include "server/proto_conversion/proto_conversion.h"

namespace normgrad::server {
namespace {

// A header size: 0 is INVALID_ARGUMENT, above the server's limit RESOURCE_EXHAUSTED (the request
// is well formed; this server is too small for it).
absl::Status CheckSize(absl::string_view field, uint64_t value, uint64_t limit,
                       absl::string_view flag) {
  if (value == 0) return absl::InvalidArgumentError(absl::StrCat(field, " is 0; must be > 0"));
  if (value > limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, " is ", value, ", above the server's limit of ", limit, " (", flag, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

BackwardValidator::BackwardValidator(const BackwardLimits& limits) : limits_(limits) {}

absl::StatusOr<AcceptedMessage> BackwardValidator::Accept(const v1::BackwardRequest& message) {
  return Accept(message, 0, 0);
}

absl::StatusOr<AcceptedMessage> BackwardValidator::Accept(const v1::BackwardRequest& message,
                                                          uint64_t beside_x_bytes,
                                                          uint64_t beside_dy_bytes) {
  const uint64_t x_bytes = message.x().size() + beside_x_bytes;
  const uint64_t dy_bytes = message.dy().size() + beside_dy_bytes;
  AcceptedMessage accepted;
  if (!has_header_) {
    NORMGRAD_RETURN_IF_ERROR(AcceptHeader(message, x_bytes, dy_bytes));
    accepted.is_header = true;
    return accepted;
  }
  NORMGRAD_ASSIGN_OR_RETURN(accepted.chunk, AcceptChunk(message, x_bytes, dy_bytes));
  return accepted;
}

absl::Status BackwardValidator::AcceptHeader(const v1::BackwardRequest& message,
                                             uint64_t x_bytes, uint64_t dy_bytes) {
  if (!message.has_header()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the first message must carry `header`; it carries a row chunk (x: ", x_bytes,
        " bytes, dy: ", dy_bytes, " bytes)"));
  }
  if (x_bytes != 0 || dy_bytes != 0 || !message.rms().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the header message must not carry row data (x: ", x_bytes,
        " bytes, dy: ", dy_bytes, " bytes, rms: ", message.rms().size(),
        " bytes); send rows in the following messages"));
  }
  const v1::BackwardHeader& h = message.header();
  NORMGRAD_RETURN_IF_ERROR(
      CheckSize("header.num_rows", h.num_rows(), limits_.max_num_rows, "--max-num-rows"));
  NORMGRAD_RETURN_IF_ERROR(
      CheckSize("header.hidden_dim", h.hidden_dim(), limits_.max_hidden_dim, "--max-hidden-dim"));
  NORMGRAD_ASSIGN_OR_RETURN(const kernels::DType dtype, DTypeFromProto(h.dtype(), "header.dtype"));
  const uint64_t element_bytes = kernels::DTypeBytes(dtype);
  NORMGRAD_RETURN_IF_ERROR(
      kernels::CheckEps(h.eps(), h.rms_provided(), /*kernel_reads_rms=*/true, "header.eps"));
  NORMGRAD_ASSIGN_OR_RETURN(const kernels::NormVariant variant, VariantFromHeader(h));
  const uint64_t gamma_expected = variant.has_gamma ? uint64_t{h.hidden_dim()} * element_bytes : 0;
  if (!variant.has_gamma && !h.gamma().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("header.gamma has ", h.gamma().size(),
                                                   " bytes; must be empty with header.no_gamma"));
  }
  if (h.gamma().size() != gamma_expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.gamma has ", h.gamma().size(), " bytes, not hidden_dim*", element_bytes, " = ",
        gamma_expected));
  }
  kernels::BackwardRequest request;
  request.num_rows = h.num_rows();
  request.hidden_dim = h.hidden_dim();
  request.eps = h.eps();
  request.dtype = dtype;
  request.rms_provided = h.rms_provided();
  request.kernel = h.options().kernel();
  request.variant = variant;
  if (!request.kernel.empty()) {
    NORMGRAD_ASSIGN_OR_RETURN(const kernels::BackwardKernel* kernel,
                              KernelNamed(request.kernel, "header.options.kernel"));
    const kernels::KernelConfig config =
        kernels::ConfigFor(request, {.target_sm = kernels::kProbeTargetSm});
    if (absl::Status s = kernel->CanImplement(config); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("header.options.kernel ", base::BoundedQuote(request.kernel),
                                       " cannot run this batch: ", s.message()));
    }
  }
  has_header_ = true;
  spec_ = std::move(request);
  element_bytes_ = element_bytes;
  row_bytes_ = uint64_t{h.hidden_dim()} * element_bytes;
  return absl::OkStatus();
}

absl::StatusOr<ValidatedChunk> BackwardValidator::AcceptChunk(const v1::BackwardRequest& message,
                                                        uint64_t x_bytes, uint64_t dy_bytes) {
  const uint64_t index = chunks_received_;
  const std::string where = absl::StrCat("chunk ", index, ": ");
  if (message.has_header()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "header repeated; only the first message may carry `header`"));
  }
  if (message.has_shm() || message.has_cuda_ipc()) {
    if (x_bytes != 0 || dy_bytes != 0 || !message.rms().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "carries ", message.has_shm() ? "shm" : "cuda_ipc", " and also row bytes (x: ",
          x_bytes, ", dy: ", dy_bytes, ", rms: ", message.rms().size(),
          "); send one or the other"));
    }
    return AcceptReferencedChunk(message, where);
  }
  if (x_bytes == 0 && dy_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "x and dy are empty; a chunk carries at least one row"));
  }
  if (x_bytes != dy_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "x has ", x_bytes, " bytes but dy has ", dy_bytes));
  }
  if (x_bytes % element_bytes_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "x has ", x_bytes, " bytes, not a multiple of ", element_bytes_, " (",
        kernels::DTypeName(spec_.dtype), " elements)"));
  }
  if (x_bytes % row_bytes_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "x has ", x_bytes, " bytes, not a multiple of hidden_dim*", element_bytes_, " = ",
        row_bytes_));
  }
  const uint64_t rows = x_bytes / row_bytes_;
  if (rows > spec_.num_rows - rows_received_) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, rows, " rows after ", rows_received_, " would exceed header.num_rows = ",
        spec_.num_rows));
  }
  if (spec_.rms_provided) {
    if (message.rms().size() != rows * 4) {
      return absl::InvalidArgumentError(absl::StrCat(where, "rms has ", message.rms().size(),
                                                     " bytes, not rows*4 = ", rows * 4,
                                                     " (rows = ", rows, ")"));
    }
  } else if (!message.rms().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "rms has ", message.rms().size(),
                                                   " bytes but header.rms_provided is false"));
  }
  return TakeRows(rows);
}

// The region or device buffers and their offsets are checked by whoever holds them
// (BackwardPipeline): here, only what the message alone says.
absl::StatusOr<ValidatedChunk> BackwardValidator::AcceptReferencedChunk(
    const v1::BackwardRequest& message, const std::string& where) {
  const bool shm = message.has_shm();
  const char* field = shm ? "shm" : "cuda_ipc";
  if (shm && message.has_cuda_ipc()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "carries both shm and cuda_ipc; send one or the other"));
  }
  const uint64_t rows = shm ? message.shm().num_rows() : message.cuda_ipc().num_rows();
  if (rows == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, field, ".num_rows is 0; a chunk carries at least one row"));
  }
  if (rows > spec_.num_rows - rows_received_) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, field, ".num_rows = ", rows, " after ", rows_received_,
        " rows would exceed header.num_rows = ", spec_.num_rows));
  }
  return TakeRows(rows);
}

ValidatedChunk BackwardValidator::TakeRows(uint64_t rows) {
  ValidatedChunk chunk;
  chunk.index = chunks_received_;
  chunk.first_row = rows_received_;
  chunk.num_rows = rows;
  rows_received_ += rows;
  ++chunks_received_;
  return chunk;
}

absl::Status BackwardValidator::AtEndOfStream() const {
  if (!has_header_) {
    return absl::InvalidArgumentError("the stream ended before its header");
  }
  if (rows_received_ != spec_.num_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("the stream ended after ", rows_received_, " of header.num_rows = ",
                     spec_.num_rows, " rows (", chunks_received_, " chunks)"));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::server
