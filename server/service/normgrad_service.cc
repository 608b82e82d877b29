#include "server/service/normgrad_service.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "proto/normgrad/v1/bulk_wire.h"
#include "server/proto_conversion/proto_conversion.h"
#include "server/service/backward_pipeline.h"
#include "server/service/one_message_backward.h"
#include "server/service/status_conversion.h"
#include "server/service/accepted_peers.h"
#include "server/shared_memory/region_registry.h"

namespace normgrad::server {
namespace {

constexpr char kBackwardMethod[] = "RmsNormBackward";
constexpr char kBackwardUnaryMethod[] = "RmsNormBackwardUnary";
// RmsNormBackwardUnary computes a batch of at most this many x bytes on gRPC's thread (CPU
// backend): about 30 us of work at the CPU backend's speed on two cores.
constexpr uint64_t kInlineUnaryBytes = 256 * 1024;
constexpr char kEmitPtxMethod[] = "EmitPtx";
constexpr char kServerInfoMethod[] = "GetServerInfo";
// Jobs one worker task runs for a stream before it yields the worker (BackwardStream::Apply).
constexpr int kJobsPerTask = 3;

// Parses a message gRPC handed over as bytes (the raw API; it consumes `buffer`).
template <typename Message>
bool ParseMessage(grpc::ByteBuffer& buffer, Message* message) {
  return grpc::SerializationTraits<Message>::Deserialize(&buffer, message).ok();
}

template <typename Message>
void SerializeMessage(const Message& message, grpc::ByteBuffer* buffer) {
  buffer->Clear();  // gRPC's writer takes an empty buffer
  bool own_buffer;
  if (!grpc::SerializationTraits<Message>::Serialize(message, buffer, &own_buffer).ok()) {
    buffer->Clear();
  }
}

// A response on the wire, grad_input sent from the buffer the backend computed into (the
// slice keeps it).
grpc::ByteBuffer EncodeResponse(const Outgoing& out) {
  const v1::BulkField grad_input[] = {
      {v1::BackwardResponse::kGradInputFieldNumber, out.GradInput()}};
  return v1::EncodeWithBulk(out.response, grad_input, out.grad_input);
}

// x and dy as the backend takes them: in place in gRPC's slices when each arrived in one piece
// at an address aligned for any element (gRPC's slices are then held), else gathered into one
// buffer of the stream's: one copy, where a protobuf parse made one too.
BesideBytes BesideOf(v1::ReceivedBytes& x, v1::ReceivedBytes& dy) {
  constexpr uintptr_t kAlignment = 4;
  auto in_place = [](const v1::ReceivedBytes& r) {
    const absl::Span<const uint8_t> c = r.Contiguous();
    return r.size() == 0 ||
           (c.size() == r.size() && reinterpret_cast<uintptr_t>(c.data()) % kAlignment == 0);
  };
  BesideBytes out;
  if (in_place(x) && in_place(dy)) {
    auto held = std::make_shared<std::pair<v1::ReceivedBytes, v1::ReceivedBytes>>(std::move(x),
                                                                                  std::move(dy));
    out.x = held->first.Contiguous();
    out.dy = held->second.Contiguous();
    out.owner = std::move(held);
    return out;
  }
  std::shared_ptr<uint8_t> gathered(new uint8_t[x.size() + dy.size()],
                                    std::default_delete<uint8_t[]>());
  x.CopyTo(gathered.get());
  dy.CopyTo(gathered.get() + x.size());
  out.x = absl::MakeConstSpan(gathered.get(), x.size());
  out.dy = absl::MakeConstSpan(gathered.get() + x.size(), dy.size());
  out.owner = std::move(gathered);
  x.Clear();
  dy.Clear();
  return out;
}

// Parses a BackwardRequest gRPC handed over, x and dy left beside it. False: not a
// BackwardRequest.
bool ParseBackwardRequest(const grpc::ByteBuffer& buffer, v1::BackwardRequest* message,
                          BesideBytes* beside) {
  v1::ReceivedBytes x, dy;
  if (!v1::DecodeWithBulk(buffer, message,
                          {{v1::BackwardRequest::kXFieldNumber, &x},
                           {v1::BackwardRequest::kDyFieldNumber, &dy}})) {
    return false;
  }
  if (x.present() || dy.present()) *beside = BesideOf(x, dy);
  return true;
}

absl::Status UnparsableRequest(const grpc::ByteBuffer& request, const char* type) {
  return absl::InvalidArgumentError(absl::StrCat("the request (", request.Length(),
                                                 " bytes) does not parse as a normgrad.v1.", type));
}

// The caller's peer string as gRPC would name it had it accepted the connection itself: a TCP
// connection the server accepted (server/process/grpc_listener.h), which gRPC calls "fd:17", by
// its address ("ipv4:10.0.0.7:41234"); every other peer string as it is.
std::string PeerOf(const grpc::CallbackServerContext& context, const ServiceEnv& env) {
  std::string peer = context.peer();
  return env.accepted_peers != nullptr ? env.accepted_peers->Address(peer) : peer;
}

// Peer strings (PeerOf): "unix:...", "fd:17" (a unix-socket connection the server accepted
// itself), "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", ...
bool IsUnixPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "fd:");
}
bool PeerIsLocal(absl::string_view peer) {
  return IsUnixPeer(peer) || absl::StartsWith(peer, "ipv4:127.") ||
         absl::StartsWith(peer, "ipv6:[::1]") || absl::StartsWith(peer, "ipv6:%5B::1%5D");
}

