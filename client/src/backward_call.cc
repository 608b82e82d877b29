#include "client/src/backward_call.h"

#include <grpcpp/alarm.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/client_callback.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/src/backward_exchange.h"
#include "client/src/grpc_status.h"
#include "proto/normgrad/v1/bulk_wire.h"
#include "proto/normgrad/v1/metadata_keys.h"

namespace normgrad::client_internal {
namespace {

constexpr char kBackwardMethod[] = "/normgrad.v1.NormGrad/RmsNormBackward";
constexpr char kBackwardUnaryMethod[] = "/normgrad.v1.NormGrad/RmsNormBackwardUnary";
using v1::kWritesDoneTrailer;

// One attempt of one RmsNormBackward stream. Writes the header, then each row chunk from
// OnWriteDone (one write in flight), reads grad_input chunks into args.dx as they come. Deletes
// itself in OnDone, after handing the result on (or starting the next attempt).
class BackwardCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Shared = BackwardShared;

  BackwardCall(CallHost* client, std::shared_ptr<Shared> shared, int attempt);
  void Start();

  void OnWriteDone(bool ok) override;
  void OnWritesDoneDone(bool ok) override {}
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  // Whoever may still call into this attempt from a timer: OnDone clears `call` (under `mu`)
  // before the attempt is deleted, and a timer's callback holds `mu` while it runs.
  struct TimerTarget {
    std::mutex mu;
    BackwardCall* call = nullptr;
  };

  bool MemoryCall() const { return exchange_.memory_call(); }
  // The in-order cancel of a memory call (docs/api.md, "The end of a call"): no chunk is sent
  // after it; a BackwardRequest.cancel follows the chunks already sent, and the server's status
  // then comes only once its jobs are done. Cut off (TryCancel) after writes_done_grace.
  void CancelInOrder(absl::Status why);
  // Ends what may start a write from outside the reactions (the caller's CallCancellation, the
  // deadline and grace timers; each is waited for if it runs now), then removes the hold that
  // kept gRPC from finishing the call meanwhile. Once, at the end of the read chain: gRPC
  // destroys the call's stream before OnDone, so a StartWrite from outside after that would
  // touch freed memory.
  void ReleaseHold();
  // Runs `then(call)` at `at` unless OnDone came first.
  void SetTimer(std::unique_ptr<grpc::Alarm>& alarm, absl::Time at,
                std::function<void(BackwardCall*)> then);
  // What the write chain does next (the exchange decides, under mu_), with a message encoded
  // in request_buffer_.
  using NextWrite = BackwardExchange::Next;
  NextWrite NextWriteLocked();
  void Issue(NextWrite next);
  // The exchange's message on the wire, x, dy and rms not copied but pointed at (the Shared's
  // pin).
  void EncodeRequestLocked();

  // The reactions run on gRPC's threads, one write chain and one read chain at a time. Every
  // reaction takes mu_ before it touches the state, and Start publishes the state under it: the
  // ordering gRPC gives between a Start* and its reaction is then also visible to
  // ThreadSanitizer, which cannot see inside Debian's gRPC (docs/testing.md).
  std::mutex mu_;

