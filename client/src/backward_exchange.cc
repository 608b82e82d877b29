#include "client/src/backward_exchange.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace normgrad::client_internal {

void FillHeader(const RawBackwardArgs& a, const BackwardOptions& options,
                v1::BackwardHeader* header) {
  header->set_num_rows(a.num_rows);
  header->set_hidden_dim(a.hidden_dim);
  header->set_eps(a.eps);
  header->set_dtype(ToProtoDType(a.type));
  header->set_gamma(a.gamma.data(), a.gamma.size());
  header->set_rms_provided(a.device.has_value() ? a.device->rms.has_value() : !a.rms.empty());
  header->set_gamma_offset(a.gamma_offset);
  header->set_no_gamma(a.no_gamma);
  header->set_casting_mode(a.casting_mode);
  if (!options.kernel.empty()) header->mutable_options()->set_kernel(options.kernel);
}

BackwardExchange::BackwardExchange(const RawBackwardArgs& args, const BackwardOptions& options,
                                   const ShmPlan* shm, uint64_t chunk_bytes)
    : args_(args),
      options_(options),
      shm_(shm),
      row_bytes_(uint64_t{args.hidden_dim} * ElementBytes(args.type)),
      chunker_(args.num_rows, row_bytes_, chunk_bytes) {}

void BackwardExchange::StartHeader() {
  message_.Clear();
  bulk_.clear();
  FillHeader(args_, options_, message_.mutable_header());
  write_in_flight_ = true;
}

void BackwardExchange::StartWhole() {
  StartHeader();
  bulk_ = {{v1::BackwardRequest::kXFieldNumber, args_.x},
           {v1::BackwardRequest::kDyFieldNumber, args_.dy},
           {v1::BackwardRequest::kRmsFieldNumber, args_.rms}};
  next_chunk_ = chunker_.num_chunks();
  writes_done_ = true;  // a unary call has no half-close of its own
}

BackwardExchange::Next BackwardExchange::NextWrite() {
  if (write_in_flight_ || writes_done_) return kNothing;
  if (cancel_sent_) {
    writes_done_ = true;
    return kWritesDone;
  }
  if (!cancel_status_.ok()) {
    if (!exposed_) return kNothing;  // cut off (Cancel)
    message_.Clear();
    bulk_.clear();
    message_.set_cancel(true);
    cancel_sent_ = true;
    write_in_flight_ = true;
    return kMessage;
  }
  if (next_chunk_ >= chunker_.num_chunks()) {
    writes_done_ = true;
    return kWritesDone;
  }
  if (memory_call() && next_chunk_ >= chunks_answered_ + kMemoryChunksAhead) {
    return kNothing;  // an answer resumes
  }
  FillChunk(next_chunk_++);
  if (memory_call()) exposed_ = true;
  write_in_flight_ = true;
  return kMessage;
}

BackwardExchange::Cancelled BackwardExchange::Cancel(absl::Status why) {
  if (!cancel_status_.ok()) return kAlready;
  cancel_status_ = std::move(why);
  // Not exposed: no chunk was handed over, and none will be (NextWrite sees cancel_status_).
  return exposed_ ? kInOrder : kCutOff;
}

void BackwardExchange::FillChunk(uint64_t index) {
  const RawBackwardArgs& a = args_;
  const RowRange range = chunker_.Chunk(index);
  message_.Clear();
  bulk_.clear();
  const uint64_t offset = range.first_row * row_bytes_;
  const uint64_t bytes = range.num_rows * row_bytes_;
  if (a.device.has_value()) {
    const CudaIpcTensors& d = *a.device;
    v1::CudaIpcChunk* ipc = message_.mutable_cuda_ipc();
    ipc->set_device_uuid(d.device_uuid);
    ipc->set_num_rows(range.num_rows);
    const auto set = [](v1::CudaIpcBuffer* to, const CudaIpcBuffer& from, uint64_t at) {
      to->set_handle(from.handle);
      to->set_offset(from.offset + at);
    };
    set(ipc->mutable_x(), d.x, offset);
    set(ipc->mutable_dy(), d.dy, offset);
    set(ipc->mutable_grad_input(), d.dx, offset);
    if (d.rms.has_value()) set(ipc->mutable_rms(), *d.rms, range.first_row * 4);
    return;
  }
  if (shm_ != nullptr) {
    v1::SharedMemoryChunk* shm = message_.mutable_shm();
    shm->set_region_id(shm_->region_id);
    shm->set_region_key(shm_->region_key);
    shm->set_num_rows(range.num_rows);
    shm->set_x_offset(shm_->x + offset);
    shm->set_dy_offset(shm_->dy + offset);
    if (!a.rms.empty()) shm->set_rms_offset(shm_->rms + range.first_row * 4);
    shm->set_grad_input_offset(shm_->dx + offset);
    return;
  }
  // The rows go from the caller's arrays: no copy on this side.
  bulk_ = {{v1::BackwardRequest::kXFieldNumber, a.x.subspan(offset, bytes)},
           {v1::BackwardRequest::kDyFieldNumber, a.dy.subspan(offset, bytes)},
           {v1::BackwardRequest::kRmsFieldNumber,
            a.rms.empty() ? absl::Span<const uint8_t>()
                          : a.rms.subspan(range.first_row * 4, range.num_rows * 4)}};
}