// LoopbackPeerUid(peer), remembered for 10 s per peer address and port (a connection's): reading
// /proc/net/tcp walks the whole connection table, milliseconds on a large machine, too slow for
// every call. A port reused by another user's connection within the 10 s would inherit the uid:
// a share misattributed for that long, never a wrong result.
std::optional<uint32_t> CachedLoopbackPeerUid(absl::string_view peer) {
  struct Known {
    std::optional<uint32_t> uid;
    absl::Time until;
  };
  if (IsUnixPeer(peer) || !PeerIsLocal(peer)) return std::nullopt;  // not a loopback TCP peer
  static absl::Mutex mu(absl::kConstInit);
  static absl::flat_hash_map<std::string, Known>* known ABSL_GUARDED_BY(mu) =
      new absl::flat_hash_map<std::string, Known>();
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu);
    auto it = known->find(peer);
    if (it != known->end() && now < it->second.until) return it->second.uid;
  }
  const std::optional<uint32_t> uid = LoopbackPeerUid(peer);
  absl::MutexLock lock(&mu);
  if (known->size() >= 4096) known->clear();
  (*known)[std::string(peer)] = Known{uid, now + absl::Seconds(10)};
  return uid;
}

// Who the caller is, for its share of the stream slots: the verified client certificate's name
// under mutual TLS; on a unix socket the peer's user ("uid:1000", from the credentials read at
// accept); over TCP from a loopback address the user owning the client's socket
// ("loopback-uid:1000", LoopbackPeerUid); else the peer address without the port, an IPv6 one by
// its /64 (ClientIdentityFromPeer). The bearer token names no one: every client presents the
// same one.
std::string ClientIdentity(const grpc::CallbackServerContext& context, const ServiceEnv& env,
                           absl::string_view peer) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> names = auth->GetPeerIdentity();
    if (!names.empty()) {
      return absl::StrCat("x509:", absl::string_view(names.front().data(), names.front().size()));
    }
  }
  if (env.accepted_peers != nullptr) {
    if (std::optional<PeerCredentials> c = env.accepted_peers->Find(peer)) {
      return absl::StrCat("uid:", c->uid);
    }
    // A loopback TCP peer by its user too, not its address: a user can connect from any number
    // of 127.x addresses. (A share of its own beside the user's unix-socket share: bounded all
    // the same, two shares per local user at most.) Read at accept for the connections the
    // server accepted itself...
    if (std::optional<uint32_t> uid = env.accepted_peers->LoopbackUid(context.peer())) {
      return absl::StrCat("loopback-uid:", *uid);
    }
  }
  // ... and from /proc/net/tcp for those gRPC accepted (a TLS port), once per connection for a
  // while: the table takes milliseconds to read.
  if (std::optional<uint32_t> uid = CachedLoopbackPeerUid(peer)) {
    return absl::StrCat("loopback-uid:", *uid);
  }
  return ClientIdentityFromPeer(peer);
}

