#include "server/service/normgrad_service.h"

#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/proto_conversion/proto_conversion.h"
#include "server/service/status_conversion.h"

namespace normgrad::server {
namespace {

constexpr char kBackwardMethod[] = "RmsNormBackward";
constexpr char kEmitPtxMethod[] = "EmitPtx";
constexpr char kServerInfoMethod[] = "GetServerInfo";

}  // namespace

void DescribeServiceMetrics(MetricsRegistry& m) {
  m.DescribeCounter("normgrad_requests_total", "Finished RPCs by method and gRPC status code.");
  m.DescribeHistogram("normgrad_request_duration_seconds",
                      "RPC latency from start to final status, by method.",
                      MetricsRegistry::LatencyBuckets());
  m.DescribeCounter("normgrad_received_bytes_total",
                    "Tensor and request payload bytes received, by method.");
  m.DescribeCounter("normgrad_sent_bytes_total", "Payload bytes sent, by method.");
  m.DescribeCounter("normgrad_rows_total", "Rows whose gradients were computed and sent.");
  m.DescribeCounter("normgrad_chunks_total", "Row chunks computed.");
}

void RecordRpc(MetricsRegistry& m, const char* method, absl::StatusCode code, double seconds,
               uint64_t bytes_in, uint64_t bytes_out) {
  m.Observe("normgrad_request_duration_seconds", {{"method", method}}, seconds);
  m.IncrementCounter("normgrad_received_bytes_total", {{"method", method}},
                     static_cast<double>(bytes_in));
  m.IncrementCounter("normgrad_sent_bytes_total", {{"method", method}},
                     static_cast<double>(bytes_out));
  // Last, so a scrape that counts the call also sees its latency and bytes.
  m.IncrementCounter("normgrad_requests_total",
                     {{"method", method}, {"code", absl::StatusCodeToString(code)}});
}

// One RmsNormBackward stream. Lifetime: reference counted; gRPC holds one reference until
// OnDone, each task on the worker pool and each watchdog visit holds one; the last Unref
// deletes. All state is guarded by mu_; gRPC operations (StartRead, StartWrite, Finish,
// TryCancel) are issued after mu_ is released, because their reactions may run inline.
class BackwardStream final
    : public grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse> {
 public:
  BackwardStream(ServiceEnv* env, grpc::CallbackServerContext* context)
      : env_(env), context_(context), validator_(env->config.batch_limits) {
    env_->streams->Add(this);
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_progress_ = start_;
      if (env_->draining.load()) {
        FinishLocked(absl::UnavailableError(
                       "the server is shutting down and takes no new streams; retry elsewhere"),
                   actions);
      } else if (absl::Status s = env_->admission->AdmitStream(); !s.ok()) {
        FinishLocked(s, actions);
      } else {
        admitted_ = true;
        env_->metrics->AddGauge("normgrad_inflight_streams", {}, 1);
        request_ = std::make_unique<v1::BackwardRequest>();
        MaybeStartReadLocked(actions);  // the first read: nothing held, nothing in flight
      }
    }
    Apply(actions);
  }

