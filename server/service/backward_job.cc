#include "server/service/backward_job.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "base/status_macros.h"

namespace normgrad::server {

absl::StatusOr<std::unique_ptr<Outgoing>> BackwardJobRunner::Run(BackwardJob& job,
                                                                 const kernels::BackwardRequest& spec) {
  switch (job.kind) {
    case BackwardJob::kStart: {
      const std::string& gamma = job.request->header().gamma();
      NORMGRAD_ASSIGN_OR_RETURN(
          session_, backend_.StartBackward(
                        spec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(gamma.data()),
                                                  gamma.size())));
      return std::unique_ptr<Outgoing>();
    }
    case BackwardJob::kChunk:
      return RunChunk(job, spec);
    case BackwardJob::kFinish:
      return RunFinish(job, spec);
  }
  return absl::InternalError("unknown job");
}

absl::StatusOr<std::unique_ptr<Outgoing>> BackwardJobRunner::RunChunk(BackwardJob& job,
                                                                      const kernels::BackwardRequest& spec) {
  const v1::BackwardRequest& r = *job.request;
  const RowLayout layout = RowLayout::Of(spec);
  auto out = std::make_unique<Outgoing>();
  out->reserved = job.reserved;
  out->is_chunk = true;
  out->rows = job.chunk.num_rows;
  out->response.set_first_row(job.chunk.first_row);
  out->response.set_num_rows(job.chunk.num_rows);
  if (r.has_cuda_ipc()) {
    // Zero copy on the device: the kernels read and write the client's buffers.
    std::vector<std::shared_ptr<const DeviceBuffer>> held;  // open until computed
    NORMGRAD_ASSIGN_OR_RETURN(const DeviceRows rows,
                              OpenDeviceRows(backend_, r.cuda_ipc(), job.chunk, layout, held));
    NORMGRAD_RETURN_IF_ERROR(session_->ProcessDeviceChunk(rows));
  } else if (job.in_region.has_value()) {
    // Zero copy: the backend reads x, dy and rms in the client's region and writes dx there.
    const RegionRows& in = *job.in_region;
    // Again as it starts (the check at the chunk's arrival may be long past): a page given back
    // since would be faulted in, and charged, to the server by the write below.
    NORMGRAD_RETURN_IF_ERROR(in.region->CheckAllocated(
        absl::StrCat("chunk ", job.chunk.index, ": shm.region_id=", r.shm().region_id())));
    uint8_t* base = in.region->data();
    const uint64_t bytes = job.chunk.num_rows * layout.row_bytes;
    absl::Span<const float> rms;
    if (spec.rms_provided) {
      rms = absl::MakeConstSpan(reinterpret_cast<const float*>(base + in.rms), job.chunk.num_rows);
    }
    NORMGRAD_RETURN_IF_ERROR(session_->ProcessChunk(
        absl::MakeConstSpan(base + in.x, bytes), absl::MakeConstSpan(base + in.dy, bytes), rms,
        job.chunk.num_rows, absl::MakeSpan(base + in.grad_input, bytes)));
  } else {
    // The rows are in the message; grad_input goes back in the response.
    const absl::Span<const uint8_t> x =
        job.beside.present()
            ? job.beside.x
            : absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(r.x().data()), r.x().size());
    const absl::Span<const uint8_t> dy =
        job.beside.present()
            ? job.beside.dy
            : absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(r.dy().data()), r.dy().size());
    // Not zero-filled: the backend writes every byte (CheckChunk: dx is as long as x).
    const uint64_t dx_bytes = x.size();
    out->grad_input.reset(new uint8_t[dx_bytes], std::default_delete<uint8_t[]>());
    out->grad_input_bytes = dx_bytes;
    std::vector<float> rms_copy;  // aligned for the backend
    absl::Span<const float> rms;
    if (!r.rms().empty()) {
      rms_copy.resize(r.rms().size() / 4);
      std::memcpy(rms_copy.data(), r.rms().data(), r.rms().size());
      rms = rms_copy;
    }
    NORMGRAD_RETURN_IF_ERROR(session_->ProcessChunk(
        x, dy, rms, job.chunk.num_rows, absl::MakeSpan(out->grad_input.get(), dx_bytes)));
    out->payload_bytes = dx_bytes;
  }
  count_chunk_();
  return out;
}

absl::StatusOr<std::unique_ptr<Outgoing>> BackwardJobRunner::RunFinish(const BackwardJob& job,
                                                                       const kernels::BackwardRequest& spec) {
  auto out = std::make_unique<Outgoing>();
  out->is_final = true;
  // A batch without gamma has no grad_gamma: the field stays unset.
  std::string dgamma_bytes;
  if (spec.variant.has_gamma) dgamma_bytes.resize(RowLayout::Of(spec).row_bytes);
  NORMGRAD_RETURN_IF_ERROR(session_->Finish(
      absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma_bytes.data()), dgamma_bytes.size())));
  const size_t dgamma_size = dgamma_bytes.size();
  if (spec.variant.has_gamma) *out->response.mutable_grad_gamma() = std::move(dgamma_bytes);
  v1::BackwardSummary* summary = out->response.mutable_summary();
  summary->set_backend(std::string(backend_.Name()));
  summary->set_kernel(std::string(session_->KernelName()));
  summary->set_rows(job.rows);
  summary->set_chunks(job.chunks);
  summary->set_compute_seconds(session_->ComputeSeconds());
  summary->set_total_seconds(absl::ToDoubleSeconds(absl::Now() - job.header_time));
  out->payload_bytes = dgamma_size;
  return out;
}

}  // namespace normgrad::server
