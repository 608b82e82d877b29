#include "server/service/backward_pipeline.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/kernel.h"
#include "kernels/status_macros.h"

namespace normgrad::server {
namespace {

// A device UUID as the CUDA tools print it (32 hex digits), or what was sent when not 16 bytes.
std::string HexUuid(const std::string& uuid) {
  if (uuid.size() != 16) return absl::StrCat("(", uuid.size(), " bytes, not 16)");
  return absl::BytesToHexString(uuid);
}

}  // namespace

BackwardPipeline::BackwardPipeline(ServiceEnv* env, absl::Time deadline, bool peer_is_local,
                                   std::string client)
    : env_(env),
      deadline_(deadline),
      peer_is_local_(peer_is_local),
      client_(std::move(client)),
      validator_(env->config.batch_limits) {
  last_progress_ = start_;
  last_visit_ = start_;
}

void BackwardPipeline::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  session_.reset();
  jobs_.clear();
  writes_.clear();
  writing_.reset();
  waiting_for_bytes_.reset();
  if (reserved_bytes_ > 0) env_->admission->ReleaseBytes(reserved_bytes_);
  reserved_bytes_ = 0;
}

BackwardPipeline::~BackwardPipeline() {
  Close();
  if (admitted_) {  // OnDone never came (a test's pipeline)
    env_->metrics->AddGauge("normgrad_inflight_streams", {}, -1);
    env_->admission->ReleaseStream(client_);
  }
}

StreamActions BackwardPipeline::Start(absl::Status refused) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  if (!refused.ok()) {
    FinishLocked(refused, a);
  } else if (env_->draining.load()) {
    FinishLocked(absl::UnavailableError(
                     "the server is shutting down and takes no new streams; retry elsewhere"),
                 a);
  } else if (!env_->device_health.healthy()) {
    FinishLocked(absl::UnavailableError(absl::StrCat(
                     "this server's GPU is unusable and it takes no streams (",
                     env_->device_health.reason().message(), "); retry elsewhere")),
                 a);
  } else if (absl::Status s = env_->admission->AdmitStream(client_); !s.ok()) {
    FinishLocked(s, a);
  } else {
    admitted_ = true;
    env_->metrics->AddGauge("normgrad_inflight_streams", {}, 1);
    request_ = std::make_unique<v1::BackwardRequest>();
    MaybeStartReadLocked(a);  // the first read: nothing held, nothing in flight
  }
  return a;
}

StreamActions BackwardPipeline::OnReadDone(bool ok, bool call_cancelled) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  read_in_flight_ = false;
  last_progress_ = absl::Now();
  if (finish_decided_) return a;  // the stream already has its status
  if (ok) {
    OnMessageLocked(a);
    return a;
  }
  // The client half-closed, or the call died (then OnCancel follows or came first).
  reads_done_ = true;
  if (call_cancelled) {
    FinishLocked(CancelStatusLocked(), a);
  } else if (absl::Status s = validator_.AtEndOfStream(); !s.ok()) {
    FinishLocked(s, a);
  } else {
    Job job;
    job.kind = Job::kFinish;
    jobs_.push_back(std::move(job));
    ScheduleComputeLocked(a);
  }
  return a;
}

