// RmsNormBackwardUnary without gRPC: a whole batch in one request message, its answer in one
// response. The same parts as a stream's (BackwardValidator, AdmissionController,
// BackwardJobRunner), run one after the other on the caller's thread: a batch that computes in
// microseconds is not handed between threads (the service runs larger ones on its pool).
//
//   OneMessageTotals totals;
//   absl::StatusOr<std::unique_ptr<Outgoing>> r =
//       RunOneMessageBackward(deps, client, message, beside, &totals);
//
// The request is `message` (header, rms) and `beside` (x and dy, bulk_wire.h; or in `message`).
// The response: first_row 0, num_rows, grad_input (Outgoing::grad_input), grad_gamma, summary.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/service/backward_job.h"
#include "server/service/backward_pipeline.h"

namespace normgrad::server {

// What the call did, for its metrics (as StreamTotals).
struct OneMessageTotals {
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t rows = 0;
  uint64_t tensor_bytes = 0;  // x, dy, rms and gamma in, grad_input out
};

// Errors are a stream's: INVALID_ARGUMENT naming the field and the numbers (a message that does
// not hold every row of its header, shm or cuda_ipc, a cancel), RESOURCE_EXHAUSTED past
// --max-streams, the client's share or --max-inflight-bytes, and the backend's.
absl::StatusOr<std::unique_ptr<Outgoing>> RunOneMessageBackward(
    const StreamDeps& deps, absl::string_view client, const v1::BackwardRequest& message,
    BesideBytes beside, OneMessageTotals* totals);

}  // namespace normgrad::server
