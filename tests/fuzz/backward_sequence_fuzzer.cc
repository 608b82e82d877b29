// Fuzzes the RmsNormBackward request sequence through BackwardValidator, the validation the
// service runs on every message of a stream, before any byte reaches a backend.
//
// Input: [limits byte] then pieces of [2-byte little-endian length][that many bytes]; each piece
// is parsed as a v1::BackwardRequest (pieces protobuf refuses are skipped, as gRPC would refuse
// the message) and fed in order, so headers and chunks arrive in any order, count and size.
// The limits byte picks small server limits so the RESOURCE_EXHAUSTED paths are reachable.
//
// Contract checked beyond "no crash": an accepted chunk lies inside the declared rows, rows only
// grow, and AtEndOfStream() is OK exactly when every declared row arrived.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "google/protobuf/stubs/logging.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/service/backward_validator.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

// Protobuf logs every string field that is not UTF-8; random input makes thousands of them.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  normgrad::server::BackwardLimits limits;
  if (data[0] & 1) limits.max_hidden_dim = 64;
  if (data[0] & 2) limits.max_num_rows = 16;
  normgrad::server::BackwardValidator validator(limits);
  size_t pos = 1;
  uint64_t rows_before = 0;
  bool failed = false;
  while (pos + 2 <= size && !failed) {
    const size_t length = std::min<size_t>(data[pos] | (size_t{data[pos + 1]} << 8), size - pos - 2);
    pos += 2;
    normgrad::v1::BackwardRequest request;
    const bool parsed = request.ParseFromArray(data + pos, static_cast<int>(length));
    pos += length;
    if (!parsed) continue;
    absl::StatusOr<normgrad::server::AcceptedMessage> accepted = validator.Accept(request);
    if (!accepted.ok()) {
      Check(accepted.status().code() == absl::StatusCode::kInvalidArgument ||
            accepted.status().code() == absl::StatusCode::kResourceExhausted);
      Check(!accepted.status().message().empty());
      failed = true;  // the stream is over: the service never feeds the validator again
      break;
    }
    Check(validator.has_header());
    if (accepted->is_header) continue;
    const normgrad::server::ValidatedChunk& chunk = accepted->chunk;
    Check(chunk.num_rows > 0);
    Check(chunk.first_row == rows_before);
    Check(chunk.first_row + chunk.num_rows <= validator.spec().num_rows);
    if (request.has_shm() || request.has_cuda_ipc()) {
      // Rows in a shared-memory region or in device memory: none in the message, and one place.
      Check(request.x().empty() && request.dy().empty() && request.rms().empty());
      Check(!(request.has_shm() && request.has_cuda_ipc()));
      Check(chunk.num_rows ==
            (request.has_shm() ? request.shm().num_rows() : request.cuda_ipc().num_rows()));
    } else {
      Check(uint64_t{request.x().size()} == chunk.num_rows * validator.row_bytes());
    }
    rows_before += chunk.num_rows;
    Check(validator.rows_received() == rows_before);
  }
  if (!failed) {
    const absl::Status end = validator.AtEndOfStream();
    Check(end.ok() == (validator.has_header() && rows_before == validator.spec().num_rows));
  }
  return 0;
}