StreamActions BackwardPipeline::OnUnparsableMessage(uint64_t bytes) {
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  read_in_flight_ = false;
  last_progress_ = absl::Now();
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
  write_in_flight_ = false;
  last_progress_ = absl::Now();
  std::unique_ptr<Outgoing> done = std::move(writing_);
  if (done->reserved > 0) {
    env_->admission->ReleaseBytes(done->reserved);
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
  const bool waiting_on_client =
      !finish_decided_ && !compute_busy_ && (write_in_flight_ || read_in_flight_);
  if (waiting_on_client && now > last_visit_) client_wait_ += now - last_visit_;
  last_visit_ = std::max(last_visit_, now);
  if (!waiting_on_client) return a;
  absl::Status end;
  if (timeout > absl::ZeroDuration() && now - last_progress_ >= timeout) {
    end = absl::DeadlineExceededError(
        write_in_flight_
            ? absl::StrCat("stream idle timeout: the client read no response for ",
                           absl::FormatDuration(timeout), " (--stream-idle-timeout)")
            : absl::StrCat("stream idle timeout: no request message for ",
                           absl::FormatDuration(timeout), " after ", validator_.rows_received(),
                           " rows (--stream-idle-timeout)"));
  } else {
    end = CheckRateLocked();
    if (!end.ok()) {
      env_->metrics->IncrementCounter(
          "normgrad_rejected_total",
          {{"method", "RmsNormBackward"}, {"limit", "min-stream-bytes-per-second"}});
    }
  }
  if (end.ok()) return a;
  if (write_in_flight_) {
    // The client does not read: trailers could not reach it either (a finish would wait behind
    // the stuck write), so the call is cancelled; OnCancel then finishes with this status.
    if (idle_cancel_status_.ok()) {
      idle_cancel_status_ = end;
      a.try_cancel = true;
      cancelled_.store(true);  // no job starts between this cancel and OnCancel
    }
  } else {
    FinishLocked(end, a);
  }
  return a;
}

// The rate is judged per window of time spent waiting on the client (time with a job queued or
// running, or waiting for the byte budget, does not count: a busy server must not end its
// clients' streams): below the minimum the stream ends; at or above it a new window starts.
absl::Status BackwardPipeline::CheckRateLocked() {
  const uint64_t min_rate = env_->config.min_stream_bytes_per_second;
  const absl::Duration window = env_->config.min_stream_rate_window;
  if (min_rate == 0 || window <= absl::ZeroDuration()) return absl::OkStatus();
  const absl::Duration waited = client_wait_ - rate_window_wait_;
  if (waited < window) return absl::OkStatus();
  const uint64_t moved_total = tensor_bytes_in_ + bytes_out_;
  const uint64_t moved = moved_total - rate_window_bytes_;
  const double rate = static_cast<double>(moved) / absl::ToDoubleSeconds(waited);
  if (rate >= static_cast<double>(min_rate)) {
    rate_window_wait_ = client_wait_;
    rate_window_bytes_ = moved_total;
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "stream too slow: ", moved, " bytes of x, dy and grad_input moved in ",
      absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))),
      " of waiting on the client (", static_cast<uint64_t>(rate),
      " B/s), below --min-stream-bytes-per-second=", min_rate, " (window ",
      absl::FormatDuration(window), ", --min-stream-rate-window)"));
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
    env_->metrics->AddGauge("normgrad_inflight_streams", {}, -1);
    env_->admission->ReleaseStream(client_);
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

void BackwardPipeline::OnMessageLocked(StreamActions& a) {
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
  const uint64_t message_bytes = message.ByteSizeLong();
  const uint64_t x_bytes = message.x().size();
  bytes_in_ += message_bytes;
  absl::StatusOr<AcceptedMessage> accepted = validator_.Accept(message);
  if (!accepted.ok()) {
    FinishLocked(accepted.status(), a);
    return;
  }
  // The rows' bytes wherever they are (in the message or in a shared-memory region).
  tensor_bytes_in_ += accepted->is_header
                          ? message.header().gamma().size()
                          : accepted->chunk.num_rows * (2 * validator_.row_bytes() +
                                                        (validator_.spec().rms_provided ? 4 : 0));
  Job job;
  job.request = std::move(request_);
  request_ = std::make_unique<v1::BackwardRequest>();
  if (accepted->is_header) {
    job.kind = Job::kStart;
    header_time_ = absl::Now();
    jobs_.push_back(std::move(job));
    ScheduleComputeLocked(a);
    MaybeStartReadLocked(a);
    return;
  }
  job.kind = Job::kChunk;
  job.chunk = accepted->chunk;
  if (job.request->has_cuda_ipc()) {
    payload_transport_ = "cuda_ipc";
    if (absl::Status s = CheckDeviceChunkLocked(job.request->cuda_ipc(), job.chunk); !s.ok()) {
      FinishLocked(s, a);
      return;
    }
  }
  if (job.request->has_shm()) {
    payload_transport_ = "shm";
    absl::StatusOr<RegionRows> rows = FindRegionRowsLocked(job.request->shm(), job.chunk);
    if (!rows.ok()) {
      FinishLocked(rows.status(), a);
      return;
    }
    job.in_region = *std::move(rows);
  }
  // Held until the response is written: the request (x, dy, rms) and the response (dx); a
  // chunk in shared memory holds only its small message (the region is counted apart).
  job.reserved = message_bytes + x_bytes;
  waiting_for_bytes_ = std::move(job);
  AdmitWaitingChunkLocked(a);
}

