#include "server/service/backward_pipeline.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"

namespace normgrad::server {
BackwardPipeline::BackwardPipeline(const StreamDeps& deps, absl::Time deadline,
                                   bool peer_is_local, std::string client)
    : deps_(deps),
      deadline_(deadline),
      peer_is_local_(peer_is_local),
      client_(std::move(client)),
      runner_(*deps.backend, [metrics = deps.metrics] { metrics->chunks.Increment(); }),
      validator_(deps.limits),
      watchdog_(start_, deps.min_rate) {}

void BackwardPipeline::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  runner_.Close();
  jobs_.clear();
  writes_.clear();
  writing_.reset();
  waiting_for_bytes_.reset();
  if (reserved_bytes_ > 0) deps_.admission->ReleaseBytes(reserved_bytes_);
  reserved_bytes_ = 0;
}

BackwardPipeline::~BackwardPipeline() {
  Close();
  if (admitted_) {  // OnDone never came (a test's pipeline)
    deps_.metrics->inflight_streams.Add({}, -1);
    deps_.admission->ReleaseStream(client_);
  }
}

StreamActions BackwardPipeline::Start(absl::Status refused) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  if (!refused.ok()) {
    FinishLocked(refused, a);
  } else if (absl::Status s = deps_.admission->AdmitStream(client_); !s.ok()) {
    FinishLocked(s, a);
  } else {
    admitted_ = true;
    deps_.metrics->inflight_streams.Add({}, 1);
    request_ = std::make_unique<v1::BackwardRequest>();
    MaybeStartReadLocked(a);  // the first read: nothing held, nothing in flight
  }
  return a;
}

void BackwardPipeline::IoDoneLocked(bool& in_flight) {
  in_flight = false;
  watchdog_.NoteProgress(absl::Now());
}

StreamActions BackwardPipeline::OnReadDone(bool ok, bool call_cancelled, BesideBytes beside) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  IoDoneLocked(read_in_flight_);
  if (finish_decided_) return a;  // the stream already has its status
  if (ok) {
    OnMessageLocked(a, std::move(beside));
    return a;
  }
  // The client half-closed, or the call died (then OnCancel follows or came first).
  reads_done_ = true;
  if (call_cancelled) {
    FinishLocked(CancelStatusLocked(), a);
  } else if (absl::Status s = validator_.AtEndOfStream(); !s.ok()) {
    FinishLocked(s, a);
  } else {
    BackwardJob job;
    job.kind = BackwardJob::kFinish;
    job.rows = validator_.rows_received();
    job.chunks = validator_.chunks_received();
    job.header_time = header_time_;
    jobs_.push_back(std::move(job));
    ScheduleComputeLocked(a);
  }
  return a;
}

StreamActions BackwardPipeline::OnUnparsableMessage(uint64_t bytes) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  IoDoneLocked(read_in_flight_);
  const std::string which = validator_.has_header()
                                ? absl::StrCat("chunk ", validator_.chunks_received())
                                : std::string("the first message");
  FinishLocked(absl::InvalidArgumentError(
                   absl::StrCat(which, " (", bytes, " bytes) does not parse as a "
                                "normgrad.v1.BackwardRequest")),
               a);
  return a;
}

StreamActions BackwardPipeline::OnWriteDone(bool ok) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  IoDoneLocked(write_in_flight_);
  std::unique_ptr<Outgoing> done = std::move(writing_);
  if (done->reserved > 0) {
    deps_.admission->ReleaseBytes(done->reserved);
    reserved_bytes_ -= done->reserved;
  }
  if (done->is_chunk) --chunks_held_;
  if (finish_decided_) return a;
  if (!ok) {
    FinishLocked(idle_cancel_status_.ok()
                     ? absl::CancelledError("the client stopped receiving responses")
                     : idle_cancel_status_,
                 a);
    return a;
  }
  bytes_out_ += done->payload_bytes;
  if (done->is_final) {
    FinishLocked(absl::OkStatus(), a);
  } else {
    StartNextWriteLocked(a);
    AdmitWaitingChunkLocked(a);
    MaybeStartReadLocked(a);
  }
  return a;
}

StreamActions BackwardPipeline::OnCancel() {
  cancelled_.store(true);
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  FinishLocked(CancelStatusLocked(), a);
  return a;
}