// PERMISSION_DENIED for a unix-socket peer whose user --unix-allowed-uids does not list (counted
// in normgrad_rejected_total{limit="unix-allowed-uids"}); OK for every other caller.
absl::Status CheckUnixPeer(const ServiceEnv& env, absl::string_view peer, const char* method) {
  const std::vector<uint32_t>& allowed = env.config.unix_allowed_uids;
  if (allowed.empty() || env.accepted_peers == nullptr) return absl::OkStatus();
  const std::optional<PeerCredentials> c = env.accepted_peers->Find(peer);
  if (!c.has_value()) return absl::OkStatus();  // not a unix-socket connection
  if (std::find(allowed.begin(), allowed.end(), c->uid) != allowed.end()) return absl::OkStatus();
  env.metrics->rejected.Increment({{"method", method}, {"limit", "unix-allowed-uids"}});
  return absl::PermissionDeniedError(absl::StrCat(
      "this unix-socket client runs as ", DescribePeer(*c),
      ", which --unix-allowed-uids does not list"));
}

// Why a new RmsNormBackward stream is refused before admission (a refused unix peer, a draining
// server, an unusable device), or OK.
absl::Status RefuseStream(const ServiceEnv& env, absl::string_view peer) {
  NORMGRAD_RETURN_IF_ERROR(CheckUnixPeer(env, peer, kBackwardMethod));
  if (env.draining.load()) {
    return absl::UnavailableError(
        "the server is shutting down and takes no new streams; retry elsewhere");
  }
  if (!env.device_health.healthy()) {
    return absl::UnavailableError(
        absl::StrCat("this server's GPU is unusable and it takes no streams (",
                     env.device_health.reason().message(), "); retry elsewhere"));
  }
  return absl::OkStatus();
}

// What GetServerInfo reports, from the configuration and the collaborators.
ServerInfo GatherServerInfo(const ServiceEnv& env) {
  ServerInfo info;
  info.version = env.config.version;
  info.backend = std::string(env.backend->Name());
  info.device = env.backend->Device();
  info.limits = {.max_streams = env.admission->limits().max_streams,
                 .max_inflight_bytes = env.admission->limits().max_inflight_bytes,
                 .max_streams_per_client = env.admission->streams_per_client(),
                 .max_hidden_dim = env.config.batch_limits.max_hidden_dim,
                 .max_num_rows = env.config.batch_limits.max_num_rows,
                 .max_message_bytes = env.config.max_message_bytes,
                 .stream_idle_timeout = env.config.stream_idle_timeout};
  info.cache = env.backend->CacheStats();
  info.ptx_cache = env.ptx->CacheStats();
  info.nvjitlink_available = env.ptx->has_nvjitlink();
  if (env.regions != nullptr) {
    const RegionLimits& r = env.regions->limits();
    info.shared_memory = ServerInfo::SharedMemory{
        .max_regions = r.max_regions,
        .max_region_bytes = r.max_bytes,
        .max_regions_per_user = r.max_regions_per_user,
        .max_region_bytes_per_user = r.max_bytes_per_user};
  }
  if (env.cuda_ipc) {
    info.cuda_ipc = ServerInfo::CudaIpc{.device_uuid = IpcDeviceUuid(*env.backend),
                                        .max_open_handles = env.max_cuda_ipc_handles};
  }
  info.kernels = KernelNames();
  info.serving = env.device_health.healthy() && !env.draining.load();
  info.health_reason = std::string(env.device_health.reason().message());
  return info;
}

// What a stream's pipeline uses of the service's environment.
StreamDeps StreamDepsOf(const ServiceEnv& env) {
  return {.backend = env.backend,
          .admission = env.admission,
          .metrics = env.metrics,
          .regions = env.regions,
          .cuda_ipc = env.cuda_ipc,
          .limits = env.config.batch_limits,
          .min_rate = {.bytes_per_second = env.config.min_stream_bytes_per_second,
                       .window = env.config.min_stream_rate_window}};
}

}  // namespace