absl::StatusOr<BackwardPipeline::RegionRows> BackwardPipeline::FindRegionRowsLocked(
    const v1::SharedMemoryChunk& shm, const RowChunk& chunk) const {
  const std::string where = absl::StrCat("chunk ", chunk.index, ": ");
  if (env_->regions == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "carries shm but this server takes no shared memory (start it with "
        "--shared-memory and reach it on its unix socket)"));
  }
  if (!peer_is_local_) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "carries shm but the client is not on this machine (shared memory is taken only "
        "on a unix socket or a loopback address)"));
  }
  absl::StatusOr<std::shared_ptr<const MappedRegion>> region =
      env_->regions->Find(shm.region_id(), shm.region_key());
  if (!region.ok()) {
    return absl::Status(region.status().code(), absl::StrCat(where, region.status().message()));
  }
  // Pages the client released since it registered the region (a hole punched) would be
  // faulted in, and charged, to the server: refused.
  if (absl::Status s = (*region)->CheckAllocated(absl::StrCat(where, "shm.region_id=",
                                                              shm.region_id()));
      !s.ok()) {
    return s;
  }
  const uint64_t size = (*region)->size();
  const uint64_t element = kernels::DTypeBytes(validator_.spec().dtype);
  if (chunk.num_rows > UINT64_MAX / validator_.row_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "shm.num_rows = ", chunk.num_rows,
                                                   " rows do not fit in any region"));
  }
  const uint64_t bytes = chunk.num_rows * validator_.row_bytes();
  const uint64_t rms_bytes = validator_.spec().rms_provided ? chunk.num_rows * 4 : 0;
  struct Range {
    const char* field;
    uint64_t offset, bytes, alignment;
  };
  const Range ranges[] = {{"shm.x_offset", shm.x_offset(), bytes, element},
                          {"shm.dy_offset", shm.dy_offset(), bytes, element},
                          {"shm.rms_offset", shm.rms_offset(), rms_bytes, 4},
                          {"shm.grad_input_offset", shm.grad_input_offset(), bytes, element}};
  for (const Range& r : ranges) {
    if (absl::Status s = CheckRegionRange(absl::StrCat(where, r.field), r.offset, r.bytes, size,
                                          r.alignment);
        !s.ok()) {
      return s;
    }
  }
  // grad_input is written while x, dy and rms are read: it must not overlap them.
  const Range& out = ranges[3];
  for (int i = 0; i < 3; ++i) {
    const Range& in = ranges[i];
    if (in.bytes > 0 && out.offset < in.offset + in.bytes && in.offset < out.offset + out.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "shm.grad_input_offset = ", out.offset, " (", out.bytes, " bytes) overlaps ",
          in.field, " = ", in.offset, " (", in.bytes, " bytes)"));
    }
  }
  RegionRows rows;
  rows.region = *std::move(region);
  rows.x = shm.x_offset();
  rows.dy = shm.dy_offset();
  rows.rms = shm.rms_offset();
  rows.grad_input = shm.grad_input_offset();
  return rows;
}