StreamActions BackwardPipeline::CheckIdle(absl::Time now, absl::Duration timeout) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  // Only a stream waiting on its client is judged: never one whose job is queued or running, or
  // one waiting for the server's byte budget.
  StreamWatchdog::StreamState state;
  state.waiting_on_client =
      !finish_decided_ && !compute_busy_ && (write_in_flight_ || read_in_flight_);
  state.writing = write_in_flight_;
  state.rows_received = validator_.rows_received();
  state.bytes_moved = tensor_bytes_in_ + bytes_out_;
  const StreamWatchdog::Verdict verdict = watchdog_.Visit(now, timeout, state);
  if (verdict.below_min_rate) {
    deps_.metrics->rejected.Increment(
        {{"method", "RmsNormBackward"}, {"limit", "min-stream-bytes-per-second"}});
  }
  if (verdict.end.ok()) return a;
  if (write_in_flight_) {
    // The client does not read: trailers could not reach it either (a finish would wait behind
    // the stuck write), so the call is cancelled; OnCancel then finishes with this status.
    if (idle_cancel_status_.ok()) {
      idle_cancel_status_ = verdict.end;
      a.try_cancel = true;
      cancelled_.store(true);  // no job starts between this cancel and OnCancel
    }
  } else {
    FinishLocked(verdict.end, a);
  }
  return a;
}

std::optional<absl::Status> BackwardPipeline::Issued(int count) {
  if (count == 0) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  issuing_ -= count;
  return TakeDeferredFinishLocked();
}

std::optional<absl::Status> BackwardPipeline::TakeDeferredFinishLocked() {
  if (issuing_ > 0 || compute_busy_ || !deferred_finish_.has_value()) return std::nullopt;
  std::optional<absl::Status> finish = std::move(deferred_finish_);
  deferred_finish_.reset();
  return finish;
}

StreamTotals BackwardPipeline::OnDone() {
  std::lock_guard<std::mutex> lock(mu_);
  StreamTotals t;
  t.code = final_code_;
  t.bytes_in = bytes_in_;
  t.bytes_out = bytes_out_;
  t.rows = rows_sent_;
  t.tensor_bytes = tensor_bytes_in_ + rows_sent_ * validator_.row_bytes();
  t.payload_transport = payload_transport_;
  if (admitted_) {
    admitted_ = false;
    deps_.metrics->inflight_streams.Add({}, -1);
    deps_.admission->ReleaseStream(client_);
  }
  return t;
}

// A finish must not overtake a read or write that was decided (possibly on another thread) but
// not issued yet, nor a job that is running: a chunk's job reads and writes the client's memory
// (a shared-memory region, CUDA IPC buffers), and the final status tells the client that no job
// of the stream touches it any more (docs/api.md, "The end of a call"). The finish is then held
// back, and Issued() or the end of RunOneJob hands it to whoever completes the last of them. No
// job starts once the finish is decided.
void BackwardPipeline::FinishLocked(const absl::Status& status, StreamActions& a) {
  if (finish_decided_) return;
  finish_decided_ = true;
  final_code_ = status.code();
  issuing_ -= a.issued();  // this caller's own read/write is not issued any more
  a.read_into = nullptr;
  a.write_from = nullptr;
  deferred_finish_ = status;
  a.finish = TakeDeferredFinishLocked();
}

// Why a call gRPC reports cancelled ended, as far as the server can tell (for the status and
// metrics): the watchdog's reason when it cancelled the call, else the deadline or a cancel.
absl::Status BackwardPipeline::CancelStatusLocked() const {
  if (!idle_cancel_status_.ok()) return idle_cancel_status_;
  if (deadline_ <= absl::Now()) {
    return absl::DeadlineExceededError("the client's deadline passed");
  }
  return absl::CancelledError(
      "the stream was cancelled (by the client, or by server shutdown after the grace)");
}

void BackwardPipeline::OnMessageLocked(StreamActions& a, BesideBytes beside) {
  const v1::BackwardRequest& message = *request_;
  if (message.cancel()) {
    // In order: every chunk read before this one was queued or dropped already.
    FinishLocked(absl::CancelledError(absl::StrCat(
                     "the client cancelled the stream (BackwardRequest.cancel) after ",
                     validator_.chunks_received(), " chunks")),
                 a);
    return;
  }
  // Everything the parsed message holds, fields this server does not know included (a client
  // could otherwise pad chunks past --max-inflight-bytes with them).
  const uint64_t message_bytes = message.ByteSizeLong() + beside.x.size() + beside.dy.size();
  const uint64_t x_bytes = message.x().size() + beside.x.size();
  bytes_in_ += message_bytes;
  absl::StatusOr<AcceptedMessage> accepted =
      validator_.Accept(message, beside.x.size(), beside.dy.size());
  if (!accepted.ok()) {
    FinishLocked(accepted.status(), a);
    return;
  }
  // The rows' bytes wherever they are (in the message or in a shared-memory region).
  tensor_bytes_in_ += accepted->is_header
                          ? message.header().gamma().size()
                          : accepted->chunk.num_rows * (2 * validator_.row_bytes() +
                                                        (validator_.spec().rms_provided ? 4 : 0));
  BackwardJob job;
  job.request = std::move(request_);
  request_ = std::make_unique<v1::BackwardRequest>();
  if (accepted->is_header) {
    job.kind = BackwardJob::kStart;
    header_time_ = absl::Now();
    jobs_.push_back(std::move(job));
    ScheduleComputeLocked(a);
    MaybeStartReadLocked(a);
    return;
  }
  job.kind = BackwardJob::kChunk;
  job.chunk = accepted->chunk;
  job.beside = std::move(beside);
  if (absl::Status s = LocateRowsLocked(job); !s.ok()) {
    FinishLocked(s, a);
    return;
  }
  // Held until the response is written: the request (x, dy, rms) and the response (dx); a
  // chunk in shared memory holds only its small message (the region is counted apart).
  job.reserved = message_bytes + x_bytes;
  waiting_for_bytes_ = std::move(job);
  AdmitWaitingChunkLocked(a);
}

