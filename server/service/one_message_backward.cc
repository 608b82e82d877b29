#include "server/service/one_message_backward.h"

#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "server/service/backward_validator.h"

namespace normgrad::server {

absl::StatusOr<std::unique_ptr<Outgoing>> RunOneMessageBackward(
    const StreamDeps& deps, absl::string_view client, const v1::BackwardRequest& message,
    BesideBytes beside, OneMessageTotals* totals) {
  const absl::Time start = absl::Now();
  if (message.has_shm() || message.has_cuda_ipc() || message.cancel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RmsNormBackwardUnary takes the rows in x and dy; ",
        message.has_shm() ? "shm" : message.has_cuda_ipc() ? "cuda_ipc" : "cancel",
        " is for the RmsNormBackward stream"));
  }
  if (!message.has_header()) {
    return absl::InvalidArgumentError(
        "RmsNormBackwardUnary: the request must carry `header` and every row");
  }
  const uint64_t x_bytes = message.x().size() + beside.x.size();
  const uint64_t dy_bytes = message.dy().size() + beside.dy.size();
  totals->bytes_in = message.ByteSizeLong() + beside.x.size() + beside.dy.size();

  // The header, then the rows as the batch's one chunk, then the end: the stream's checks.
  BackwardValidator validator(deps.limits);
  auto header = std::make_unique<v1::BackwardRequest>();
  *header->mutable_header() = message.header();
  NORMGRAD_RETURN_IF_ERROR(validator.Accept(*header).status());
  auto rows = std::make_unique<v1::BackwardRequest>();
  rows->set_rms(message.rms());
  if (!beside.present()) {  // parsed by protobuf itself: the rows are in the message
    rows->set_x(message.x());
    rows->set_dy(message.dy());
  }
  NORMGRAD_ASSIGN_OR_RETURN(
      const AcceptedMessage chunk,
      validator.Accept(*rows, beside.x.size(), beside.dy.size()));
  if (validator.rows_received() != validator.spec().num_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RmsNormBackwardUnary: the request carries ", validator.rows_received(),
        " of header.num_rows = ", validator.spec().num_rows,
        " rows; a unary call carries every row (send larger batches on the stream)"));
  }

  // A stream slot of the caller's and the bytes held until the answer is built: the request
  // (x, dy, rms) and grad_input.
  NORMGRAD_RETURN_IF_ERROR(deps.admission->AdmitStream(client));
  deps.metrics->inflight_streams.Add({}, 1);
  absl::Cleanup release_stream = [&] {
    deps.metrics->inflight_streams.Add({}, -1);
    deps.admission->ReleaseStream(client);
  };
  const uint64_t reserved = totals->bytes_in + x_bytes;
  NORMGRAD_RETURN_IF_ERROR(deps.admission->ReserveBytes(reserved));
  absl::Cleanup release_bytes = [&] { deps.admission->ReleaseBytes(reserved); };

  BackwardJobRunner runner(*deps.backend, [metrics = deps.metrics] { metrics->chunks.Increment(); });
  const kernels::BackwardRequest& spec = validator.spec();
  BackwardJob start_job;
  start_job.kind = BackwardJob::kStart;
  start_job.request = std::move(header);
  NORMGRAD_RETURN_IF_ERROR(runner.Run(start_job, spec).status());
  BackwardJob chunk_job;
  chunk_job.kind = BackwardJob::kChunk;
  chunk_job.chunk = chunk.chunk;
  chunk_job.request = std::move(rows);
  chunk_job.beside = std::move(beside);
  NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<Outgoing> out, runner.Run(chunk_job, spec));
  chunk_job = BackwardJob();  // the request's bytes go as soon as they are computed
  BackwardJob finish_job;
  finish_job.kind = BackwardJob::kFinish;
  finish_job.rows = validator.rows_received();
  finish_job.chunks = 1;
  finish_job.header_time = start;
  NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<Outgoing> final_out, runner.Run(finish_job, spec));

  // One answer: the chunk's rows and grad_input, the final message's grad_gamma and summary.
  out->response.MergeFrom(final_out->response);
  out->is_final = true;
  out->payload_bytes += final_out->payload_bytes;
  out->reserved = 0;  // released here
  totals->rows = validator.rows_received();
  totals->bytes_out = out->response.ByteSizeLong() + out->grad_input_bytes;
  totals->tensor_bytes = message.header().gamma().size() + x_bytes + dy_bytes +
                         message.rms().size() + out->grad_input_bytes;
  return out;
}

}  // namespace normgrad::server