// What the message alone says about a chunk in device memory; the buffers are opened, and the
// ranges checked against them, on a worker (OpenDeviceRows): opening a handle is a driver call.
absl::Status BackwardPipeline::CheckDeviceChunkLocked(const v1::CudaIpcChunk& ipc,
                                                      const RowChunk& chunk) const {
  const std::string where = absl::StrCat("chunk ", chunk.index, ": ");
  const std::string server_uuid = env_->cuda_ipc ? env_->backend->DeviceUuid() : "";
  if (server_uuid.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "carries cuda_ipc but this server takes no CUDA IPC (start it with --cuda-ipc on "
        "the CUDA backend, and reach it on its unix socket)"));
  }
  if (!peer_is_local_) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "carries cuda_ipc but the client is not on this machine (CUDA IPC is taken only "
        "on a unix socket or a loopback address)"));
  }
  if (ipc.device_uuid() != server_uuid) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "cuda_ipc.device_uuid = ", HexUuid(ipc.device_uuid()),
        " is not this server's GPU (", HexUuid(server_uuid),
        "): the buffers must be on the server's device"));
  }
  const bool rms = validator_.spec().rms_provided;
  const std::pair<const char*, const v1::CudaIpcBuffer*> buffers[] = {
      {"cuda_ipc.x", &ipc.x()},
      {"cuda_ipc.dy", &ipc.dy()},
      {"cuda_ipc.grad_input", &ipc.grad_input()},
      {"cuda_ipc.rms", rms ? &ipc.rms() : nullptr}};
  for (const auto& [field, buffer] : buffers) {
    if (buffer == nullptr) continue;
    if (buffer->handle().size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, field, ".handle has ",
                                                     buffer->handle().size(), " bytes, not ",
                                                     kCudaIpcHandleBytes));
    }
  }
  if (!rms && ipc.has_rms()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "cuda_ipc.rms is set but header.rms_provided is false"));
  }
  // grad_input is written while x, dy and rms are read: within one allocation it must not
  // overlap them.
  if (chunk.num_rows > UINT64_MAX / validator_.row_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "cuda_ipc.num_rows = ", chunk.num_rows,
                                                   " rows do not fit in any buffer"));
  }
  const uint64_t bytes = chunk.num_rows * validator_.row_bytes();
  const v1::CudaIpcBuffer& out = ipc.grad_input();
  const std::tuple<const char*, const v1::CudaIpcBuffer*, uint64_t> inputs[] = {
      {"cuda_ipc.x", &ipc.x(), bytes},
      {"cuda_ipc.dy", &ipc.dy(), bytes},
      {"cuda_ipc.rms", &ipc.rms(), rms ? chunk.num_rows * 4 : 0}};
  for (const auto& [field, in, in_bytes] : inputs) {
    if (in_bytes == 0 || in->handle() != out.handle()) continue;
    if (out.offset() < in->offset() + in_bytes && in->offset() < out.offset() + bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "cuda_ipc.grad_input.offset = ", out.offset(), " (", bytes,
          " bytes) overlaps ", field, ".offset = ", in->offset(), " (", in_bytes,
          " bytes) in the same allocation"));
    }
  }
  return absl::OkStatus();
}

