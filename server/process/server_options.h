// ServerOptions: what normgrad-server is asked to do (the flags, parsed by server_flags.h, or a
// test's choice), and the checks of those values that need neither a device nor a port. The
// options own their validation: NormGradServer::Start and the flag parser both call
// CheckServerOptions, and a bad value is INVALID_ARGUMENT naming the flag and its value.
//
//   ServerOptions options;
//   options.listen = {"unix:/run/normgrad/grpc.sock"};
//   options.shared_memory = true;
//   absl::Status s = CheckServerOptions(options);          // before any GPU or port is touched
//   absl::StatusOr<std::vector<PreloadEntry>> p = ParsePreloadEntries(options.preload);
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/backward_kernel.h"
#include "kernels/kernel_config.h"
#include "server/backend_factory/backend_factory.h"
#include "server/process/transport_security.h"
#include "server/service/admission.h"
#include "server/service/backward_validator.h"
#include "server/shared_memory/region_registry.h"

namespace normgrad::server {

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
  const kernels::BackwardKernel* kernel = nullptr;
  kernels::KernelConfig config;
};
// "batched_rms_norm_backward:sm_90" or "...:sm_90:896" (hidden_dim defaults to 4096).
absl::StatusOr<PreloadEntry> ParsePreloadEntry(absl::string_view text);
absl::StatusOr<std::vector<PreloadEntry>> ParsePreloadEntries(const std::vector<std::string>& texts);

// Every check of `options` that needs neither a device nor a port, the first thing
// NormGradServer::Start does and the last one the flag parser does:
// each value and combination, the TLS and token files (read and parsed), the --preload entries.
// INVALID_ARGUMENT naming the flag and its value. Ports that are taken or not local, a missing
// GPU and a failing --preload compile are found by Start only.
absl::Status CheckServerOptions(const ServerOptions& options);

}  // namespace normgrad::server
