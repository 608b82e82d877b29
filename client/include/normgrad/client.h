// normgrad::Client: the C++ client of the normgrad.v1.NormGrad service.
//
// One Client owns one gRPC channel (thread-safe; share it between threads). Destroy a Client
// only after the callbacks of all its asynchronous calls have run. Backward streams a
// batch of any size to the server in row chunks that stay under the message limit, and writes
// grad_input chunk by chunk into the caller's buffer (or a vector it allocates).
//
//   absl::StatusOr<std::unique_ptr<normgrad::Client>> client =
//       normgrad::Client::Create({.target = "localhost:50051"});
//   if (!client.ok()) return client.status();
//   absl::StatusOr<normgrad::Gradients> g = (*client)->Backward(x, dy, gamma, /*eps=*/1e-5f);
//   if (!g.ok()) return g.status();   // the server's gRPC code and message, untouched
//   use(g->dx, g->dgamma);
//
// Errors: every call returns absl::Status whose code is the gRPC status code and whose message is
// the server's message, unchanged. Client-side validation failures are INVALID_ARGUMENT naming
// the argument and the numbers; a malformed server reply is INTERNAL.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "normgrad/shared_memory.h"
#include "normgrad/v1/normgrad.pb.h"

namespace normgrad {

// Element type of x, dy, gamma and the outputs on the wire. Rms is always f32.
enum class ElementType { kF32, kBF16, kF16 };
int ElementBytes(ElementType type);
v1::DType ToProtoDType(ElementType type);  // the type as BackwardHeader.dtype names it

struct TlsOptions {
  std::string root_certs_pem;   // PEM contents; empty: the system's roots
  std::string client_cert_pem;  // both set: mutual TLS
  std::string client_key_pem;
  std::string server_name_override;  // checked against the certificate instead of the host
};

// How Backward moves tensors (docs/api.md, "Shared memory").
enum class Transport {
  // Shared memory when the tensors lie in a region registered with RegisterSharedMemory (no
  // copy), or when the target is the server's unix socket and the server offers it (through a
  // staging region: one copy of x, dy and rms in, of dx out); bytes over gRPC otherwise.
  kAuto,
  kBytes,         // always bytes over gRPC
  kSharedMemory,  // always shared memory; FAILED_PRECONDITION when the server cannot take it
};

struct ClientOptions {
  // One address ("host:port"), a comma-separated list of IP addresses ("10.0.0.1:50051,
  // 10.0.0.2:50051", balanced round-robin; "localhost" is read as 127.0.0.1), or any gRPC
  // target URI ("dns:///svc.ns:50051", "ipv4:...", "unix:/path"). A "dns:" target with several
  // A records is balanced round-robin too.
  std::string target = "localhost:50051";
  bool use_tls = false;
  TlsOptions tls;
  // Sent as "authorization: Bearer <token>" metadata on every call when not empty.
  std::string bearer_token;
  // Deadline of a call that does not set its own; absl::InfiniteDuration() for none.
  absl::Duration default_deadline = absl::Seconds(60);
  // Attempts (first one included) for a call that fails with UNAVAILABLE; the client retries
  // itself (gRPC's retry layer is off), with a jittered exponential backoff, and never past the
  // call's deadline. Backward retries the whole stream: on UNAVAILABLE, even after partial
  // responses (the outputs are rewritten; on_progress then counts again from 0), and on a
  // CANCELLED that came before any response (a replica shutting down). 1 disables retries.
  int max_attempts = 3;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(1);
  // Channel message limits. Receive: -1 is kDefaultMaxReceiveBytes (16 MiB), room for the
  // largest answer the server sends (an EmitPtx batch of 32 configurations with cubins, about
  // 6 MB) where gRPC's own default (4 MiB) is not; send: -1 is gRPC's default (unlimited).
  static constexpr int kDefaultMaxReceiveBytes = 16 << 20;
  int max_receive_message_bytes = -1;
  int max_send_message_bytes = -1;
  // Bytes of x per request message (x and dy together are twice this); always whole rows, at
  // least one. The default keeps a message near 2 MiB, well under the 4 MiB default limit.
  uint64_t chunk_bytes = uint64_t{1} << 20;
  // A batch whose x fits one chunk (and whose rows travel in messages) is one
  // RmsNormBackwardUnary call: one request, one response. False: always the stream. A server
  // without the method (UNIMPLEMENTED) gets the stream.
  bool unary_small_batches = true;
  // True: this channel opens its own connections instead of sharing them with other channels
  // to the same target in this process (what a load generator's "connections" needs).
  bool own_connection = false;
  Transport transport = Transport::kAuto;
  // Rows of x per shared-memory chunk (no message limit applies; smaller chunks let the
  // server's compute and the responses overlap).
  uint64_t shm_chunk_bytes = uint64_t{64} << 20;
  // A call whose tensors the server reads and writes in place (shared memory, CUDA IPC) is
  // cancelled in order (docs/api.md, "The end of a call"): on a cancel or at its deadline the
  // client asks the server to stop and waits, up to this long, for the server's word that it no
  // longer touches the call's memory. Past it the call is cut off and its memory is in doubt: a
  // staging region is thrown away, and the status says so for the caller's own memory.
  absl::Duration writes_done_grace = absl::Seconds(30);
  // How long a registration on the server's region socket may take before it is abandoned.
  absl::Duration region_reply_timeout = absl::Seconds(10);
};

// Cancels a Backward call from another thread (what a Python client's Ctrl-C does): give it to
// the call in BackwardOptions::cancellation, then Cancel(). The call then ends CANCELLED and is
// not retried; a call given one that is already cancelled ends CANCELLED without sending rows.
// One call at a time; thread-safe.
class CallCancellation {
 public:
  void Cancel();
  bool cancelled() const;
  // For the client's call: `cancel` runs on Cancel() (at once when already cancelled) until
  // Detach(). Cancel() runs it under this object's lock, so Detach() waits for it to finish.
  void Attach(std::function<void()> cancel);
  void Detach();

