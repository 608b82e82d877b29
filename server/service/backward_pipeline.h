// The logic of one RmsNormBackward stream, with no gRPC in it: request messages in, actions out.
// The gRPC reactor (BackwardStream, normgrad_service.cc) feeds it what gRPC reports (a read
// done, a write done, a cancel) and carries out the actions it returns; tests drive it directly.
//
//   BackwardPipeline p(deps, deadline);
//   StreamActions a = p.Start();                  // admission; usually: start the first read
//   ... a.read_into is where the reactor reads the next message; then
//   a = p.OnReadDone(ok, call_cancelled);         // validate, queue a job, maybe read again
//   a = p.RunOneJob();                            // on the worker pool when a.schedule
//   a = p.OnWriteDone(ok);                        // release the chunk's bytes, next write, read
//   std::optional<absl::Status> f = p.Issued(n);  // after issuing n reads/writes (see below)
//
// What it guarantees (docs/architecture.md): one read, one write and one job in flight at a
// time; at most kMaxChunksHeldPerStream chunks held (read, not yet written) before it stops
// reading, so flow control reaches the client through HTTP/2 windows; every chunk's bytes
// reserved with the AdmissionController before it is queued; responses in request order; exactly
// one final status, never issued while a read or write the caller decided on is still pending.
//
// Its parts, each usable alone: BackwardValidator (the message sequence), remote_rows.h (where a
// chunk's rows are), StreamWatchdog (idle and rate), BackwardJobRunner (the blocking work).
//
// Thread-safe: every method takes the pipeline's lock. RunOneJob computes outside it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/backend/backend.h"
#include "server/service/service_metrics.h"
#include "server/service/admission.h"
#include "server/service/backward_job.h"
#include "server/service/backward_validator.h"
#include "server/service/remote_rows.h"
#include "server/service/stream_watchdog.h"
#include "server/shared_memory/region_registry.h"

namespace normgrad::server {

inline constexpr int kMaxChunksHeldPerStream = 3;

// What the caller must do, in this order: start the read, start the write, schedule
// RunOneJob on the worker pool, report the number of reads and writes issued to Issued() and
// finish with `finish` or with what Issued() returns, cancel the call.
struct StreamActions {
  v1::BackwardRequest* read_into = nullptr;         // start a read into this buffer
  const Outgoing* write_from = nullptr;  // start a write of this response
  bool schedule = false;                             // run RunOneJob() once on the pool
  bool try_cancel = false;  // the client stopped reading: only a cancel ends the call now
  std::optional<absl::Status> finish;  // the stream's final status

  int issued() const { return int{read_into != nullptr} + int{write_from != nullptr}; }
};

// What the stream did, for its metrics once it is over.
struct StreamTotals {
  absl::StatusCode code = absl::StatusCode::kUnknown;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t rows = 0;
  // x, dy, rms and gamma in, grad_input out, wherever they travelled (messages or a region).
  uint64_t tensor_bytes = 0;
  // "shm" or "cuda_ipc" when some chunk's rows were in a shared-memory region or in device
  // memory of the client (the last such kind), else null.
  const char* payload_transport = nullptr;
};

// What a stream borrows from the server, which outlives every stream.
struct StreamDeps {
  Backend* backend = nullptr;
  AdmissionController* admission = nullptr;  // stream slots and the byte budget
  const ServiceMetrics* metrics = nullptr;
  const RegionRegistry* regions = nullptr;  // shared-memory regions; null: none taken
  bool cuda_ipc = false;  // chunks may name device memory of backend->DeviceUuid()
  BackwardLimits limits;
  MinStreamRate min_rate;
};

class BackwardPipeline {
 public:
  // `deadline`: the call's deadline, to tell a deadline from a cancel. `peer_is_local`: the
  // client reached a unix socket or a loopback address, so it may name shared-memory regions.
  // `client`: the caller's identity, whose share of the stream slots this stream takes.
  BackwardPipeline(const StreamDeps& deps, absl::Time deadline, bool peer_is_local = false,
                   std::string client = "");
  // Close(), and gives back the stream's slot if OnDone never came.
  ~BackwardPipeline();
  // Drops the backend session, the queued work and the bytes still reserved: the owner calls it
  // before the backend may go away (it outlives only the registry's streams). Once, at the end.
  void Close();

  BackwardPipeline(const BackwardPipeline&) = delete;
  BackwardPipeline& operator=(const BackwardPipeline&) = delete;

