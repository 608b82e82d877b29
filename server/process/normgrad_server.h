// NormGradServer: everything `normgrad-server` runs, in-process (tests start it on
// 127.0.0.1:0): the backend, the gRPC service with health and reflection, admission control,
// the EmitPtx cache, the idle-stream watchdog and the Prometheus endpoint.
//
//   ServerOptions options;
//   options.listen = {"127.0.0.1:0"};   // and/or "unix:/run/normgrad/grpc.sock"
//   absl::StatusOr<std::unique_ptr<NormGradServer>> server = NormGradServer::Start(options);
//   int port = (*server)->port();
//   ...
//   (*server)->Shutdown(absl::Seconds(30));   // drain, then cancel what is left
//
// Start returns once the server is SERVING (after --preload). Start-up failures (bad option,
// port taken, --backend=cuda without a GPU) come back as a status with one clear message;
// CheckServerOptions tells the bad options apart (normgrad-server exits 2 on them, 1 on the
// rest).
#ifndef NORMGRAD_SERVER_PROCESS_NORMGRAD_SERVER_H_
#define NORMGRAD_SERVER_PROCESS_NORMGRAD_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/kernel.h"
#include "server/backend/backend.h"
#include "server/backend_factory/backend_factory.h"
#include "server/process/transport_security.h"
#include "server/service/admission.h"
#include "server/service/backward_validator.h"
#include "server/process/unix_grpc_listener.h"
#include "server/service/unix_peers.h"
#include "server/shared_memory/region_registry.h"

namespace grpc {
class CallbackGenericService;
class Server;
class ServerCredentials;
}

namespace normgrad::server {

class MetricsRegistry;
class MetricsHttpServer;
class NormGradService;
class PtxService;
class RegionSocket;
class StreamRegistry;
class ThreadPool;
struct ServiceEnv;

struct ServerOptions {
  // HOST:PORT (port 0 picks a free one; at most one) and unix:/PATH addresses (listen_address.h).
  std::vector<std::string> listen = {"0.0.0.0:50051"};
  uint32_t unix_socket_mode = 0660;             // chmod of every unix:/PATH socket
  // Users whose unix-socket connections may call the service; empty: any (the file mode
  // decides). Needs plaintext unix sockets (accepted by the server, which reads SO_PEERCRED).
  std::vector<uint32_t> unix_allowed_uids;
  // Shared-memory regions of co-located clients: for each unix:/PATH listener a region socket
  // PATH.shm (server/shared_memory/); off by default.
  bool shared_memory = false;
  RegionLimits regions;
  // CUDA IPC: chunks may name device buffers of clients on this machine (CUDA backend only;
  // backend.max_ipc_handles bounds the allocations kept open); off by default.
  bool cuda_ipc = false;
  std::string metrics_listen = "0.0.0.0:9464";  // empty: no metrics endpoint
  BackendOptions backend;
  std::vector<std::string> preload;             // KERNEL:TARGET[:HIDDEN_DIM] entries
  AdmissionLimits admission;
  BackwardLimits batch;
  uint64_t max_message_bytes = 4ull << 20;      // gRPC receive limit per message
  absl::Duration stream_idle_timeout = absl::Seconds(30);  // zero: never
  // GPU work (a stream synchronize) still waiting after this long means a hung device, which
  // fails like a lost one (below); zero: no bound.
  absl::Duration device_timeout = absl::Seconds(60);
  // Called once, on the thread that saw it, when the device failed for good (a sticky driver
  // error, a lost device, --device-timeout), after health went NOT_SERVING; new streams are
  // refused UNAVAILABLE from then on. Must not block. normgrad-server exits 3 shortly after.
  std::function<void(const absl::Status&)> on_device_failure;
  std::string nvjitlink_path;                   // empty: default search
  int worker_threads = 0;                       // 0: max(2, hardware threads)
  int emit_ptx_threads = 1;                     // EmitPtx's own workers (compiles)
  // End a stream moving less than this many bytes per second over `min_stream_rate_window` of
  // waiting on its client; 0: no minimum (the flag's default is 1024).
  uint64_t min_stream_bytes_per_second = 0;
  absl::Duration min_stream_rate_window = absl::Seconds(30);
  // TLS / mutual TLS and the bearer token of the main gRPC port (transport_security.h).
  TransportSecurityOptions security;
  // HOST:PORT of a second, always plaintext gRPC port serving grpc.health.v1.Health only, with
  // the main port's status (for probes that cannot speak TLS); empty: none.
  std::string health_listen;
  // HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS of every connection: a client opens at most this
  // many calls at once on one connection (more wait in its transport).
  uint32_t max_streams_per_connection = 100;
  // Least time between HTTP/2 pings a client may send without data; pinging faster twice gets
  // the connection closed with GOAWAY (ENHANCE_YOUR_CALM).
  absl::Duration min_client_ping_interval = absl::Seconds(10);
  // PEM certificate and key for the metrics endpoint (HTTPS); both empty: plain HTTP.
  std::string metrics_tls_cert_file;
  std::string metrics_tls_key_file;
};

// One --preload entry, parsed: the kernel and its configuration.
struct PreloadEntry {
  const kernels::Kernel* kernel = nullptr;
  kernels::KernelConfig config;
};
// "batched_rms_norm_backward:sm_90" or "...:sm_90:896" (hidden_dim defaults to 4096).
absl::StatusOr<PreloadEntry> ParsePreloadEntry(absl::string_view text);

// Every check of `options` that needs neither a device nor a port, the first thing Start does:
// each value and combination, the TLS and token files (read and parsed), the --preload entries.
// INVALID_ARGUMENT naming the flag and its value. Ports that are taken or not local, a missing
// GPU and a failing --preload compile are found by Start only.
absl::Status CheckServerOptions(const ServerOptions& options);

class NormGradServer {
 public:
  // `backend`: used as is when given (tests), else CreateBackend(options.backend).
  static absl::StatusOr<std::unique_ptr<NormGradServer>> Start(
      const ServerOptions& options, std::unique_ptr<Backend> backend = nullptr);
  ~NormGradServer();  // Shutdown(zero grace) unless already shut down