// An admitted EmitPtx call: holds its slot of the EmitPtx queue (AdmitEmitPtx) until it is
// compiled, or until it is cancelled, whichever comes first. Deleted by gRPC's OnDone, after the
// worker's Finish.
class EmitPtxCall final : public grpc::ServerUnaryReactor {
 public:
  EmitPtxCall(ServiceEnv* env, std::string connection, uint64_t held_bytes)
      : env_(env), connection_(std::move(connection)), held_bytes_(held_bytes) {}
  void OnCancel() override {
    cancelled_.store(true);
    ReleaseSlot();
  }
  void OnDone() override { delete this; }
  bool cancelled() const { return cancelled_.load(); }
  void ReleaseSlot() {
    if (!released_.exchange(true)) env_->admission->ReleaseEmitPtx(connection_, held_bytes_);
  }

 private:
  ServiceEnv* const env_;
  const std::string connection_;
  const uint64_t held_bytes_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> released_{false};
};

// One RmsNormBackward stream: the gRPC shell around its BackwardPipeline. It hands the pipeline
// what gRPC reports and carries out the actions it returns, after the pipeline's lock is released
// (a StartRead/StartWrite/Finish may run reactions inline). Lifetime: reference counted; gRPC
// holds one reference until OnDone, each task on the worker pool and each watchdog visit holds
// one; the last Unref deletes.
class BackwardStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  BackwardStream(ServiceEnv* env, grpc::CallbackServerContext* context)
      : env_(env),
        context_(context),
        peer_(PeerOf(*context, *env)),
        listener_(IsUnixPeer(peer_) ? "unix" : "tcp"),
        pipeline_(StreamDepsOf(*env), absl::FromChrono(context->deadline()), PeerIsLocal(peer_),
                  ClientIdentity(*context, *env, peer_)) {
    env_->streams->Add(this);
    // Published to OnReadDone, whose first step is parsing the read buffer (below).
    { std::lock_guard<std::mutex> lock(read_mu_); }
    Apply(pipeline_.Start(RefuseStream(*env, peer_)));
  }

  // Every reaction's first access to this object takes a lock the constructor released (the
  // pipeline's, or read_mu_ for the read buffer): gRPC's own ordering between the constructor
  // and the reactions is invisible to ThreadSanitizer (docs/testing.md).
  void OnReadDone(bool ok) override {
    bool call_cancelled = false;
    BesideBytes beside;
    {
      std::lock_guard<std::mutex> lock(read_mu_);
      if (ok) {
        const uint64_t bytes = read_buffer_.Length();
        const bool parsed = ParseBackwardRequest(read_buffer_, read_into_.load(), &beside);
        read_buffer_.Clear();  // gRPC's slices stay only where `beside` holds them
        if (!parsed) {
          Apply(pipeline_.OnUnparsableMessage(bytes));
          return;
        }
      } else {
        call_cancelled = context_->IsCancelled();
        read_failed_uncancelled_ = !call_cancelled;
      }
    }
    Apply(pipeline_.OnReadDone(ok, call_cancelled, std::move(beside)));
  }
  void OnWriteDone(bool ok) override { Apply(pipeline_.OnWriteDone(ok)); }
  void OnCancel() override { Apply(pipeline_.OnCancel()); }

  void OnDone() override {
    StreamTotals t = pipeline_.OnDone();
    {
      // A read that failed while the call stood, and a call cancelled before our status got
      // through: gRPC refused the message itself (above --max-message-bytes) and told the client
      // RESOURCE_EXHAUSTED, not the "stream ended early" we decided. A client's cancel or
      // deadline fails the read with the call already cancelled, and a half-close leaves the
      // call standing, so neither is counted here. (gRPC does not say why it cancelled a call:
      // when its cancellation of an oversized message comes before the failed read, the call
      // is counted CANCELLED.)
      std::lock_guard<std::mutex> lock(read_mu_);
      if (read_failed_uncancelled_ && t.code == absl::StatusCode::kInvalidArgument &&
          context_->IsCancelled()) {
        t.code = absl::StatusCode::kResourceExhausted;
      }
    }
    {
      // After this, gRPC may free context_: a watchdog cancel must not touch it (Apply).
      std::lock_guard<std::recursive_mutex> lock(context_mu_);
      done_ = true;
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - pipeline_.start_time());
    const ServiceMetrics& metrics = *env_->metrics;
    metrics.rows.Increment({}, static_cast<double>(t.rows));
    const char* transport = t.payload_transport != nullptr ? t.payload_transport : listener_;
    metrics.transport_tensor_bytes.Increment({{"transport", transport}},
                                             static_cast<double>(t.tensor_bytes));
    metrics.transport_streams.Increment({{"transport", transport}});
    metrics.RecordRpc(kBackwardMethod, t.code, seconds, t.bytes_in, t.bytes_out);
    Unref();
  }

  void CheckIdle(absl::Time now, absl::Duration timeout) {
    Apply(pipeline_.CheckIdle(now, timeout));
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
  ~BackwardStream() override {
    pipeline_.Close();  // the backend session and reserved bytes go before the backend may
    // Last: once the registry is empty, a draining server may tear down what we used.
    env_->streams->Remove(this);
  }

  void Apply(StreamActions a) {
    if (a.read_into != nullptr) {
      read_into_.store(a.read_into);
      StartRead(&read_buffer_);
    }
    if (a.write_from != nullptr) {
      // One write in flight: gRPC is done with write_buffer_ before the next one is decided.
      // grad_input goes from the buffer the backend computed into, which the slice keeps.
      write_buffer_ = EncodeResponse(*a.write_from);
      StartWrite(&write_buffer_);
    }
    if (a.schedule) {
      refs_.fetch_add(1);
      env_->pool->Schedule([this] {
        // A few of the stream's jobs run on this task (session start, chunk, final grad_gamma
        // of a one-chunk call: no hops through the pool's queue); then it queues again behind
        // the other streams' tasks, so a busy stream cannot keep a worker.
        bool more = true;
        for (int jobs = 0; more && jobs < kJobsPerTask; ++jobs) {
          StreamActions next = pipeline_.RunOneJob();
          more = next.schedule;
          next.schedule = jobs + 1 == kJobsPerTask && more;
          Apply(std::move(next));
        }
        Unref();
      });
    }
    std::optional<absl::Status> finish = std::move(a.finish);
    if (a.issued() > 0) {
      if (std::optional<absl::Status> deferred = pipeline_.Issued(a.issued())) {
        finish = std::move(deferred);
      }
    }
    if (finish.has_value()) {
      // The pipeline hands out the finish only once no job of the stream runs, and none starts
      // after it: the trailer tells the client that its memory is its own again (docs/api.md,
      // "The end of a call"). A call that gRPC ends itself (a cancel, the deadline, a shutdown)
      // has no such trailer.
      context_->AddTrailingMetadata(kWritesDoneTrailer, "1");
      Finish(ToGrpcStatus(*finish));
    }
    if (a.try_cancel) {
      // The watchdog's thread holds a reference to this reactor, not to gRPC's call: OnDone may
      // have run (and gRPC freed context_) since the pipeline decided to cancel. OnDone takes
      // this lock too, so it cannot run between the check and TryCancel; recursive because
      // TryCancel may run reactions, OnDone included, inline on this thread.
      std::lock_guard<std::recursive_mutex> lock(context_mu_);
      if (!done_) context_->TryCancel();
    }
  }

  ServiceEnv* const env_;
  grpc::CallbackServerContext* const context_;
  const std::string peer_;      // PeerOf
  const char* const listener_;  // "unix" or "tcp": the transport label when no rows were in shm
  std::atomic<int> refs_{1};  // gRPC's, dropped in OnDone
  BackwardPipeline pipeline_;
  std::recursive_mutex context_mu_;
  bool done_ = false;  // OnDone ran; guarded by context_mu_
  std::mutex read_mu_;  // see OnReadDone
  grpc::ByteBuffer read_buffer_;   // owned by the read in flight; parsed under read_mu_
  bool read_failed_uncancelled_ = false;  // a read failed with the call standing; read_mu_
  std::atomic<v1::BackwardRequest*> read_into_{nullptr};  // where that read's message is parsed
  grpc::ByteBuffer write_buffer_;  // owned by the write in flight
};

