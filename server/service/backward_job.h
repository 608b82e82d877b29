// The blocking work of one RmsNormBackward stream, one job at a time on a worker: start the
// backend session (the header), compute a row chunk wherever its rows are (in the message, in a
// shared-memory region, in the client's device memory), finish with grad_gamma and the summary.
// Each job yields the response to write, if any. No gRPC and no lock: the stream pipeline runs
// at most one job of a stream at a time.
//
//   BackwardJobRunner runner(backend, chunks_total);
//   absl::StatusOr<std::unique_ptr<Outgoing>> out = runner.Run(job, spec);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/backend/backend.h"
#include "server/service/backward_validator.h"
#include "server/service/remote_rows.h"

namespace normgrad::server {

// A chunk's x and dy that came beside its message instead of in it (the transport found them
// where gRPC received them: proto/normgrad/v1/bulk_wire.h); valid while `owner` is held.
struct BesideBytes {
  absl::Span<const uint8_t> x, dy;
  std::shared_ptr<const void> owner;
  bool present() const { return owner != nullptr; }
};

struct BackwardJob {
  enum Kind { kStart, kChunk, kFinish } kind = kChunk;
  std::unique_ptr<v1::BackwardRequest> request;  // kStart: the header; kChunk: the chunk
  BesideBytes beside;  // kChunk: x and dy, when not in `request`
  ValidatedChunk chunk;                                // kChunk
  uint64_t reserved = 0;  // kChunk: bytes reserved with admission until its response is written
  std::optional<RegionRows> in_region;  // kChunk whose rows are in a shared-memory region
  // kFinish: what the summary reports (the stream's totals, the header's arrival).
  uint64_t rows = 0;
  uint64_t chunks = 0;
  absl::Time header_time;
};

// A response to write, with what its write gives back.
struct Outgoing {
  // Every field but grad_input, which the backend computed into `grad_input` and which is sent
  // from there (proto/normgrad/v1/bulk_wire.h): no copy into the message.
  v1::BackwardResponse response;
  std::shared_ptr<uint8_t> grad_input;  // grad_input_bytes bytes; null when there are none
  uint64_t grad_input_bytes = 0;
  uint64_t reserved = 0;       // bytes to release once written
  uint64_t payload_bytes = 0;  // grad_input or grad_gamma bytes in the message
  uint64_t rows = 0;           // rows computed by the job
  bool is_chunk = false;
  bool is_final = false;

  absl::Span<const uint8_t> GradInput() const {
    return {grad_input.get(), static_cast<size_t>(grad_input_bytes)};
  }
  // The message as it goes on the wire, grad_input included (a copy; for tests).
  v1::BackwardResponse ToProto() const {
    v1::BackwardResponse r = response;
    if (grad_input_bytes > 0) r.set_grad_input(grad_input.get(), grad_input_bytes);
    return r;
  }
};

class BackwardJobRunner {
 public:
  // `count_chunk`: called once per chunk computed (the chunk counter). Both outlive the runner.
  BackwardJobRunner(Backend& backend, std::function<void()> count_chunk)
      : backend_(backend), count_chunk_(std::move(count_chunk)) {}

  // `spec`: the batch's, fixed once its header was accepted. Returns null for kStart (nothing
  // to write). A chunk or finish before a successful kStart is a programming error.
  absl::StatusOr<std::unique_ptr<Outgoing>> Run(BackwardJob& job, const kernels::BackwardRequest& spec);

  // Drops the backend session: before the backend may go away.
  void Close() { session_.reset(); }

 private:
  absl::StatusOr<std::unique_ptr<Outgoing>> RunChunk(BackwardJob& job, const kernels::BackwardRequest& spec);
  absl::StatusOr<std::unique_ptr<Outgoing>> RunFinish(const BackwardJob& job,
                                                      const kernels::BackwardRequest& spec);

  Backend& backend_;
  const std::function<void()> count_chunk_;
  std::unique_ptr<BackwardSession> session_;
};

}  // namespace normgrad::server