  NormGradServer(const NormGradServer&) = delete;
  NormGradServer& operator=(const NormGradServer&) = delete;

  int port() const { return port_; }  // the HOST:PORT listener's; 0 with unix sockets only
  // The unix:/PATH sockets the service listens on, in --listen order.
  const std::vector<std::string>& unix_socket_paths() const { return unix_paths_; }
  RegionRegistry* regions() { return regions_.get(); }  // null without shared_memory
  int metrics_port() const { return metrics_port_; }  // 0 when disabled
  int health_port() const { return health_port_; }    // 0 without --health-listen
  // One line for people and scripts: "normgrad-server ready grpc=HOST:PORT metrics=HOST:PORT
  // backend=NAME device=\"...\"" (grpc=off without a HOST:PORT listener, metrics=off when
  // disabled), then " unix=PATH" per unix socket (and " shm=PATH.shm" with shared memory), " health=HOST:PORT" with --health-listen and
  // " tls=on|mtls" with TLS.
  std::string ReadyLine() const;

  // Health NOT_SERVING, new streams UNAVAILABLE; waits up to `grace` for live streams, cancels
  // the rest, then stops everything. Idempotent; blocks until done. Thread-safe.
  void Shutdown(absl::Duration grace);

  Backend& backend() { return *backend_; }
  MetricsRegistry& metrics() { return *metrics_; }
  size_t live_streams() const;
  // OK while the device may serve; else why not (a failed start-up self-test keeps the server
  // up but NOT_SERVING; a failed device: on_device_failure).
  absl::Status device_health() const;

 private:
  NormGradServer(const ServerOptions& options, std::unique_ptr<Backend> backend);
  // Start's steps, in order: the metrics registry, EmitPtx, admission, the worker pool and the
  // service; the backend's gauges and the cache and memory collectors; --metrics-listen;
  // --listen; --health-listen; the --stream-idle-timeout watchdog; --preload.
  void AssembleService();
  void PublishBackendMetrics();
  absl::Status StartMetricsEndpoint();
  absl::Status StartGrpcPort(const std::shared_ptr<grpc::ServerCredentials>& credentials);
  absl::Status StartHealthPort();
  absl::Status StartRegionSockets();
  void StartWatchdog();
  void StartDeviceWatchdog();  // --device-timeout
  void RunDeviceWatchdog();
  // The start-up self-test (device_self_test.h) on the CUDA backend: a failure leaves the
  // server up, NOT_SERVING, with the reason in GetServerInfo.
  void SelfTest();
  void FailDevice(const absl::Status& reason);  // the backend's device failure handler
  absl::Status Preload(const std::vector<PreloadEntry>& entries);

  void RunWatchdog();
  void SetServing(bool serving);

  ServerOptions options_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<MetricsRegistry> metrics_;
  std::unique_ptr<PtxService> ptx_;
  std::unique_ptr<AdmissionController> admission_;
  std::unique_ptr<StreamRegistry> streams_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ThreadPool> emit_ptx_pool_;
  std::unique_ptr<ServiceEnv> env_;
  std::unique_ptr<UnixPeers> unix_peers_;  // credentials of accepted unix connections
  std::unique_ptr<NormGradService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  // Plaintext unix sockets, accepted here for their peers' credentials; before grpc_server_ in
  // destruction (they hand connections to it).
  std::vector<std::unique_ptr<UnixGrpcListener>> unix_listeners_;
  uint64_t open_file_limit_ = 1024;  // RLIMIT_NOFILE after Start raised it
  // Connections closed at accept (normgrad_unix_refused_connections_total).
  std::atomic<uint64_t> refused_grpc_peers_{0};
  std::atomic<uint64_t> refused_region_peers_{0};
  std::atomic<uint64_t> refused_region_over_bound_{0};
  std::unique_ptr<grpc::Server> health_server_;  // --health-listen; health service only
  std::unique_ptr<grpc::CallbackGenericService> health_port_rejecter_;  // other methods there
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<RegionRegistry> regions_;
  std::vector<std::unique_ptr<RegionSocket>> region_sockets_;
  std::thread watchdog_;
  std::thread device_watchdog_;
  std::mutex serving_mu_;  // serializes SetServing (a failing device may race start-up)
  std::string host_;
  std::string metrics_host_;
  std::string health_host_;
  int port_ = 0;
  std::vector<std::string> unix_paths_;
  std::vector<ino_t> unix_inodes_;  // of the socket files bound, removed at shutdown
  int health_port_ = 0;
  int metrics_port_ = 0;

  std::mutex shutdown_mu_;  // serializes Shutdown
  std::mutex watchdog_mu_;
  std::condition_variable watchdog_wake_;
  bool stopping_ = false;  // guarded by watchdog_mu_
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_PROCESS_NORMGRAD_SERVER_H_