void StreamRegistry::Add(BackwardStream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.insert(stream);
}

void StreamRegistry::Remove(BackwardStream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(stream);
  if (streams_.empty() && unary_calls_ == 0) emptied_.notify_all();
}

void StreamRegistry::AddUnary() {
  std::lock_guard<std::mutex> lock(mu_);
  ++unary_calls_;
}

void StreamRegistry::RemoveUnary() {
  std::lock_guard<std::mutex> lock(mu_);
  --unary_calls_;
  if (streams_.empty() && unary_calls_ == 0) emptied_.notify_all();
}

size_t StreamRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_.size() + unary_calls_;
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
                             [this] { return streams_.empty() && unary_calls_ == 0; });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NormGradService::RmsNormBackward(
    grpc::CallbackServerContext* context) {
  return new BackwardStream(env_, context);
}

grpc::ServerUnaryReactor* NormGradService::RmsNormBackwardUnary(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  ServiceEnv* env = env_;
  const std::string peer = PeerOf(*context, *env);
  const char* listener = IsUnixPeer(peer) ? "unix" : "tcp";
  // Counted before the checks, so that draining waits for a call it did not refuse.
  env->streams->AddUnary();
  auto request = std::make_shared<v1::BackwardRequest>();
  BesideBytes beside;
  absl::Status refused = RefuseStream(*env, peer);
  if (refused.ok() && !ParseBackwardRequest(*raw_request, request.get(), &beside)) {
    refused = UnparsableRequest(*raw_request, "BackwardRequest");
  }
  if (!refused.ok()) {
    env->metrics->RecordRpc(kBackwardUnaryMethod, refused.code(),
                            absl::ToDoubleSeconds(absl::Now() - start), raw_request->Length(), 0);
    reactor->Finish(ToGrpcStatus(refused));
    env->streams->RemoveUnary();
    return reactor;
  }
  const uint64_t row_bytes = beside.x.size() + request->x().size();
  auto run = [env, reactor, raw_response, start, listener, request,
              beside = std::move(beside), client = ClientIdentity(*context, *env, peer)]() mutable {
    OneMessageTotals totals;
    absl::StatusOr<std::unique_ptr<Outgoing>> out = RunOneMessageBackward(
        StreamDepsOf(*env), client, *request, std::move(beside), &totals);
    if (out.ok()) {
      *raw_response = EncodeResponse(**out);
    }
    const ServiceMetrics& metrics = *env->metrics;
    metrics.rows.Increment({}, static_cast<double>(totals.rows));
    metrics.transport_tensor_bytes.Increment({{"transport", listener}},
                                             static_cast<double>(totals.tensor_bytes));
    metrics.transport_streams.Increment({{"transport", listener}});
    metrics.RecordRpc(kBackwardUnaryMethod, out.status().code(),
                      absl::ToDoubleSeconds(absl::Now() - start), totals.bytes_in,
                      totals.bytes_out);
    reactor->Finish(ToGrpcStatus(out.status()));
    env->streams->RemoveUnary();
  };
  // Rows that compute in microseconds are computed here, on gRPC's thread: no hand-off. Larger
  // batches, and a batch whose kernel may still need compiling, go to the service's pool.
  if (row_bytes <= kInlineUnaryBytes && env->backend->Name() == "cpu") {
    run();
  } else {
    env->pool->Schedule(std::move(run));
  }
  return reactor;
}

