#include "normgrad/client.h"

#include <grpcpp/alarm.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/client_callback.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/src/backward_exchange.h"
#include "client/src/channel_config.h"
#include "client/src/chunking.h"
#include "client/src/grpc_status.h"
#include "client/src/health_wire.h"
#include "client/src/raw_args.h"
#include "client/src/shared_memory_transport.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "proto/normgrad/v1/bulk_wire.h"
#include "proto/normgrad/v1/metadata_keys.h"

namespace normgrad {

int ElementBytes(ElementType type) { return type == ElementType::kF32 ? 4 : 2; }

v1::DType ToProtoDType(ElementType type) {
  switch (type) {
    case ElementType::kF32:
      return v1::DTYPE_F32;
    case ElementType::kBF16:
      return v1::DTYPE_BF16;
    case ElementType::kF16:
      return v1::DTYPE_F16;
  }
  return v1::DTYPE_F32;
}

const char* HealthStatusName(HealthStatus status) {
  switch (status) {
    case HealthStatus::kUnknown:
      return "UNKNOWN";
    case HealthStatus::kServing:
      return "SERVING";
    case HealthStatus::kNotServing:
      return "NOT_SERVING";
    case HealthStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
  }
  return "UNKNOWN";
}

void CallCancellation::Cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  if (cancel_) cancel_();
}

bool CallCancellation::cancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_;
}

void CallCancellation::Attach(std::function<void()> cancel) {
  std::lock_guard<std::mutex> lock(mu_);
  cancel_ = std::move(cancel);
  if (cancelled_) cancel_();
}

void CallCancellation::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  cancel_ = nullptr;
}

std::future<absl::StatusOr<Gradients>> Client::BackwardFuture(absl::Span<const float> x,
                                                              absl::Span<const float> dy,
                                                              absl::Span<const float> gamma,
                                                              float eps,
                                                              const BackwardOptions& options) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<Gradients>>>();
  std::future<absl::StatusOr<Gradients>> future = promise->get_future();
  BackwardAsync(x, dy, gamma, eps, options, [promise](absl::StatusOr<Gradients> result) {
    promise->set_value(std::move(result));
  });
  return future;
}

namespace client_internal {
namespace {

absl::Span<const uint8_t> AsBytes(absl::Span<const float> s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size() * sizeof(float)};
}
absl::Span<uint8_t> AsBytes(absl::Span<float> s) {
  return {reinterpret_cast<uint8_t*>(s.data()), s.size() * sizeof(float)};
}

class ClientImpl;

constexpr char kBackwardMethod[] = "/normgrad.v1.NormGrad/RmsNormBackward";
constexpr char kBackwardUnaryMethod[] = "/normgrad.v1.NormGrad/RmsNormBackwardUnary";

// The caller's x, dy and rms, lent to gRPC: every slice of a request that points into them holds
// the loan's pin (proto/normgrad/v1/bulk_wire.h), and the call's result is handed to its caller
// only once gRPC has released them all, so the caller may reuse or free its arrays as soon as
// the call returns. gRPC releases a message's slices once it wrote them out, so a call that ended
// normally has them all back; a cancelled one may still be writing one when OnDone runs.
class MemoryLoan {
 public:
  // The pin the request slices hold; the loan is returned when the last copy goes.
  static std::shared_ptr<const void> Lend(const std::shared_ptr<MemoryLoan>& loan) {
    return std::shared_ptr<const void>(loan.get(), [loan](const void*) { loan->Returned(); });
  }

  // Runs `deliver` now when the memory is back, else when it comes back (on a thread of its own:
  // gRPC releases a slice deep inside its transport, where no caller's code may run).
  void DeliverWhenReturned(std::function<void()> deliver) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!returned_) {
        deliver_ = std::move(deliver);
        return;
      }
    }
    deliver();
  }

 private:
  void Returned() {
    std::function<void()> deliver;
    {
      std::lock_guard<std::mutex> lock(mu_);
      returned_ = true;
      deliver = std::move(deliver_);
    }
    if (deliver) std::thread(std::move(deliver)).detach();
  }

  std::mutex mu_;
  bool returned_ = false;          // guarded by mu_
  std::function<void()> deliver_;  // guarded by mu_
};