  CallHost* client_;
  std::shared_ptr<Shared> shared_;
  int attempt_;
  // The call's state: what is written next, what came back (guarded by mu_). exposed(): a chunk
  // naming the caller's memory was handed to gRPC, so the server may touch that memory until its
  // status says it stopped (kWritesDoneTrailer); cancel_status(): why CancelInOrder ran (the
  // call's status unless it ended OK).
  BackwardExchange exchange_;
  grpc::ClientContext context_;
  grpc::ByteBuffer request_buffer_;   // the exchange's message and its row bytes, as written
  grpc::ByteBuffer response_buffer_;  // as read
  v1::BackwardResponse response_;     // response_buffer_, less grad_input
  v1::ReceivedBytes grad_input_;      // grad_input where gRPC received it
  bool any_response_ = false;
  absl::Status error_;  // a malformed reply seen in OnReadDone; the call is cancelled
  std::shared_ptr<TimerTarget> timer_target_ = std::make_shared<TimerTarget>();
  std::unique_ptr<grpc::Alarm> deadline_alarm_;  // the caller's deadline (memory calls)
  std::unique_ptr<grpc::Alarm> grace_alarm_;     // the cut-off after an in-order cancel
  std::atomic<bool> hold_released_{false};       // ReleaseHold ran
};

// A batch in one RmsNormBackwardUnary call (ClientOptions::unary_small_batches): the header and
// every row in one request, x, dy and rms lent to gRPC as the stream's chunks are; grad_input
// read from gRPC's slices into the caller's dx once the whole answer is checked. One attempt;
// retried as a stream is (UNAVAILABLE, or CANCELLED before an answer), and a server without the
// method (UNIMPLEMENTED) gets the stream. Deletes itself in OnDone.
class UnaryBackwardCall final : public grpc::ClientUnaryReactor {
 public:
  using Shared = BackwardCall::Shared;
  UnaryBackwardCall(CallHost* client, std::shared_ptr<Shared> shared, int attempt)
      : client_(client),
        shared_(std::move(shared)),
        attempt_(attempt),
        exchange_(shared_->args, shared_->options, /*shm=*/nullptr,
                  /*chunk_bytes=*/std::numeric_limits<uint64_t>::max()) {}  // one message
  void Start();
  void OnDone(const grpc::Status& status) override;

 private:
  // Checks the answer and copies it into the caller's arrays.
  absl::Status TakeResponse();

