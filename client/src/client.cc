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
#include <functional>
#include <future>
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
#include "client/src/backward_call.h"
#include "client/src/channel_config.h"
#include "client/src/grpc_status.h"
#include "client/src/health_wire.h"
#include "client/src/raw_args.h"
#include "client/src/shared_memory_transport.h"
#include "normgrad/v1/normgrad.grpc.pb.h"

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
  UnaryAttempt(CallHost* client, std::shared_ptr<UnaryCall> call, int attempt)
      : client_(client), call_(std::move(call)), attempt_(attempt) {}
  void Start();
  void OnDone(const grpc::Status& status) override;

 private:
  std::mutex mu_;  // as BackwardCall's: Start and OnDone run on different threads
  CallHost* client_;
  std::shared_ptr<UnaryCall> call_;
  int attempt_;
  grpc::ClientContext context_;
};

class ClientImpl final : public Client, public CallHost {
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
    auto shared = std::make_shared<BackwardShared>();
    shared->args = args;
    shared->options = options;
    shared->shm = *std::move(plan);
    shared->done = std::move(done);
    SetDeadline(options.deadline, shared->has_deadline, shared->deadline);
    StartBackwardCall(this, std::move(shared));
  }

  void NoUnaryBackward() override { unary_backward_.store(false); }
  bool unary_backward() const override { return unary_backward_.load(); }

  // CallHost (backward_call.h).
  bool ScheduleRetry(int attempt, bool has_deadline, std::chrono::system_clock::time_point deadline,
                     std::function<void()> then) override {
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

  void AddMetadata(grpc::ClientContext& context) const override {
    if (!options_.bearer_token.empty()) {
      context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
    }
  }

  const ClientOptions& options() const override { return options_; }
  v1::NormGrad::Stub& stub() { return *stub_; }
  grpc::GenericStub& generic() override { return generic_; }

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
      RetryLater<UnaryAttempt>(client_, call_, attempt_)) {
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