  // Admits the stream (or refuses it: --max-streams) and starts the first read. `refused`: not
  // OK when the server takes no streams (draining, an unusable device) or the caller may not use
  // the service (its unix peer's user); the stream then ends with it at once.
  StreamActions Start(absl::Status refused = absl::OkStatus());
  // `ok` false: the client half-closed or the call died; `call_cancelled` says which. `beside`:
  // the message's x and dy when the transport kept them out of it (bulk_wire.h).
  StreamActions OnReadDone(bool ok, bool call_cancelled, BesideBytes beside = {});
  // A message arrived (`bytes` long) that does not parse as a BackwardRequest: the stream ends
  // with INVALID_ARGUMENT saying which message.
  StreamActions OnUnparsableMessage(uint64_t bytes);
  StreamActions OnWriteDone(bool ok);
  StreamActions OnCancel();
  // Runs the next queued job (session start, a chunk, the final grad_gamma); blocking.
  StreamActions RunOneJob();
  // The watchdog's visit (StreamWatchdog): ends the stream when it waited on its client for
  // longer than `timeout` (0: never), or moved its rows slower than deps.min_rate.
  StreamActions CheckIdle(absl::Time now, absl::Duration timeout);
  // The caller issued `count` reads/writes of earlier actions. Returns the final status when a
  // finish was held back for them and none is pending any more.
  std::optional<absl::Status> Issued(int count);

  // gRPC is done with the call: gives back the stream's slot (its bytes go with the pipeline,
  // once no job holds them) and returns what the stream did, for its metrics. Once.
  StreamTotals OnDone();
  absl::Time start_time() const { return start_; }

 private:
  // A read or write completed: no longer in flight (`in_flight` is its flag), and progress.
  void IoDoneLocked(bool& in_flight);
  void FinishLocked(const absl::Status& status, StreamActions& a);
  // The held-back finish, once no read or write is being issued and no job runs.
  std::optional<absl::Status> TakeDeferredFinishLocked();
  absl::Status CancelStatusLocked() const;
  void OnMessageLocked(StreamActions& a, BesideBytes beside);
  // Where a chunk's rows are (shared memory, device memory): checked, and kept in `job`.
  absl::Status LocateRowsLocked(BackwardJob& job);
  void AdmitWaitingChunkLocked(StreamActions& a);
  void MaybeStartReadLocked(StreamActions& a);
  void ScheduleComputeLocked(StreamActions& a);
  void StartNextWriteLocked(StreamActions& a);

  const StreamDeps deps_;
  const absl::Time deadline_;
  const bool peer_is_local_;
  const std::string client_;
  const absl::Time start_ = absl::Now();
  std::atomic<bool> cancelled_{false};
  BackwardJobRunner runner_;  // only the running job touches it

  mutable std::mutex mu_;
  bool admitted_ = false;  // guarded by mu_
  BackwardValidator validator_;  // guarded by mu_
  std::unique_ptr<v1::BackwardRequest> request_;  // the read buffer; owned by the read in flight
  std::deque<BackwardJob> jobs_;  // guarded by mu_
  std::optional<BackwardJob> waiting_for_bytes_;  // read, not yet admitted (guarded by mu_)
  std::deque<std::unique_ptr<Outgoing>> writes_;  // guarded by mu_
  std::unique_ptr<Outgoing> writing_;  // owned by the write in flight
  bool read_in_flight_ = false;  // guarded by mu_
  bool reads_done_ = false;  // guarded by mu_
  bool write_in_flight_ = false;  // guarded by mu_
  bool compute_busy_ = false;  // guarded by mu_
  bool finish_decided_ = false;  // guarded by mu_
  int issuing_ = 0;  // reads/writes returned to the caller, not yet issued (guarded by mu_)
  std::optional<absl::Status> deferred_finish_;  // guarded by mu_
  absl::Status idle_cancel_status_;  // set when the watchdog cancels (guarded by mu_)
  absl::StatusCode final_code_ = absl::StatusCode::kUnknown;  // until decided (guarded by mu_)
  int chunks_held_ = 0;  // guarded by mu_
  uint64_t reserved_bytes_ = 0;  // guarded by mu_
  uint64_t bytes_in_ = 0;  // guarded by mu_
  uint64_t bytes_out_ = 0;  // guarded by mu_
  uint64_t rows_sent_ = 0;  // guarded by mu_
  const char* payload_transport_ = nullptr;  // StreamTotals::payload_transport; mu_
  absl::Time header_time_ = absl::Now();  // guarded by mu_
  uint64_t tensor_bytes_in_ = 0;  // x, dy, rms and gamma received (guarded by mu_)
  StreamWatchdog watchdog_;  // guarded by mu_
};

}  // namespace normgrad::server