// One attempt of one RmsNormBackward stream. Writes the header, then each row chunk from
// OnWriteDone (one write in flight), reads grad_input chunks into args.dx as they come. Deletes
// itself in OnDone, after handing the result on (or starting the next attempt).
class BackwardCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  struct Shared {
    RawBackwardArgs args;
    // The request slices' pin on args.x, dy and rms (every attempt's), until the result is
    // handed on.
    std::shared_ptr<MemoryLoan> loan = std::make_shared<MemoryLoan>();
    std::shared_ptr<const void> pin = MemoryLoan::Lend(loan);
    BackwardOptions options;
    std::optional<ShmPlan> shm;  // set: the rows travel in a shared-memory region
    Client::RawBackwardCallback done;
    std::chrono::system_clock::time_point deadline;
    bool has_deadline = false;
  };

  BackwardCall(ClientImpl* client, std::shared_ptr<Shared> shared, int attempt);
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

  ClientImpl* client_;
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
  UnaryBackwardCall(ClientImpl* client, std::shared_ptr<Shared> shared, int attempt)
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
  ClientImpl* client_;
  std::shared_ptr<Shared> shared_;
  int attempt_;
  BackwardExchange exchange_;  // the whole batch in one message, and its one answer
  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

// Hands a call's result to its caller once gRPC gave back the caller's memory (MemoryLoan).
void DeliverBackward(std::shared_ptr<BackwardCall::Shared> shared, absl::Status result,
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

using v1::kWritesDoneTrailer;  // proto/normgrad/v1/metadata_keys.h

// One unary call (EmitPtx, GetServerInfo, Health) with the client's retries.
struct UnaryCall {
  // Ties the RPC to `context` and `reactor` (the reactor then starts it).
  using Prepare = std::function<void(grpc::ClientContext*, grpc::ClientUnaryReactor*)>;
  Prepare prepare;
  std::function<void(grpc::Status)> done;
  std::chrono::system_clock::time_point deadline;
  bool has_deadline = false;
};

// One attempt of a UnaryCall, on a fresh context. Deletes itself in OnDone, after handing the
// status on (or scheduling the next attempt when it was UNAVAILABLE).
class UnaryAttempt final : public grpc::ClientUnaryReactor {
 public:
  UnaryAttempt(ClientImpl* client, std::shared_ptr<UnaryCall> call, int attempt)
      : client_(client), call_(std::move(call)), attempt_(attempt) {}
  void Start();
  void OnDone(const grpc::Status& status) override;

 private:
  std::mutex mu_;  // as BackwardCall's: Start and OnDone run on different threads
  ClientImpl* client_;
  std::shared_ptr<UnaryCall> call_;
  int attempt_;
  grpc::ClientContext context_;
};

class ClientImpl final : public Client {
 public:
  ClientImpl(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
      : options_(std::move(options)),
        channel_(std::move(channel)),
        stub_(v1::NormGrad::NewStub(channel_)),
        generic_(channel_),
        shm_(options_.transport, RegionSocketPathFor(options_.target), [this] {
          absl::StatusOr<v1::GetServerInfoResponse> info =
              ServerInfo(CallOptions{.deadline = absl::Seconds(5)});
          if (!info.ok()) return absl::StatusOr<bool>(info.status());
          return absl::StatusOr<bool>(info->shared_memory().enabled());
        }, options_.region_reply_timeout) {}

  absl::Status RegisterSharedMemory(const SharedMemoryRegion& region) override {
    return shm_.Register(region);
  }
  absl::Status UnregisterSharedMemory(const SharedMemoryRegion& region) override {
    return shm_.Unregister(region);
  }

  absl::StatusOr<Gradients> Backward(absl::Span<const float> x, absl::Span<const float> dy,
                                     absl::Span<const float> gamma, float eps,
                                     const BackwardOptions& options) override {
    return BackwardFuture(x, dy, gamma, eps, options).get();
  }

  void BackwardAsync(absl::Span<const float> x, absl::Span<const float> dy,
                     absl::Span<const float> gamma, float eps, const BackwardOptions& options,
                     BackwardCallback done) override {
    if (gamma.empty()) {
      done(absl::InvalidArgumentError("gamma: empty (hidden_dim must be > 0)"));
      return;
    }
    if (x.size() % gamma.size() != 0) {
      done(absl::InvalidArgumentError(absl::StrCat("x: ", x.size(),
                                                   " elements is not a multiple of hidden_dim ",
                                                   gamma.size(), " (gamma's size)")));
      return;
    }
    auto result = std::make_shared<Gradients>();
    RawBackwardArgs args;
    args.type = ElementType::kF32;
    args.hidden_dim = static_cast<uint32_t>(gamma.size());
    args.num_rows = x.size() / gamma.size();
    args.eps = eps;
    args.x = AsBytes(x);
    args.dy = AsBytes(dy);
    args.gamma = AsBytes(gamma);
    args.rms = AsBytes(options.rms);
    args.gamma_offset = options.gamma_offset;
    absl::Span<float> dx = options.dx;
    absl::Span<float> dgamma = options.dgamma;
    if (dx.data() == nullptr && x.size() == dy.size()) {
      result->dx.resize(x.size());
      dx = absl::MakeSpan(result->dx);
    }
    if (dgamma.data() == nullptr) {
      result->dgamma.resize(gamma.size());
      dgamma = absl::MakeSpan(result->dgamma);
    }
    args.dx = AsBytes(dx);
    args.dgamma = AsBytes(dgamma);
    BackwardRawAsync(args, options,
                     [result, done = std::move(done)](absl::StatusOr<RawBackwardResult> raw) {
                       if (!raw.ok()) {
                         done(raw.status());
                         return;
                       }
                       result->summary = std::move(raw->summary);
                       result->attempts = raw->attempts;
                       done(std::move(*result));
                     });
  }

  absl::StatusOr<RawBackwardResult> BackwardRaw(const RawBackwardArgs& args,
                                                const BackwardOptions& options) override {
    std::promise<absl::StatusOr<RawBackwardResult>> promise;
    std::future<absl::StatusOr<RawBackwardResult>> future = promise.get_future();
    BackwardRawAsync(args, options, [&promise](absl::StatusOr<RawBackwardResult> r) {
      promise.set_value(std::move(r));
    });
    return future.get();
  }

  void BackwardRawAsync(const RawBackwardArgs& args, const BackwardOptions& options,
                        RawBackwardCallback done) override {
    if (absl::Status s = ValidateRaw(args); !s.ok()) {
      done(s);
      return;
    }
    absl::StatusOr<std::optional<ShmPlan>> plan =
        args.device.has_value() ? std::optional<ShmPlan>() : shm_.Plan(args);
    if (!plan.ok()) {
      done(plan.status());
      return;
    }
    auto shared = std::make_shared<BackwardCall::Shared>();
    shared->args = args;
    shared->options = options;
    shared->shm = *std::move(plan);
    shared->done = std::move(done);
    SetDeadline(options.deadline, shared->has_deadline, shared->deadline);
    const uint64_t x_bytes = args.num_rows * args.hidden_dim * ElementBytes(args.type);
    if (options_.unary_small_batches && !shared->shm.has_value() && !args.device.has_value() &&
        x_bytes <= options_.chunk_bytes && unary_backward_.load()) {
      (new UnaryBackwardCall(this, std::move(shared), 1))->Start();
      return;
    }
    (new BackwardCall(this, std::move(shared), 1))->Start();
  }

  // The server said it has no RmsNormBackwardUnary: from here on this client uses the stream.
  void NoUnaryBackward() { unary_backward_.store(false); }

  // Schedules `then` (attempt `attempt`, >= 2) on a gRPC thread after a backoff:
  // initial_backoff doubling per attempt up to max_backoff, jittered by +-20%. Returns false,
  // scheduling nothing, when the backoff would end at or past the call's deadline: the caller
  // then reports the last failure at once instead of a DEADLINE_EXCEEDED later.
  bool ScheduleRetry(int attempt, bool has_deadline, std::chrono::system_clock::time_point deadline,
                     std::function<void()> then) {
    absl::Duration backoff = options_.initial_backoff;
    for (int i = 2; i < attempt; ++i) backoff *= 2;
    backoff = std::min(backoff, options_.max_backoff);
    {
      std::lock_guard<std::mutex> lock(rng_mu_);
      backoff *= std::uniform_real_distribution<double>(0.8, 1.2)(rng_);
    }
    const absl::Time at = absl::Now() + backoff;
    if (has_deadline && at >= absl::FromChrono(deadline)) return false;
    // gRPC 1.51's alarm holds its own reference while the callback runs, so the callback may
    // delete the grpc::Alarm it belongs to.
    auto* alarm = new grpc::Alarm;
    alarm->Set(absl::ToChronoTime(at), [alarm, then = std::move(then)](bool) {
      then();
      delete alarm;
    });
    return true;
  }

  // After attempt `attempt` of a call failed in a way worth retrying: schedules attempt
  // `attempt + 1` (a new Attempt, BackwardCall or UnaryAttempt, on the call's `state`) when
  // attempts and time are left, and says whether it did.
  template <typename Attempt, typename State>
  bool RetryLater(const std::shared_ptr<State>& state, int attempt) {
    if (attempt >= options_.max_attempts) return false;
    const int next = attempt + 1;
    return ScheduleRetry(next, state->has_deadline, state->deadline,
                         [this, state, next] { (new Attempt(this, state, next))->Start(); });
  }

  // The absolute deadline of a call that starts now; has_deadline false for none.
  void SetDeadline(absl::Duration per_call, bool& has_deadline,
                   std::chrono::system_clock::time_point& deadline) const {
    const absl::Duration d = DeadlineFor(per_call);
    has_deadline = d != absl::InfiniteDuration();
    if (has_deadline) deadline = absl::ToChronoTime(absl::Now() + d);
  }

  // Starts a unary call with the client's retries; `done` gets the last attempt's status.
  void UnaryWithRetries(absl::Duration per_call, UnaryCall::Prepare prepare,
                        std::function<void(grpc::Status)> done) {
    auto call = std::make_shared<UnaryCall>();
    call->prepare = std::move(prepare);
    call->done = std::move(done);
    SetDeadline(per_call, call->has_deadline, call->deadline);
    (new UnaryAttempt(this, std::move(call), 1))->Start();
  }

  grpc::Status UnaryWithRetriesSync(absl::Duration per_call, UnaryCall::Prepare prepare) {
    std::promise<grpc::Status> promise;
    std::future<grpc::Status> future = promise.get_future();
    UnaryWithRetries(per_call, std::move(prepare),
                     [&promise](grpc::Status s) { promise.set_value(std::move(s)); });
    return future.get();
  }

  absl::StatusOr<v1::EmitPtxResponse> EmitPtx(const v1::EmitPtxRequest& request,
                                              const CallOptions& options) override {
    std::promise<absl::StatusOr<v1::EmitPtxResponse>> promise;
    auto future = promise.get_future();
    EmitPtxAsync(request, options, [&promise](absl::StatusOr<v1::EmitPtxResponse> r) {
      promise.set_value(std::move(r));
    });
    return future.get();
  }

  void EmitPtxAsync(const v1::EmitPtxRequest& request, const CallOptions& options,
                    EmitPtxCallback done) override {
    struct Exchange {
      v1::EmitPtxRequest request;
      v1::EmitPtxResponse response;
    };
    auto exchange = std::make_shared<Exchange>();
    exchange->request = request;
    UnaryWithRetries(
        options.deadline,
        [this, exchange](grpc::ClientContext* context, grpc::ClientUnaryReactor* reactor) {
          stub_->async()->EmitPtx(context, &exchange->request, &exchange->response, reactor);
        },
        [exchange, done = std::move(done)](grpc::Status status) {
          if (!status.ok()) {
            done(FromGrpcStatus(status));
          } else {
            done(std::move(exchange->response));
          }
        });
  }

  absl::StatusOr<v1::GetServerInfoResponse> ServerInfo(const CallOptions& options) override {
    const v1::GetServerInfoRequest request;
    v1::GetServerInfoResponse response;
    const grpc::Status status = UnaryWithRetriesSync(
        options.deadline, [&](grpc::ClientContext* context, grpc::ClientUnaryReactor* reactor) {
          stub_->async()->GetServerInfo(context, &request, &response, reactor);
        });
    if (!status.ok()) return FromGrpcStatus(status);
    return response;
  }

  absl::StatusOr<HealthStatus> Health(const std::string& service,
                                      const CallOptions& options) override {
    const std::string encoded = EncodeHealthCheckRequest(service);
    grpc::Slice slice(encoded);
    const grpc::ByteBuffer request(&slice, 1);  // each attempt sends a copy
    grpc::ByteBuffer response;
    const grpc::Status status = UnaryWithRetriesSync(
        options.deadline, [&](grpc::ClientContext* context, grpc::ClientUnaryReactor* reactor) {
          generic_.PrepareUnaryCall(context, kHealthCheckMethod, grpc::StubOptions(), &request,
                                    &response, reactor);
        });
    if (!status.ok()) return FromGrpcStatus(status);
    std::vector<grpc::Slice> slices;
    if (!response.Dump(&slices).ok()) return absl::InternalError("health reply: unreadable");
    std::string bytes;
    for (const grpc::Slice& s : slices)
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    absl::StatusOr<int> decoded = DecodeHealthCheckResponse(bytes);
    if (!decoded.ok()) return decoded.status();
    if (*decoded < 0 || *decoded > 3) return HealthStatus::kUnknown;
    return static_cast<HealthStatus>(*decoded);
  }

  absl::Duration DeadlineFor(absl::Duration per_call) const {
    return per_call == absl::ZeroDuration() ? options_.default_deadline : per_call;
  }

  void AddMetadata(grpc::ClientContext& context) const {
    if (!options_.bearer_token.empty()) {
      context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
    }
  }

  const ClientOptions& options() const { return options_; }
  v1::NormGrad::Stub& stub() { return *stub_; }
  grpc::GenericStub& generic() { return generic_; }

 private:
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::NormGrad::Stub> stub_;
  grpc::GenericStub generic_;
  std::atomic<bool> unary_backward_{true};  // until a server answers it UNIMPLEMENTED
  SharedMemoryTransport shm_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_{std::random_device{}()};  // guarded by rng_mu_
};

void UnaryAttempt::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (call_->has_deadline) context_.set_deadline(call_->deadline);
    client_->AddMetadata(context_);
    call_->prepare(&context_, this);
  }
  StartCall();
}