// On a worker, outside mu_ (the batch's spec is fixed once the header was accepted).
absl::StatusOr<DeviceRows> BackwardPipeline::OpenDeviceRows(
    const v1::CudaIpcChunk& ipc, const RowChunk& chunk,
    std::vector<std::shared_ptr<const DeviceBuffer>>& held) const {
  const std::string where = absl::StrCat("chunk ", chunk.index, ": ");
  const uint64_t bytes = chunk.num_rows * validator_.row_bytes();
  const bool rms_provided = validator_.spec().rms_provided;
  const uint64_t element = kernels::DTypeBytes(validator_.spec().dtype);
  DeviceRows rows;
  rows.rows = chunk.num_rows;
  const std::tuple<const char*, const v1::CudaIpcBuffer*, uint64_t, uint64_t, uint64_t*> parts[] =
      {{"cuda_ipc.x", &ipc.x(), bytes, element, &rows.x},
       {"cuda_ipc.dy", &ipc.dy(), bytes, element, &rows.dy},
       {"cuda_ipc.grad_input", &ipc.grad_input(), bytes, element, &rows.dx},
       {"cuda_ipc.rms", &ipc.rms(), rms_provided ? chunk.num_rows * 4 : 0, 4, &rows.rms}};
  for (const auto& [field, buffer, part_bytes, alignment, address] : parts) {
    if (part_bytes == 0) continue;
    absl::StatusOr<std::shared_ptr<const DeviceBuffer>> opened =
        env_->backend->OpenIpcBuffer(buffer->handle());
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat(where, field, ".handle: ",
                                                               opened.status().message()));
    }
    NORMGRAD_RETURN_IF_ERROR(CheckRegionRange(absl::StrCat(where, field, ".offset"),
                                              buffer->offset(), part_bytes, (*opened)->bytes,
                                              alignment));
    *address = (*opened)->address + buffer->offset();
    held.push_back(*std::move(opened));
  }
  // Two handles can name one allocation (bytes the driver ignores differ): only the device
  // addresses they open at tell whether grad_input overlaps what is read while it is written.
  const std::tuple<const char*, uint64_t, uint64_t> inputs[] = {
      {"cuda_ipc.x", rows.x, bytes},
      {"cuda_ipc.dy", rows.dy, bytes},
      {"cuda_ipc.rms", rows.rms, rms_provided ? chunk.num_rows * 4 : 0}};
  for (const auto& [field, address, in_bytes] : inputs) {
    if (in_bytes == 0) continue;
    if (rows.dx < address + in_bytes && address < rows.dx + bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "cuda_ipc.grad_input (", bytes, " bytes at device address 0x",
          absl::Hex(rows.dx), ") overlaps ", field, " (", in_bytes, " bytes at 0x",
          absl::Hex(address), "): their handles name the same device memory"));
    }
  }
  return rows;
}