  std::mutex mu_;  // as BackwardCall's: Start and OnDone run on different threads
  CallHost* client_;
  std::shared_ptr<Shared> shared_;
  int attempt_;
  BackwardExchange exchange_;  // the whole batch in one message, and its one answer
  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

// Hands a call's result to its caller once gRPC gave back the caller's memory (MemoryLoan).
void DeliverBackward(std::shared_ptr<BackwardShared> shared, absl::Status result,
                     BackwardSummary summary, int attempts) {
  std::shared_ptr<MemoryLoan> loan = shared->loan;
  shared->pin.reset();
  loan->DeliverWhenReturned([shared = std::move(shared), result = std::move(result),
                             summary = std::move(summary), attempts]() mutable {
    if (!result.ok()) {
      shared->done(std::move(result));
    } else {
      shared->done(RawBackwardResult{std::move(summary), attempts});
    }
  });
}

BackwardCall::BackwardCall(CallHost* client, std::shared_ptr<Shared> shared, int attempt)
    : client_(client),
      shared_(std::move(shared)),
      attempt_(attempt),
      exchange_(shared_->args, shared_->options, shared_->shm ? &*shared_->shm : nullptr,
                shared_->shm.has_value() || shared_->args.device.has_value()
                    ? client->options().shm_chunk_bytes
                    : client->options().chunk_bytes) {}

void BackwardCall::Start() {
  const bool memory = MemoryCall();
  const absl::Duration grace = client_->options().writes_done_grace;
  {
    std::lock_guard<std::mutex> lock(mu_);
    timer_target_->call = this;
    if (shared_->has_deadline) {
      // A memory call's deadline is the client's to enforce in order (CancelInOrder); gRPC's
      // cut-off comes only after the grace.
      context_.set_deadline(memory ? absl::ToChronoTime(absl::FromChrono(shared_->deadline) + grace)
                                   : shared_->deadline);
      if (memory) {
        SetTimer(deadline_alarm_, absl::FromChrono(shared_->deadline), [](BackwardCall* call) {
          call->CancelInOrder(absl::DeadlineExceededError("the call's deadline passed"));
        });
      }
    }
    client_->AddMetadata(context_);
  }
  // ClientContext::TryCancel may come before the call starts (the call then starts cancelled).
  // gRPC does not run this reactor's OnDone inline inside TryCancel, so OnDone's Detach waits
  // for a Cancel() in progress and the context outlives it.
  if (shared_->options.cancellation) {
    if (memory) {
      shared_->options.cancellation->Attach(
          [this] { CancelInOrder(absl::CancelledError("the call was cancelled by its caller")); });
    } else {
      shared_->options.cancellation->Attach([this] { context_.TryCancel(); });
    }
  }
  client_->generic().PrepareBidiStreamingCall(&context_, kBackwardMethod, grpc::StubOptions(),
                                              this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    exchange_.StartHeader();
    EncodeRequestLocked();
  }
  AddHold();  // until ReleaseHold: writes may start from outside the reactions until then
  StartWrite(&request_buffer_);
  StartRead(&response_buffer_);
  StartCall();
}

void BackwardCall::ReleaseHold() {
  // The reaction that ends the reads may run before any other took mu_ (OnReadDone(false) as
  // the first reaction): taking it once orders this call's construction and Start() before the
  // reads below for ThreadSanitizer too, which cannot see the ordering gRPC gives (Debian's
  // libgrpc is not instrumented). Never called with mu_ held.
  { std::lock_guard<std::mutex> lock(mu_); }
  if (hold_released_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(timer_target_->mu);  // waits for a timer's callback
    timer_target_->call = nullptr;
  }
  if (shared_->options.cancellation) shared_->options.cancellation->Detach();  // waits for Cancel
  RemoveHold();
}

void BackwardCall::SetTimer(std::unique_ptr<grpc::Alarm>& alarm, absl::Time at,
                            std::function<void(BackwardCall*)> then) {
  alarm = std::make_unique<grpc::Alarm>();
  // The alarm goes with this attempt (its destructor cancels it: the callback then sees ok
  // false); the target outlives both.
  alarm->Set(absl::ToChronoTime(at),
             [target = std::weak_ptr<TimerTarget>(timer_target_), then = std::move(then)](bool ok) {
               std::shared_ptr<TimerTarget> t = target.lock();
               if (!ok || t == nullptr) return;
               std::lock_guard<std::mutex> lock(t->mu);
               if (t->call != nullptr) then(t->call);
             });
}

void BackwardCall::CancelInOrder(absl::Status why) {
  std::unique_lock<std::mutex> lock(mu_);
  switch (exchange_.Cancel(std::move(why))) {
    case BackwardExchange::kAlready:
      return;
    case BackwardExchange::kCutOff:
      // No chunk was handed to gRPC, and none will be: the server cannot touch the caller's
      // memory, so the call may simply be cut off.
      lock.unlock();
      context_.TryCancel();
      return;
    case BackwardExchange::kInOrder:
      break;
  }
  SetTimer(grace_alarm_, absl::Now() + client_->options().writes_done_grace,
           [](BackwardCall* call) { call->context_.TryCancel(); });
  const NextWrite next = NextWriteLocked();  // the cancel, unless a write is in flight
  lock.unlock();
  Issue(next);
}

BackwardCall::NextWrite BackwardCall::NextWriteLocked() {
  const NextWrite next = exchange_.NextWrite();
  if (next == BackwardExchange::kMessage) EncodeRequestLocked();
  return next;
}

void BackwardCall::Issue(NextWrite next) {
  if (next == BackwardExchange::kMessage) StartWrite(&request_buffer_);
  if (next == BackwardExchange::kWritesDone) StartWritesDone();
}

void BackwardCall::EncodeRequestLocked() {
  const absl::Span<const v1::BulkField> bulk = exchange_.bulk();
  request_buffer_ = v1::EncodeWithBulk(exchange_.message(), bulk,
                                       bulk.empty() ? nullptr : shared_->pin);
}

void BackwardCall::OnWriteDone(bool ok) {
  if (!ok) return;  // the stream is broken; OnDone reports why
  NextWrite next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    exchange_.WriteDone();
    next = NextWriteLocked();
  }
  Issue(next);
}

void BackwardCall::OnReadDone(bool ok) {
  if (!ok) {  // end of stream; OnDone follows
    ReleaseHold();
    return;
  }
  bool malformed;
  NextWrite next = BackwardExchange::kNothing;
  uint64_t progress = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    any_response_ = true;
    const uint64_t rows_before = exchange_.rows_received();
    error_ = v1::DecodeWithBulk(response_buffer_, &response_,
                                {{v1::BackwardResponse::kGradInputFieldNumber, &grad_input_}})
                 ? exchange_.TakeAnswer(response_, grad_input_)
                 : absl::InternalError(absl::StrCat("server sent a message of ",
                                                    response_buffer_.Length(),
                                                    " bytes that is not a BackwardResponse"));
    grad_input_.Clear();  // gives gRPC's slices back
    malformed = !error_.ok();
    if (!malformed) next = NextWriteLocked();  // a memory call's next chunk may wait for this
    // Reported outside mu_ (a callback may cancel the call).
    if (exchange_.rows_received() != rows_before) progress = exchange_.rows_received();
  }
  if (malformed) {
    context_.TryCancel();
    ReleaseHold();  // no read follows this one
    return;
  }
  // Before the next read: the reactor cannot be done (and deleted) while a read is pending.
  if (progress > 0 && shared_->options.on_progress) {
    shared_->options.on_progress(progress, shared_->args.num_rows);
  }
  StartRead(&response_buffer_);
  Issue(next);
}