 private:
  mutable std::mutex mu_;
  bool cancelled_ = false;        // guarded by mu_
  std::function<void()> cancel_;  // guarded by mu_
};

// Per-call options of Backward.
struct BackwardOptions {
  absl::Duration deadline = absl::ZeroDuration();  // zero: ClientOptions::default_deadline
  std::string kernel;                              // empty: the server picks
  // Per-row rms from the forward pass (num_rows values); empty: the server recomputes it.
  absl::Span<const float> rms;
  // Caller-owned outputs. When set they must hold num_rows * hidden_dim (dx) and hidden_dim
  // (dgamma) elements; the result vectors are then left empty.
  absl::Span<float> dx;
  absl::Span<float> dgamma;
  // Called after each grad_input chunk arrives, on a gRPC thread; must not block.
  std::function<void(uint64_t rows_done, uint64_t num_rows)> on_progress;
  // Set: CallCancellation::Cancel() cancels this call (CANCELLED, no retry).
  std::shared_ptr<CallCancellation> cancellation;
  // The float calls only: the scale is gamma_offset + gamma (RawBackwardArgs::gamma_offset; for
  // f32 the casting modes are all the same math).
  float gamma_offset = 0.0f;
};

// What the server reports about a finished Backward (normgrad.v1.BackwardSummary).
struct BackwardSummary {
  std::string backend;
  std::string kernel;
  uint64_t rows = 0;
  uint64_t chunks = 0;
  double compute_seconds = 0;
  double total_seconds = 0;
};

struct Gradients {
  std::vector<float> dx;      // empty when BackwardOptions::dx was given
  std::vector<float> dgamma;  // empty when BackwardOptions::dgamma was given
  BackwardSummary summary;
  int attempts = 1;  // streams started (more than one after UNAVAILABLE retries)
};

// A tensor in CUDA device memory, for CUDA IPC (docs/api.md, "CUDA IPC"): the 64-byte handle
// cuIpcGetMemHandle returned for its allocation, and its byte offset from the allocation's base.
// ExportCudaBuffer (normgrad/cuda_ipc.h) makes one from a device pointer.
struct CudaIpcBuffer {
  std::string handle;
  uint64_t offset = 0;
};

// The tensors of a Backward call that live on the server's GPU, in another process's device
// memory (this one's): the server runs the kernels on them in place, with no host copy.
struct CudaIpcTensors {
  std::string device_uuid;  // 16 bytes: cuDeviceGetUuid of their GPU (CudaDeviceUuid)
  CudaIpcBuffer x, dy, dx;  // num_rows * hidden_dim elements each
  std::optional<CudaIpcBuffer> rms;  // num_rows f32 values, or none (the server recomputes)
};

// The byte-level form of a Backward call, for any element type. Spans are caller-owned and must
// outlive the call (for the async forms: until the callback has run).
struct RawBackwardArgs {
  ElementType type = ElementType::kF32;
  uint64_t num_rows = 0;
  uint32_t hidden_dim = 0;
  float eps = 1e-5f;
  absl::Span<const uint8_t> x;      // num_rows * hidden_dim elements, little-endian, row-major
  absl::Span<const uint8_t> dy;     // same size as x
  absl::Span<const uint8_t> gamma;  // hidden_dim elements
  absl::Span<const uint8_t> rms;    // num_rows f32 values, or empty
  absl::Span<uint8_t> dx;           // num_rows * hidden_dim elements (required)
  absl::Span<uint8_t> dgamma;       // hidden_dim elements (required)
  // Set: x, dy, rms and dx are these device buffers (the spans above stay empty; gamma and
  // dgamma are host memory still). Needs a server started with --cuda-ipc on this machine.
  std::optional<CudaIpcTensors> device;
  // Which RMSNorm (docs/kernels.md, "Variants"): the scale is gamma_offset + gamma in float32;
  // no_gamma: a scale of 1, gamma and dgamma empty, no grad_gamma; the forward's casting mode.
  float gamma_offset = 0.0f;
  bool no_gamma = false;
  v1::CastingMode casting_mode = v1::CASTING_MODE_UNSPECIFIED;
  // dx is written over dy: dx must be exactly dy's span (device form: the same handle and
  // offset). Over shared memory the server writes each chunk's dx over its dy; over bytes the
  // client does as the chunk's grad_input arrives. Otherwise dx may not overlap x or dy. An
  // in-place call is never retried once a chunk may have been computed: dy is gone by then.
  bool in_place = false;
};

struct RawBackwardResult {
  BackwardSummary summary;
  int attempts = 1;
};

// Per-call options of the unary calls.
struct CallOptions {
  absl::Duration deadline = absl::ZeroDuration();  // zero: ClientOptions::default_deadline
};

enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
const char* HealthStatusName(HealthStatus status);  // "SERVING", ...

class Client {
 public:
  using BackwardCallback = std::function<void(absl::StatusOr<Gradients>)>;
  using RawBackwardCallback = std::function<void(absl::StatusOr<RawBackwardResult>)>;
  using EmitPtxCallback = std::function<void(absl::StatusOr<v1::EmitPtxResponse>)>;