  void OnReadDone(bool ok) override {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      read_in_flight_ = false;
      last_progress_ = absl::Now();
      if (finish_called_) {
        // Nothing to do: the stream already has its status.
      } else if (!ok) {
        // The client half-closed, or the call died (then OnCancel follows or came first).
        reads_done_ = true;
        if (context_->IsCancelled()) {
          FinishLocked(CancelStatusLocked(), actions);
        } else if (absl::Status s = validator_.AtEndOfStream(); !s.ok()) {
          FinishLocked(s, actions);
        } else {
          Job job;
          job.kind = Job::kFinish;
          jobs_.push_back(std::move(job));
          ScheduleComputeLocked(actions);
        }
      } else {
        OnMessageLocked(actions);
      }
    }
    Apply(actions);
  }

  void OnWriteDone(bool ok) override {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_in_flight_ = false;
      last_progress_ = absl::Now();
      std::unique_ptr<Outgoing> done = std::move(writing_);
      if (done->reserved > 0) {
        env_->admission->ReleaseBytes(done->reserved);
        reserved_bytes_ -= done->reserved;
      }
      if (done->is_chunk) --chunks_held_;
      if (!ok) {
        if (!finish_called_) {
          FinishLocked(idle_cancel_status_.ok()
                           ? absl::CancelledError("the client stopped receiving responses")
                           : idle_cancel_status_,
                       actions);
        }
      } else if (!finish_called_) {
        bytes_out_ += done->payload_bytes;
        if (done->is_final) {
          FinishLocked(absl::OkStatus(), actions);
        } else {
          StartNextWriteLocked(actions);
          AdmitWaitingChunkLocked(actions);
          MaybeStartReadLocked(actions);
        }
      }
    }
    Apply(actions);
  }

  void OnCancel() override {
    cancelled_.store(true);
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finish_called_) {
        FinishLocked(CancelStatusLocked(), actions);
      }
    }
    Apply(actions);
  }

  void OnDone() override {
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    absl::StatusCode code;
    uint64_t bytes_in, bytes_out, rows;
    {
      std::lock_guard<std::mutex> lock(mu_);
      code = final_code_;
      bytes_in = bytes_in_;
      bytes_out = bytes_out_;
      rows = rows_sent_;
    }
    env_->metrics->IncrementCounter("normgrad_rows_total", {}, static_cast<double>(rows));
    RecordRpc(*env_->metrics, kBackwardMethod, code, seconds, bytes_in, bytes_out);
    if (admitted_) {
      env_->metrics->AddGauge("normgrad_inflight_streams", {}, -1);
      env_->admission->ReleaseStream();
    }
    Unref();
  }

  // Watchdog: ends the stream when it waited on its client for longer than `timeout`.
  void CheckIdle(absl::Time now, absl::Duration timeout) {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_called_ || compute_busy_ || now - last_progress_ < timeout) return;
      if (write_in_flight_) {
        // The client does not read: trailers could not reach it either (a Finish would wait
        // behind the stuck write), so cancel the call; OnCancel then finishes with this status.
        if (idle_cancel_status_.ok()) {
          idle_cancel_status_ = absl::DeadlineExceededError(
              absl::StrCat("stream idle timeout: the client read no response for ",
                           absl::FormatDuration(timeout), " (--stream-idle-timeout)"));
          actions.try_cancel = true;
        }
      } else if (read_in_flight_) {
        FinishLocked(absl::DeadlineExceededError(absl::StrCat(
                       "stream idle timeout: no request message for ",
                       absl::FormatDuration(timeout), " after ", validator_.rows_received(),
                       " rows (--stream-idle-timeout)")),
                   actions);
      } else {
        return;
      }
    }
    Apply(actions);
  }

  // Why a call gRPC reports cancelled ended, as far as the server can tell (for the status and
  // metrics): the watchdog's reason when it cancelled the call, else the deadline or a cancel.
  absl::Status CancelStatusLocked() const {
    if (!idle_cancel_status_.ok()) return idle_cancel_status_;
    if (absl::FromChrono(context_->deadline()) <= absl::Now()) {
      return absl::DeadlineExceededError("the client's deadline passed");
    }
    return absl::CancelledError(
        "the stream was cancelled (by the client, or by server shutdown after the grace)");
  }

  // A reference for someone who found the stream in the registry; false when it is being
  // destroyed.
  bool TryRef() {
    int refs = refs_.load();
    while (refs > 0) {
      if (refs_.compare_exchange_weak(refs, refs + 1)) return true;
    }
    return false;
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 private:
  struct Job {
    enum Kind { kStart, kChunk, kFinish } kind = kChunk;
    std::unique_ptr<v1::BackwardRequest> request;
    RowChunk chunk;
    uint64_t reserved = 0;
  };
  struct Outgoing {
    v1::BackwardResponse response;
    uint64_t reserved = 0;
    uint64_t payload_bytes = 0;
    bool is_chunk = false;
    bool is_final = false;
  };
  // gRPC operations decided under mu_ and issued after it is released. The buffers are taken
  // under mu_ too, so that Apply reads no guarded member without it.
  struct Actions {
    bool start_read = false;
    bool start_write = false;
    v1::BackwardRequest* read_into = nullptr;
    const v1::BackwardResponse* write_from = nullptr;
    bool schedule = false;
    bool try_cancel = false;
    std::optional<grpc::Status> finish;
  };

  ~BackwardStream() override {
    session_.reset();  // backend state goes before the backend may
    jobs_.clear();
    writes_.clear();
    waiting_for_bytes_.reset();
    if (reserved_bytes_ > 0) env_->admission->ReleaseBytes(reserved_bytes_);
    // Last: once the registry is empty, a draining server may tear down what we used.
    env_->streams->Remove(this);
  }

  void Apply(Actions& a) {
    if (a.start_read) StartRead(a.read_into);
    if (a.start_write) StartWrite(a.write_from);
    if (a.schedule) {
      refs_.fetch_add(1);
      env_->pool->Schedule([this] { RunOneJob(); });
    }
    // Finish must not overtake a StartRead/StartWrite that another thread decided on but has
    // not issued yet: FinishLocked defers it, and whoever issues the last pending op sends it.
    std::optional<grpc::Status> finish = std::move(a.finish);
    const int issued = int{a.start_read} + int{a.start_write};
    if (issued > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      issuing_ -= issued;
      if (issuing_ == 0 && deferred_finish_.has_value()) {
        finish = std::move(deferred_finish_);
        deferred_finish_.reset();
      }
    }
    if (finish.has_value()) Finish(*finish);
    if (a.try_cancel) context_->TryCancel();
  }

  void FinishLocked(const absl::Status& status, Actions& a) {
    if (finish_called_) return;
    finish_called_ = true;
    final_code_ = status.code();
    if (a.start_read) {
      a.start_read = false;
      --issuing_;
    }
    if (a.start_write) {
      a.start_write = false;
      --issuing_;
    }
    if (issuing_ > 0) {
      deferred_finish_ = ToGrpcStatus(status);
    } else {
      a.finish = ToGrpcStatus(status);
    }
  }

  void OnMessageLocked(Actions& a) {
    const v1::BackwardRequest& message = *request_;
    const uint64_t message_bytes = message.x().size() + message.dy().size() +
                                   message.rms().size() + message.header().gamma().size();
    const uint64_t x_bytes = message.x().size();
    bytes_in_ += message_bytes;
    absl::StatusOr<AcceptedMessage> accepted = validator_.Accept(message);
    if (!accepted.ok()) {
      FinishLocked(accepted.status(), a);
      return;
    }
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
    // Held until the response is written: the request (x, dy, rms) and the response (dx).
    job.reserved = message_bytes + x_bytes;
    waiting_for_bytes_ = std::move(job);
    AdmitWaitingChunkLocked(a);
  }

  // Reserves the bytes of the chunk in waiting_for_bytes_ and queues it. When the budget is
  // short but this stream holds chunks of its own, it waits (without reading further) for
  // their writes to release bytes; with nothing of its own to wait for it fails at once.
  void AdmitWaitingChunkLocked(Actions& a) {
    if (!waiting_for_bytes_.has_value() || finish_called_) return;
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

  void MaybeStartReadLocked(Actions& a) {
    if (finish_called_ || reads_done_ || read_in_flight_ || waiting_for_bytes_.has_value()) return;
    if (chunks_held_ >= kMaxChunksHeldPerStream) return;  // flow control: resume on a write
    read_in_flight_ = true;
    ++issuing_;
    a.start_read = true;
    a.read_into = request_.get();
  }

  void ScheduleComputeLocked(Actions& a) {
    if (compute_busy_ || jobs_.empty() || finish_called_) return;
    compute_busy_ = true;
    a.schedule = true;
  }

  void PushWriteLocked(std::unique_ptr<Outgoing> out, Actions& a) {
    writes_.push_back(std::move(out));
    StartNextWriteLocked(a);
  }

  void StartNextWriteLocked(Actions& a) {
    if (finish_called_ || write_in_flight_ || writes_.empty()) return;
    writing_ = std::move(writes_.front());
    writes_.pop_front();
    write_in_flight_ = true;
    ++issuing_;
    a.start_write = true;
    a.write_from = &writing_->response;
  }

  // Runs on the worker pool; holds a reference taken by Apply.
  void RunOneJob() {
    Job job;
    bool have_job = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_called_ || jobs_.empty()) {
        compute_busy_ = false;
      } else {
        job = std::move(jobs_.front());
        jobs_.pop_front();
        have_job = true;
      }
    }
    if (have_job) {
      absl::StatusOr<std::unique_ptr<Outgoing>> out = cancelled_.load()
          ? absl::StatusOr<std::unique_ptr<Outgoing>>(absl::CancelledError("cancelled"))
          : RunJob(job);
      job.request.reset();  // free x and dy before waiting for the write
      Actions actions;
      {
        std::lock_guard<std::mutex> lock(mu_);
        last_progress_ = absl::Now();
        if (!out.ok()) {
          FinishLocked(out.status(), actions);
        } else if (*out != nullptr && !finish_called_) {
          PushWriteLocked(*std::move(out), actions);
        }
        compute_busy_ = false;
        ScheduleComputeLocked(actions);
      }
      Apply(actions);
    }
    Unref();
  }

  // Blocking work of one job, outside mu_: only this thread touches session_ now.
  absl::StatusOr<std::unique_ptr<Outgoing>> RunJob(Job& job) {
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
        dgamma->resize(validator_.row_bytes());
        NORMGRAD_RETURN_IF_ERROR(session_->Finish(
            absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma->data()), dgamma->size())));
        v1::BackwardSummary* summary = out->response.mutable_summary();
        summary->set_backend(std::string(env_->backend->Name()));
        summary->set_kernel(std::string(session_->KernelName()));
        summary->set_rows(validator_.rows_received());
        summary->set_chunks(validator_.chunks_received());
        summary->set_compute_seconds(session_->ComputeSeconds());
        summary->set_total_seconds(absl::ToDoubleSeconds(absl::Now() - header_time_));
        out->payload_bytes = dgamma->size();
        return out;
      }
    }
    return absl::InternalError("unknown job");
  }

  ServiceEnv* const env_;
  grpc::CallbackServerContext* const context_;
  const absl::Time start_ = absl::Now();
  std::atomic<int> refs_{1};  // gRPC's, dropped in OnDone
  std::atomic<bool> cancelled_{false};
  bool admitted_ = false;  // set in the constructor only
  std::unique_ptr<BackwardSession> session_;  // only the running job touches it

  std::mutex mu_;
  BackwardValidator validator_;  // guarded by mu_
  std::unique_ptr<v1::BackwardRequest> request_;  // the read buffer; owned by the read in flight
  std::deque<Job> jobs_;  // guarded by mu_
  std::optional<Job> waiting_for_bytes_;  // read, not yet admitted (guarded by mu_)
  std::deque<std::unique_ptr<Outgoing>> writes_;  // guarded by mu_
  std::unique_ptr<Outgoing> writing_;  // owned by the write in flight
  bool read_in_flight_ = false;  // guarded by mu_
  bool reads_done_ = false;  // guarded by mu_
  bool write_in_flight_ = false;  // guarded by mu_
  bool compute_busy_ = false;  // guarded by mu_
  bool finish_called_ = false;  // guarded by mu_
  int issuing_ = 0;  // StartRead/StartWrite decided, not yet issued (guarded by mu_)
  std::optional<grpc::Status> deferred_finish_;  // guarded by mu_
  absl::Status idle_cancel_status_;  // set when the watchdog cancels (guarded by mu_)
  absl::StatusCode final_code_ = absl::StatusCode::kUnknown;  // until decided (guarded by mu_)
  int chunks_held_ = 0;  // guarded by mu_
  uint64_t reserved_bytes_ = 0;  // guarded by mu_ except in the destructor
  uint64_t bytes_in_ = 0;  // guarded by mu_
  uint64_t bytes_out_ = 0;  // guarded by mu_
  uint64_t rows_sent_ = 0;  // guarded by mu_
  absl::Time last_progress_;  // guarded by mu_
  absl::Time header_time_ = absl::Now();  // guarded by mu_

  friend class StreamRegistry;
};

