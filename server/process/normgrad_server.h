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
// CheckServerOptions (server_options.h) tells the bad options apart (normgrad-server exits 2 on them, 1 on the
// rest).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/process/server_options.h"
#include "server/process/grpc_listener.h"
#include "server/service/accepted_peers.h"
#include "server/shared_memory/region_registry.h"

namespace grpc {
class Server;
class ServerCredentials;
}

namespace normgrad::server {

class HealthPort;
class MetricsRegistry;
class MetricsHttpServer;
class PeriodicTask;
class NormGradService;
class PtxService;
class RegionSocket;
struct ServerMetrics;
struct ServiceMetrics;
class StreamRegistry;
class ThreadPool;
struct ServiceEnv;

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
  int health_port() const;  // 0 without --health-listen
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
  // The stream watchdog (--stream-idle-timeout, --min-stream-bytes-per-second) and the device
  // watchdog (--device-timeout), each when its flags ask for it.
  void StartWatchdogs();
  // The start-up self-test (device_self_test.h) on the CUDA backend: a failure leaves the
  // server up, NOT_SERVING, with the reason in GetServerInfo.
  void SelfTest();
  void FailDevice(const absl::Status& reason);  // the backend's device failure handler
  absl::Status Preload(const std::vector<PreloadEntry>& entries);
  void SetServing(bool serving);

  ServerOptions options_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<MetricsRegistry> metrics_;
  std::unique_ptr<ServerMetrics> server_metrics_;
  std::unique_ptr<ServiceMetrics> service_metrics_;
  std::unique_ptr<PtxService> ptx_;
  std::unique_ptr<AdmissionController> admission_;
  std::unique_ptr<StreamRegistry> streams_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ThreadPool> emit_ptx_pool_;
  std::unique_ptr<ServiceEnv> env_;
  std::unique_ptr<AcceptedPeers> accepted_peers_;  // credentials of accepted unix connections
  std::unique_ptr<NormGradService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  // Plaintext unix sockets, accepted here for their peers' credentials; before grpc_server_ in
  // destruction (they hand connections to it).
  std::vector<std::unique_ptr<GrpcListener>> listeners_;  // those accepting here (plaintext)
  uint64_t open_file_limit_ = 1024;  // RLIMIT_NOFILE after Start raised it
  // Connections closed at accept (normgrad_unix_refused_connections_total).
  std::atomic<uint64_t> refused_grpc_peers_{0};
  std::atomic<uint64_t> refused_region_peers_{0};
  std::atomic<uint64_t> refused_region_over_bound_{0};
  std::unique_ptr<HealthPort> health_port_;  // --health-listen
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<RegionRegistry> regions_;
  std::vector<std::unique_ptr<RegionSocket>> region_sockets_;
  std::unique_ptr<PeriodicTask> stream_watchdog_;
  std::unique_ptr<PeriodicTask> device_watchdog_;
  std::unique_ptr<PeriodicTask> listener_watchdog_;  // TLS: gRPC listens on TCP itself
  std::atomic<bool> listener_dead_{false};           // NOT_SERVING for good once set
  std::mutex serving_mu_;  // serializes SetServing (a failing device may race start-up)
  std::string host_;
  std::string metrics_host_;
  int port_ = 0;
  std::vector<std::string> unix_paths_;
  std::vector<ino_t> unix_inodes_;  // of the socket files bound, removed at shutdown
  int metrics_port_ = 0;

  std::mutex shutdown_mu_;  // serializes Shutdown
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

}  // namespace normgrad::server