void UnaryAttempt::OnDone(const grpc::Status& status) {
  std::unique_lock<std::mutex> lock(mu_);
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE &&
      client_->RetryLater<UnaryAttempt>(call_, attempt_)) {
    lock.unlock();
    delete this;
    return;
  }
  // Context first, callback last (see BackwardCall::OnDone).
  std::shared_ptr<UnaryCall> call = std::move(call_);
  grpc::Status result = status;
  lock.unlock();
  delete this;
  call->done(std::move(result));
}

BackwardCall::BackwardCall(ClientImpl* client, std::shared_ptr<Shared> shared, int attempt)
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
  if (retry_worthy && dy_intact && client_->RetryLater<BackwardCall>(shared_, attempt_)) {
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
    ClientImpl* client = client_;
    lock.unlock();
    delete this;
    (new BackwardCall(client, std::move(shared), attempt))->Start();
    return;
  }
  const bool retry_worthy = !cancelled_by_caller &&
                            (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                             status.error_code() == grpc::StatusCode::CANCELLED);
  if (retry_worthy && client_->RetryLater<UnaryBackwardCall>(shared_, attempt_)) {
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
}  // namespace client_internal

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  using client_internal::ResolveTarget;
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_attempts: must be >= 1, got ", options.max_attempts));
  }
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes: must be > 0");
  if (options.writes_done_grace <= absl::ZeroDuration() ||
      options.region_reply_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "writes_done_grace and region_reply_timeout: must be > 0, got ",
        absl::FormatDuration(options.writes_done_grace), " and ",
        absl::FormatDuration(options.region_reply_timeout)));
  }
  if (options.max_attempts > 1 && (options.initial_backoff < absl::Milliseconds(1) ||
                                   options.max_backoff < options.initial_backoff)) {
    // gRPC rejects a service config whose retry backoff is not positive.
    return absl::InvalidArgumentError(
        absl::StrCat("initial_backoff: must be >= 1ms and <= max_backoff, got ",
                     absl::FormatDuration(options.initial_backoff), " and ",
                     absl::FormatDuration(options.max_backoff)));
  }
  absl::StatusOr<client_internal::ResolvedTarget> target = ResolveTarget(options.target);
  if (!target.ok()) return target.status();
  // Without TLS the token is readable by anyone on the path: only to this host.
  if (!options.bearer_token.empty() && !options.use_tls &&
      !client_internal::IsLoopbackOrUnixTarget(options.target)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bearer_token: refusing to send it in clear text to \"", options.target,
        "\"; set use_tls (with tls.root_certs_pem for a private CA), or target a loopback "
        "address (localhost, 127.0.0.0/8, [::1]) or a unix: socket"));
  }

  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(client_internal::ServiceConfigJson(*target));
  // Every retry is the client's own (UnaryWithRetries, BackwardCall::OnDone), so gRPC's retry
  // layer is off, transparent retries included. With it on, gRPC 1.51 could transparently
  // replay a Backward stream that met a dying connection on another replica after it had
  // already failed the stream's first write to us: the header reached the new replica, the
  // client (told the write failed) sent nothing more, and the call hung until the server's
  // idle timeout (docs/client.md).
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes != -1
                                     ? options.max_receive_message_bytes
                                     : ClientOptions::kDefaultMaxReceiveBytes);
  if (options.max_send_message_bytes != -1)
    args.SetMaxSendMessageSize(options.max_send_message_bytes);
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);

  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.use_tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls.root_certs_pem;
    ssl.pem_cert_chain = options.tls.client_cert_pem;
    ssl.pem_private_key = options.tls.client_key_pem;
    if (ssl.pem_cert_chain.empty() != ssl.pem_private_key.empty()) {
      return absl::InvalidArgumentError(
          "tls: client_cert_pem and client_key_pem must be given together");
    }
    if (!options.tls.server_name_override.empty()) {
      args.SetSslTargetNameOverride(options.tls.server_name_override);
    }
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(target->uri, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("target: cannot create a channel to \"", options.target, "\""));
  }
  return std::unique_ptr<Client>(new client_internal::ClientImpl(options, std::move(channel)));
}

}  // namespace normgrad