void StreamRegistry::Add(BackwardStream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.insert(stream);
}

void StreamRegistry::Remove(BackwardStream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(stream);
  if (streams_.empty()) emptied_.notify_all();
}

size_t StreamRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_.size();
}

void StreamRegistry::CheckIdle(absl::Time now, absl::Duration timeout) {
  std::vector<BackwardStream*> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (BackwardStream* s : streams_) {
      if (s->TryRef()) held.push_back(s);
    }
  }
  for (BackwardStream* s : held) {
    s->CheckIdle(now, timeout);
    s->Unref();
  }
}

bool StreamRegistry::WaitUntilEmpty(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  // absl::InfiniteFuture() becomes time_point::max(): a wait without end.
  return emptied_.wait_until(lock, absl::ToChronoTime(deadline),
                             [this] { return streams_.empty(); });
}

grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>*
NormGradService::RmsNormBackward(grpc::CallbackServerContext* context) {
  return new BackwardStream(env_, context);
}

grpc::ServerUnaryReactor* NormGradService::EmitPtx(grpc::CallbackServerContext* context,
                                                   const v1::EmitPtxRequest* request,
                                                   v1::EmitPtxResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  ServiceEnv* env = env_;
  if (env->draining.load()) {
    absl::Status s = absl::UnavailableError("the server is shutting down; retry elsewhere");
    RecordRpc(*env->metrics, kEmitPtxMethod, s.code(), 0, 0, 0);
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  // Emission and nvJitLink may take a while: never in a reaction.
  env->pool->Schedule([env, reactor, request, response, start] {
    absl::StatusOr<v1::EmitPtxResponse> r = env->ptx->Emit(*request);
    absl::Status status = r.status();
    if (r.ok()) *response = *std::move(r);
    RecordRpc(*env->metrics, kEmitPtxMethod, status.code(),
              absl::ToDoubleSeconds(absl::Now() - start), request->ByteSizeLong(),
              status.ok() ? response->ByteSizeLong() : 0);
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

grpc::ServerUnaryReactor* NormGradService::GetServerInfo(grpc::CallbackServerContext* context,
                                                         const v1::GetServerInfoRequest*,
                                                         v1::GetServerInfoResponse* response) {
  const absl::Time start = absl::Now();
  response->set_version(env_->config.version);
  response->set_backend(std::string(env_->backend->Name()));
  ToProto(env_->backend->Device(), response->mutable_device());
  v1::Limits* limits = response->mutable_limits();
  limits->set_max_concurrent_streams(env_->admission->limits().max_streams);
  limits->set_max_inflight_bytes(env_->admission->limits().max_inflight_bytes);
  limits->set_max_hidden_dim(env_->config.batch_limits.max_hidden_dim);
  limits->set_max_num_rows(env_->config.batch_limits.max_num_rows);
  limits->set_max_message_bytes(env_->config.max_message_bytes);
  limits->set_stream_idle_timeout_seconds(
      absl::ToDoubleSeconds(env_->config.stream_idle_timeout));
  ToProto(env_->backend->CacheStats(), response->mutable_cache());
  ToProto(env_->ptx->CacheStats(), response->mutable_ptx_cache());
  response->set_nvjitlink_available(env_->ptx->has_nvjitlink());
  for (std::string& name : KernelNames()) response->add_kernels(std::move(name));
  RecordRpc(*env_->metrics, kServerInfoMethod, absl::StatusCode::kOk,
            absl::ToDoubleSeconds(absl::Now() - start), 0, response->ByteSizeLong());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace normgrad::server