void BackwardCall::OnDone(const grpc::Status& status) {
  // A Backward is a pure function of its request and every attempt rewrites the same outputs,
  // so the whole stream is retried when the replica went away (UNAVAILABLE, also after partial
  // responses: the replica died mid-stream) or cancelled the call before answering anything
  // (CANCELLED: gRPC cancels calls that reach a server after its shutdown began). This client
  // never cancels a stream itself except for a malformed reply (error_ set): not retried; nor is
  // a stream its caller cancelled (BackwardOptions::cancellation).
  {
    std::lock_guard<std::mutex> lock(timer_target_->mu);  // waits for a timer's callback
    timer_target_->call = nullptr;
  }
  if (shared_->options.cancellation) shared_->options.cancellation->Detach();
  const bool cancelled_by_caller =
      shared_->options.cancellation && shared_->options.cancellation->cancelled();
  std::unique_lock<std::mutex> lock(mu_);
  // Is the caller's memory its own again? Yes when no chunk naming it was sent, or when the
  // server's own status says its jobs are done (an OK one always comes from the server after
  // the last chunk was computed). Not after a status that gRPC made up (a cut-off cancel, the
  // transport's deadline, a connection lost): the server may still be computing a chunk.
  bool writes_done = !exchange_.exposed() || status.ok();
  if (!writes_done) {
    const auto& trailers = context_.GetServerTrailingMetadata();
    writes_done = trailers.find(kWritesDoneTrailer) != trailers.end();
  }
  // In place, a chunk's dy is gone once the server may have computed it (memory calls: the
  // chunk was sent) or once the client wrote its grad_input (bytes): a retry would send dx as
  // dy and end OK with a wrong gradient.
  const bool dy_intact =
      !shared_->args.in_place || (!exchange_.exposed() && exchange_.rows_received() == 0);
  const bool retry_worthy =
      error_.ok() && !cancelled_by_caller && exchange_.cancel_status().ok() && writes_done &&
      (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
       (status.error_code() == grpc::StatusCode::CANCELLED && !any_response_));
  if (retry_worthy && dy_intact && RetryLater<BackwardCall>(client_, shared_, attempt_)) {
    lock.unlock();
    delete this;
    return;
  }
  absl::Status result = error_;
  if (result.ok()) result = FromGrpcStatus(status);
  if (retry_worthy && !dy_intact) {
    result = absl::Status(result.code(), absl::StrCat(result.message(),
                                                      " [not retried: the call is in place and "
                                                      "dy may already be overwritten by dx]"));
  }
  if (!result.ok() && !exchange_.cancel_status().ok()) result = exchange_.cancel_status();
  if (!result.ok() && !writes_done) {
    if (shared_->shm.has_value() && shared_->shm->staging != nullptr) {
      // The client's own copy: thrown away instead of reused (the server may still write it).
      shared_->shm->discard_staging->store(true);
    } else {
      result = absl::Status(
          result.code(),
          absl::StrCat(result.message(), " [the server did not confirm that it stopped writing "
                       "grad_input into this call's ",
                       shared_->args.device.has_value() ? "device buffers" : "shared-memory region",
                       ": it may still do so while it computes the chunk it had (docs/api.md, "
                       "\"The end of a call\")]"));
    }
  }
  if (result.ok()) result = exchange_.Complete();
  // The reactor (and its ClientContext, which holds a reference to the channel) is destroyed
  // before the caller hears about it: once `done` runs the caller may destroy the Client, and
  // the channel's last reference must not be dropped on a gRPC callback thread.
  std::shared_ptr<Shared> shared = std::move(shared_);
  const int attempts = attempt_;
  BackwardSummary summary = exchange_.summary();
  lock.unlock();
  delete this;
  // Handed on once gRPC gave back the caller's x, dy and rms (MemoryLoan): at once unless a
  // write of this call is still going out.
  DeliverBackward(std::move(shared), std::move(result), std::move(summary), attempts);
}