  // Fails with INVALID_ARGUMENT for an unusable target or options. Does not connect yet.
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);
  virtual ~Client() = default;

  // dx and dgamma of RMSNorm for x and dy of num_rows = x.size() / gamma.size() rows of
  // hidden_dim = gamma.size() elements. Blocks; do not call it from a callback of this class.
  virtual absl::StatusOr<Gradients> Backward(absl::Span<const float> x, absl::Span<const float> dy,
                                             absl::Span<const float> gamma, float eps,
                                             const BackwardOptions& options = {}) = 0;

  // Asynchronous Backward: returns at once; `done` runs exactly once on a gRPC thread (or on
  // this thread for arguments rejected before any RPC). x, dy, gamma and the option spans must
  // stay alive until then. Many calls may be in flight on one Client.
  virtual void BackwardAsync(absl::Span<const float> x, absl::Span<const float> dy,
                             absl::Span<const float> gamma, float eps,
                             const BackwardOptions& options, BackwardCallback done) = 0;
  std::future<absl::StatusOr<Gradients>> BackwardFuture(absl::Span<const float> x,
                                                        absl::Span<const float> dy,
                                                        absl::Span<const float> gamma, float eps,
                                                        const BackwardOptions& options = {});

  // The general form behind the float calls (bf16/f16 ready). Blocking and asynchronous.
  virtual absl::StatusOr<RawBackwardResult> BackwardRaw(const RawBackwardArgs& args,
                                                        const BackwardOptions& options) = 0;
  virtual void BackwardRawAsync(const RawBackwardArgs& args, const BackwardOptions& options,
                                RawBackwardCallback done) = 0;

  virtual absl::StatusOr<v1::EmitPtxResponse> EmitPtx(const v1::EmitPtxRequest& request,
                                                      const CallOptions& options = {}) = 0;
  virtual void EmitPtxAsync(const v1::EmitPtxRequest& request, const CallOptions& options,
                            EmitPtxCallback done) = 0;
  virtual absl::StatusOr<v1::GetServerInfoResponse> ServerInfo(const CallOptions& options = {}) = 0;
  // Registers `region` with the server (on its region socket, "<unix socket path>.shm"), so
  // that Backward calls whose x, dy, dx (and rms) lie in it go by shared memory with no copy.
  // The region must outlive this Client; the server releases it when the Client goes.
  // FAILED_PRECONDITION when the target is not a unix socket or the server takes no shared
  // memory; the server's limits are RESOURCE_EXHAUSTED.
  virtual absl::Status RegisterSharedMemory(const SharedMemoryRegion& region) = 0;
  // Releases a region registered here: later calls no longer use it, and a call still using it
  // ends with NOT_FOUND at its next chunk (the server's status, which comes only once no job of
  // that call touches the region). NOT_FOUND when `region` is not registered with this Client.
  virtual absl::Status UnregisterSharedMemory(const SharedMemoryRegion& region) = 0;

  // grpc.health.v1.Health/Check for `service` ("" is the server as a whole).
  virtual absl::StatusOr<HealthStatus> Health(const std::string& service = "",
                                              const CallOptions& options = {}) = 0;
};

}  // namespace normgrad