// Reserves the bytes of the chunk in waiting_for_bytes_ and queues it. When the budget is short
// but this stream holds chunks of its own, it waits (without reading further) for their writes to
// release bytes; with nothing of its own to wait for it fails at once.
void BackwardPipeline::AdmitWaitingChunkLocked(StreamActions& a) {
  if (!waiting_for_bytes_.has_value() || finish_decided_) return;
  if (absl::Status s = env_->admission->ReserveBytes(waiting_for_bytes_->reserved); !s.ok()) {
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
  a.write_from = &writing_->response;
}

StreamActions BackwardPipeline::RunOneJob() {
  Job job;
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
                        : RunJob(job);
  job.request.reset();  // free x and dy before waiting for the write
  StreamActions a;
  std::lock_guard<std::mutex> lock(mu_);
  last_progress_ = absl::Now();
  if (!out.ok()) {
    FinishLocked(out.status(), a);
  } else if (*out != nullptr && !finish_decided_) {
    writes_.push_back(*std::move(out));
    StartNextWriteLocked(a);
  }
  compute_busy_ = false;
  ScheduleComputeLocked(a);
  if (!a.finish.has_value()) a.finish = TakeDeferredFinishLocked();
  return a;
}

// Blocking work of one job, outside mu_: only this thread touches session_ now.
absl::StatusOr<std::unique_ptr<BackwardPipeline::Outgoing>> BackwardPipeline::RunJob(Job& job) {
  const BatchSpec& spec = validator_.spec();  // fixed once the header was accepted
  switch (job.kind) {
    case Job::kStart: {
      const std::string& gamma = job.request->header().gamma();
      NORMGRAD_ASSIGN_OR_RETURN(
          session_, env_->backend->StartBackward(
                        spec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(gamma.data()),
                                                  gamma.size())));
      return std::unique_ptr<Outgoing>();
    }
    case Job::kChunk: {
      const v1::BackwardRequest& r = *job.request;
      auto out = std::make_unique<Outgoing>();
      out->reserved = job.reserved;
      out->is_chunk = true;
      out->response.set_first_row(job.chunk.first_row);
      out->response.set_num_rows(job.chunk.num_rows);
      if (r.has_cuda_ipc()) {
        // Zero copy on the device: the kernels read and write the client's buffers.
        std::vector<std::shared_ptr<const DeviceBuffer>> held;  // open until computed
        NORMGRAD_ASSIGN_OR_RETURN(
            const DeviceRows rows,
            OpenDeviceRows(r.cuda_ipc(), job.chunk, held));
        NORMGRAD_RETURN_IF_ERROR(session_->ProcessDeviceChunk(rows));
        env_->metrics->IncrementCounter("normgrad_chunks_total", {});
        std::lock_guard<std::mutex> lock(mu_);
        rows_sent_ += job.chunk.num_rows;
        return out;
      }
      if (job.in_region.has_value()) {
        // Zero copy: the backend reads x, dy and rms in the client's region and writes dx there.
        const RegionRows& in = *job.in_region;
        // Again as it starts (the check at the chunk's arrival may be long past): a page given
        // back since would be faulted in, and charged, to the server by the write below.
        NORMGRAD_RETURN_IF_ERROR(in.region->CheckAllocated(
            absl::StrCat("chunk ", job.chunk.index, ": shm.region_id=", r.shm().region_id())));
        uint8_t* base = in.region->data();
        const uint64_t bytes = job.chunk.num_rows * validator_.row_bytes();
        absl::Span<const float> rms;
        if (spec.rms_provided) {
          rms = absl::MakeConstSpan(reinterpret_cast<const float*>(base + in.rms),
                                    job.chunk.num_rows);
        }
        NORMGRAD_RETURN_IF_ERROR(session_->ProcessChunk(
            absl::MakeConstSpan(base + in.x, bytes), absl::MakeConstSpan(base + in.dy, bytes),
            rms, job.chunk.num_rows, absl::MakeSpan(base + in.grad_input, bytes)));
        env_->metrics->IncrementCounter("normgrad_chunks_total", {});
        std::lock_guard<std::mutex> lock(mu_);
        rows_sent_ += job.chunk.num_rows;
        return out;
      }
      std::string* dx = out->response.mutable_grad_input();
      dx->resize(r.x().size());
      std::vector<float> rms_copy;
      absl::Span<const float> rms;
      if (!r.rms().empty()) {
        rms_copy.resize(r.rms().size() / 4);
        std::memcpy(rms_copy.data(), r.rms().data(), r.rms().size());
        rms = rms_copy;
      }
      NORMGRAD_RETURN_IF_ERROR(session_->ProcessChunk(
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(r.x().data()), r.x().size()),
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(r.dy().data()), r.dy().size()),
          rms, job.chunk.num_rows,
          absl::MakeSpan(reinterpret_cast<uint8_t*>(dx->data()), dx->size())));
      out->payload_bytes = dx->size();
      env_->metrics->IncrementCounter("normgrad_chunks_total", {});
      std::lock_guard<std::mutex> lock(mu_);
      rows_sent_ += job.chunk.num_rows;
      return out;
    }
    case Job::kFinish: {
      auto out = std::make_unique<Outgoing>();
      out->is_final = true;
      std::string* dgamma = out->response.mutable_grad_gamma();
      uint64_t rows, chunks;
      absl::Time header_time;
      {
        std::lock_guard<std::mutex> lock(mu_);
        dgamma->resize(validator_.row_bytes());
        rows = validator_.rows_received();
        chunks = validator_.chunks_received();
        header_time = header_time_;
      }
      NORMGRAD_RETURN_IF_ERROR(session_->Finish(
          absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma->data()), dgamma->size())));
      v1::BackwardSummary* summary = out->response.mutable_summary();
      summary->set_backend(std::string(env_->backend->Name()));
      summary->set_kernel(std::string(session_->KernelName()));
      summary->set_rows(rows);
      summary->set_chunks(chunks);
      summary->set_compute_seconds(session_->ComputeSeconds());
      summary->set_total_seconds(absl::ToDoubleSeconds(absl::Now() - header_time));
      out->payload_bytes = dgamma->size();
      return out;
    }
  }
  return absl::InternalError("unknown job");
}

}  // namespace normgrad::server