void UnaryBackwardCall::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (shared_->has_deadline) context_.set_deadline(shared_->deadline);
  client_->AddMetadata(context_);
  exchange_.StartWhole();
  request_ = v1::EncodeWithBulk(exchange_.message(), exchange_.bulk(), shared_->pin);
  if (shared_->options.cancellation) {
    shared_->options.cancellation->Attach([this] { context_.TryCancel(); });
  }
  client_->generic().PrepareUnaryCall(&context_, kBackwardUnaryMethod, grpc::StubOptions(),
                                      &request_, &response_, this);
  StartCall();
}

absl::Status UnaryBackwardCall::TakeResponse() {
  v1::BackwardResponse r;
  v1::ReceivedBytes grad_input;
  if (!v1::DecodeWithBulk(response_, &r,
                          {{v1::BackwardResponse::kGradInputFieldNumber, &grad_input}})) {
    return absl::InternalError(absl::StrCat("server sent a message of ", response_.Length(),
                                            " bytes that is not a BackwardResponse"));
  }
  // The answer holds every row and grad_gamma, or it is refused: rows of it may have reached the
  // caller's dx then, but the call fails.
  absl::Status s = exchange_.TakeAnswer(r, grad_input);
  if (s.ok()) s = exchange_.Complete();
  return s;
}

void UnaryBackwardCall::OnDone(const grpc::Status& status) {
  if (shared_->options.cancellation) shared_->options.cancellation->Detach();
  const bool cancelled_by_caller =
      shared_->options.cancellation && shared_->options.cancellation->cancelled();
  std::unique_lock<std::mutex> lock(mu_);
  if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED && !cancelled_by_caller) {
    // A server without the method: the stream, this time and from now on.
    client_->NoUnaryBackward();
    std::shared_ptr<Shared> shared = std::move(shared_);
    const int attempt = attempt_;
    CallHost* client = client_;
    lock.unlock();
    delete this;
    (new BackwardCall(client, std::move(shared), attempt))->Start();
    return;
  }
  const bool retry_worthy = !cancelled_by_caller &&
                            (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                             status.error_code() == grpc::StatusCode::CANCELLED);
  if (retry_worthy && RetryLater<UnaryBackwardCall>(client_, shared_, attempt_)) {
    lock.unlock();
    delete this;
    return;
  }
  absl::Status result = FromGrpcStatus(status);
  if (result.ok()) result = TakeResponse();
  if (result.ok() && shared_->options.on_progress) {
    shared_->options.on_progress(shared_->args.num_rows, shared_->args.num_rows);
  }
  // Context first, callback last (see BackwardCall::OnDone).
  std::shared_ptr<Shared> shared = std::move(shared_);
  const int attempts = attempt_;
  BackwardSummary summary = exchange_.summary();
  response_.Clear();
  lock.unlock();
  delete this;
  DeliverBackward(std::move(shared), std::move(result), std::move(summary), attempts);
}

}  // namespace

void StartBackwardCall(CallHost* host, std::shared_ptr<BackwardShared> shared) {
  const RawBackwardArgs& args = shared->args;
  const uint64_t x_bytes = args.num_rows * args.hidden_dim * ElementBytes(args.type);
  if (host->options().unary_small_batches && !shared->shm.has_value() &&
      !args.device.has_value() && x_bytes <= host->options().chunk_bytes &&
      host->unary_backward()) {
    (new UnaryBackwardCall(host, std::move(shared), 1))->Start();
    return;
  }
  (new BackwardCall(host, std::move(shared), 1))->Start();
}

}  // namespace normgrad::client_internal