grpc::ServerUnaryReactor* NormGradService::EmitPtx(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* raw_request,
                                                   grpc::ByteBuffer* raw_response) {
  // Refusals are answered here, by gRPC's default reactor; an admitted call has its own.
  auto finish_now = [context](const absl::Status& s) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  };
  const absl::Time start = absl::Now();
  ServiceEnv* env = env_;
  const std::string peer = PeerOf(*context, *env);
  absl::Status refused = CheckUnixPeer(*env, peer, kEmitPtxMethod);
  if (refused.ok() && env->draining.load()) {
    refused = absl::UnavailableError("the server is shutting down; retry elsewhere");
  }
  if (!refused.ok()) {
    env->metrics->RecordRpc(kEmitPtxMethod, refused.code(), 0, 0, 0);
    return finish_now(refused);
  }
  auto request = std::make_shared<v1::EmitPtxRequest>();
  grpc::ByteBuffer bytes(*raw_request);  // parsing consumes it
  if (!ParseMessage(bytes, request.get())) {
    absl::Status s = UnparsableRequest(*raw_request, "EmitPtxRequest");
    env->metrics->RecordRpc(kEmitPtxMethod, s.code(), absl::ToDoubleSeconds(absl::Now() - start),
              raw_request->Length(), 0);
    return finish_now(s);
  }
  // Admitted before it queues: the EmitPtx workers' queue is bounded in calls and request bytes,
  // per connection and in total (--max-emit-ptx-queue*).
  const uint64_t held_bytes = raw_request->Length();
  std::string connection = peer;
  if (absl::Status s = env->admission->AdmitEmitPtx(connection, held_bytes); !s.ok()) {
    env->metrics->RecordRpc(kEmitPtxMethod, s.code(), absl::ToDoubleSeconds(absl::Now() - start),
              held_bytes, 0);
    return finish_now(s);
  }
  // Emission and nvJitLink may take a while: never in a reaction, and on their own workers so
  // that chunks never wait behind a compile. A call cancelled meanwhile (its deadline, its
  // client, a drain) gives its queue slot back at once and is not compiled.
  auto* call = new EmitPtxCall(env, std::move(connection), held_bytes);
  ThreadPool* pool = env->emit_ptx_pool != nullptr ? env->emit_ptx_pool : env->pool;
  pool->Schedule([env, call, request, raw_response, start] {
    if (call->cancelled()) {
      env->metrics->RecordRpc(kEmitPtxMethod, absl::StatusCode::kCancelled,
                              absl::ToDoubleSeconds(absl::Now() - start),
                              request->ByteSizeLong(), 0);
      call->Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                                "the call was cancelled before its turn on the EmitPtx workers"));
      return;
    }
    absl::StatusOr<v1::EmitPtxResponse> r = env->ptx->Emit(*request);
    absl::Status status = r.status();
    uint64_t bytes_out = 0;
    if (r.ok()) {
      bytes_out = r->ByteSizeLong();
      SerializeMessage(*r, raw_response);
    }
    env->metrics->RecordRpc(kEmitPtxMethod, status.code(),
              absl::ToDoubleSeconds(absl::Now() - start), request->ByteSizeLong(), bytes_out);
    call->ReleaseSlot();
    call->Finish(ToGrpcStatus(status));
  });
  return call;
}

grpc::ServerUnaryReactor* NormGradService::GetServerInfo(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* raw_request,
                                                         grpc::ByteBuffer* raw_response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = CheckUnixPeer(*env_, PeerOf(*context, *env_), kServerInfoMethod);
      !s.ok()) {
    env_->metrics->RecordRpc(kServerInfoMethod, s.code(), 0, 0, 0);
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  v1::GetServerInfoRequest request;
  grpc::ByteBuffer bytes(*raw_request);
  if (!ParseMessage(bytes, &request)) {
    absl::Status s = UnparsableRequest(*raw_request, "GetServerInfoRequest");
    env_->metrics->RecordRpc(kServerInfoMethod, s.code(),
              absl::ToDoubleSeconds(absl::Now() - start), raw_request->Length(), 0);
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  v1::GetServerInfoResponse info;
  ToProto(GatherServerInfo(*env_), &info);
  SerializeMessage(info, raw_response);
  env_->metrics->RecordRpc(kServerInfoMethod, absl::StatusCode::kOk,
            absl::ToDoubleSeconds(absl::Now() - start), 0, info.ByteSizeLong());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace normgrad::server
