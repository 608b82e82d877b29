// Validates the message sequence of one RmsNormBackward stream, with no gRPC in sight (so it is
// unit-tested and fuzzed on its own). Feed it every request message in arrival order, then call
// AtEndOfStream() when the client half-closes. Each error is INVALID_ARGUMENT naming the field and
// the numbers (or RESOURCE_EXHAUSTED for a server limit); after the first error the stream is
// over and the validator must not be fed again.
//
//   BackwardValidator v(limits);
//   absl::StatusOr<AcceptedMessage> m = v.Accept(request);   // header first, then row chunks
//   ...
//   absl::Status end = v.AtEndOfStream();                     // every declared row arrived?
//
// Not thread-safe: one stream, one validator, one thread at a time.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/backend/backend.h"

namespace normgrad::server {

// Server-side limits on one batch (flags --max-hidden-dim and --max-num-rows).
struct BackwardLimits {
  uint32_t max_hidden_dim = 65536;
  uint64_t max_num_rows = uint64_t{1} << 32;
};

// A row chunk that passed validation: rows [first_row, first_row + num_rows) of the batch.
struct ValidatedChunk {
  uint64_t index = 0;  // 0 for the first chunk after the header
  uint64_t first_row = 0;
  uint64_t num_rows = 0;
};

struct AcceptedMessage {
  bool is_header = false;
  ValidatedChunk chunk;  // set when !is_header
};

class BackwardValidator {
 public:
  explicit BackwardValidator(const BackwardLimits& limits);

  // The first message must carry `header` (and gamma) and nothing else; every later message is a
  // row chunk: x and dy of equal length (elements of header.dtype), a whole number of rows, no more rows than declared, and
  // `rms` (rows * 4 bytes) exactly when header.rms_provided. A chunk with `shm` (or `cuda_ipc`)
  // carries no row bytes and shm.num_rows rows (its region or buffers are the caller's to check).
  absl::StatusOr<AcceptedMessage> Accept(const v1::BackwardRequest& message);
  // The same, for a message whose x and dy came beside it (bulk_wire.h: its own are empty):
  // their sizes.
  absl::StatusOr<AcceptedMessage> Accept(const v1::BackwardRequest& message,
                                         uint64_t beside_x_bytes, uint64_t beside_dy_bytes);

  // OK when a header arrived and the chunks carried exactly header.num_rows rows.
  absl::Status AtEndOfStream() const;

  bool has_header() const { return has_header_; }
  const kernels::BackwardRequest& spec() const { return spec_; }  // valid once has_header()
  uint64_t rows_received() const { return rows_received_; }
  uint64_t chunks_received() const { return chunks_received_; }
  uint64_t row_bytes() const { return row_bytes_; }  // hidden_dim * element size

 private:
  absl::Status AcceptHeader(const v1::BackwardRequest& message, uint64_t x_bytes,
                            uint64_t dy_bytes);
  absl::StatusOr<ValidatedChunk> AcceptChunk(const v1::BackwardRequest& message, uint64_t x_bytes,
                                       uint64_t dy_bytes);
  // A chunk whose rows are elsewhere (shm or cuda_ipc).
  absl::StatusOr<ValidatedChunk> AcceptReferencedChunk(const v1::BackwardRequest& message,
                                                 const std::string& where);
  ValidatedChunk TakeRows(uint64_t rows);  // records the next chunk of `rows` rows

  BackwardLimits limits_;
  bool has_header_ = false;
  kernels::BackwardRequest spec_;
  uint64_t element_bytes_ = 4;
  uint64_t row_bytes_ = 0;
  uint64_t rows_received_ = 0;
  uint64_t chunks_received_ = 0;
};

}  // namespace normgrad::server