absl::Status BackwardPipeline::LocateRowsLocked(BackwardJob& job) {
  const RowLayout layout = RowLayout::Of(validator_.spec());
  if (job.request->has_cuda_ipc()) {
    payload_transport_ = "cuda_ipc";
    const std::string server_uuid = deps_.cuda_ipc ? IpcDeviceUuid(*deps_.backend) : "";
    NORMGRAD_RETURN_IF_ERROR(CheckDeviceChunk(server_uuid, peer_is_local_,
                                              job.request->cuda_ipc(), job.chunk, layout));
  }
  if (job.request->has_shm()) {
    payload_transport_ = "shm";
    NORMGRAD_ASSIGN_OR_RETURN(job.in_region, FindRegionRows(deps_.regions, peer_is_local_,
                                                            job.request->shm(), job.chunk,
                                                            layout));
  }
  return absl::OkStatus();
}

// Reserves the bytes of the chunk in waiting_for_bytes_ and queues it. When the budget is short
// but this stream holds chunks of its own, it waits (without reading further) for their writes to
// release bytes; with nothing of its own to wait for it fails at once.
void BackwardPipeline::AdmitWaitingChunkLocked(StreamActions& a) {
  if (!waiting_for_bytes_.has_value() || finish_decided_) return;
  if (absl::Status s = deps_.admission->ReserveBytes(waiting_for_bytes_->reserved); !s.ok()) {
    if (chunks_held_ == 0) {
      waiting_for_bytes_.reset();
      FinishLocked(s, a);
    }
    return;
  }
  reserved_bytes_ += waiting_for_bytes_->reserved;
  ++chunks_held_;
  jobs_.push_back(*std::move(waiting_for_bytes_));
  waiting_for_bytes_.reset();
  ScheduleComputeLocked(a);
  MaybeStartReadLocked(a);
}

void BackwardPipeline::MaybeStartReadLocked(StreamActions& a) {
  if (finish_decided_ || reads_done_ || read_in_flight_ || waiting_for_bytes_.has_value()) return;
  if (chunks_held_ >= kMaxChunksHeldPerStream) return;  // flow control: resume on a write
  read_in_flight_ = true;
  ++issuing_;
  a.read_into = request_.get();
}

void BackwardPipeline::ScheduleComputeLocked(StreamActions& a) {
  if (compute_busy_ || jobs_.empty() || finish_decided_) return;
  compute_busy_ = true;
  a.schedule = true;
}

void BackwardPipeline::StartNextWriteLocked(StreamActions& a) {
  if (finish_decided_ || write_in_flight_ || writes_.empty()) return;
  writing_ = std::move(writes_.front());
  writes_.pop_front();
  write_in_flight_ = true;
  ++issuing_;
  a.write_from = writing_.get();
}

StreamActions BackwardPipeline::RunOneJob() {
  BackwardJob job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finish_decided_ || jobs_.empty()) {
      compute_busy_ = false;
      StreamActions a;
      a.finish = TakeDeferredFinishLocked();
      return a;
    }
    job = std::move(jobs_.front());
    jobs_.pop_front();
  }
  absl::StatusOr<std::unique_ptr<Outgoing>> out =
      cancelled_.load() ? absl::StatusOr<std::unique_ptr<Outgoing>>(absl::CancelledError("cancelled"))
                        : runner_.Run(job, validator_.spec());  // spec: fixed since the header
  job.request.reset();  // free x and dy before waiting for the write
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  watchdog_.NoteProgress(absl::Now());
  if (!out.ok()) {
    FinishLocked(out.status(), a);
  } else if (*out != nullptr) {
    rows_sent_ += (*out)->rows;
    if (!finish_decided_) {
      writes_.push_back(*std::move(out));
      StartNextWriteLocked(a);
    }
  }
  compute_busy_ = false;
  ScheduleComputeLocked(a);
  if (!a.finish.has_value()) a.finish = TakeDeferredFinishLocked();
  return a;
}

}  // namespace normgrad::server