absl::Status BackwardExchange::TakeAnswer(const v1::BackwardResponse& r,
                                          const v1::ReceivedBytes& grad_input) {
  const RawBackwardArgs& a = args_;
  any_answer_ = true;
  if (final_received_) return absl::InternalError("server sent a message after the final one");
  const bool is_final = !r.grad_gamma().empty() || r.has_summary();
  const bool has_rows = r.num_rows() > 0 || grad_input.size() > 0;
  const uint64_t first = r.first_row(), rows = r.num_rows();
  // Checked whole first: nothing of a malformed answer reaches the caller's arrays.
  if (has_rows) {
    if (first > a.num_rows || rows > a.num_rows - first) {
      return absl::InternalError(absl::StrCat("server sent rows [", first, ", ", first + rows,
                                              ") of a ", a.num_rows, "-row batch"));
    }
    // Chunks come back in batch order (docs/api.md): each starts where the last one ended, so
    // rows [0, rows_received_) are covered exactly once and Complete sees every row.
    if (first != rows_received_) {
      return absl::InternalError(
          absl::StrCat("server sent rows [", first, ", ", first + rows, ") after rows [0, ",
                       rows_received_, "): ", first < rows_received_ ? "an overlap" : "a gap",
                       "; the next chunk must start at row ", rows_received_));
    }
    if (memory_call()) {
      // grad_input is in the region or device buffer already; from a staging region it is
      // copied out.
      if (grad_input.size() > 0) {
        return absl::InternalError(
            absl::StrCat("server sent ", grad_input.size(), " grad_input bytes for a ",
                         a.device.has_value() ? "device" : "shared-memory", " chunk"));
      }
    } else if (grad_input.size() != rows * row_bytes_) {
      return absl::InternalError(absl::StrCat("server sent ", grad_input.size(),
                                              " grad_input bytes for ", rows, " rows, expected ",
                                              rows * row_bytes_));
    }
  }
  if (is_final && r.grad_gamma().size() != a.dgamma.size()) {
    return absl::InternalError(absl::StrCat("server sent ", r.grad_gamma().size(),
                                            " grad_gamma bytes, expected ", a.dgamma.size()));
  }
  if (has_rows) {
    if (!memory_call()) {
      // From gRPC's pieces straight into the caller's array: the one copy on this side.
      grad_input.CopyTo(a.dx.data() + first * row_bytes_);
    } else if (shm_ != nullptr && shm_->staging != nullptr) {
      std::memcpy(a.dx.data() + first * row_bytes_,
                  shm_->staging->data() + shm_->dx + first * row_bytes_, rows * row_bytes_);
    }
    rows_received_ += rows;
    ++chunks_answered_;
  }
  if (is_final) {
    if (!a.dgamma.empty()) {  // none without gamma
      std::memcpy(a.dgamma.data(), r.grad_gamma().data(), a.dgamma.size());
    }
    const v1::BackwardSummary& s = r.summary();
    summary_ = {s.backend(), s.kernel(),          s.rows(),
                s.chunks(),  s.compute_seconds(), s.total_seconds()};
    final_received_ = true;
  }
  return absl::OkStatus();
}

absl::Status BackwardExchange::Complete() const {
  if (final_received_ && rows_received_ == args_.num_rows) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("server ended the call after ", rows_received_, " of ",
                                          args_.num_rows, " rows",
                                          final_received_ ? "" : " and no grad_gamma"));
}

}  // namespace normgrad::client_internal
