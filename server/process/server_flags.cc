#include "server/process/server_flags.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

ABSL_FLAG(std::vector<std::string>, listen, {"0.0.0.0:50051"},
          "gRPC addresses: HOST:PORT (port 0 picks a free port; the ready line prints it) and/or "
          "unix:/PATH (a unix-domain socket); repeat the flag or separate with commas. At most "
          "one HOST:PORT.");
ABSL_FLAG(bool, shared_memory, false,
          "Take x and dy from, and write grad_input into, shared-memory regions of clients on "
          "this machine (docs/api.md); needs a --listen=unix:/PATH, beside which the region "
          "socket PATH.shm is made.");
ABSL_FLAG(uint32_t, shared_memory_max_regions, 64,
          "Shared-memory regions registered at once, all clients together.");
ABSL_FLAG(uint64_t, shared_memory_max_bytes, 16ull << 30,
          "Bytes of shared-memory regions registered at once, all clients together.");
ABSL_FLAG(uint32_t, shared_memory_max_regions_per_user, 0,
          "Shared-memory regions one user (the registering peer's uid) may hold at once; more "
          "are refused with RESOURCE_EXHAUSTED. 0: half of --shared-memory-max-regions (at "
          "least 1).");
ABSL_FLAG(uint64_t, shared_memory_max_bytes_per_user, 0,
          "Bytes of shared-memory regions one user may hold at once. 0: half of "
          "--shared-memory-max-bytes.");
ABSL_FLAG(bool, cuda_ipc, false,
          "Take x and dy from, and write grad_input into, CUDA device memory of clients on this "
          "machine and GPU, named by CUDA IPC handles (docs/api.md); CUDA backend only.");
ABSL_FLAG(uint32_t, max_cuda_ipc_handles, 64,
          "Device allocations of clients kept open for CUDA IPC (least recently used closed "
          "first).");
ABSL_FLAG(std::vector<std::string>, unix_allowed_uids, {},
          "User ids whose connections on the unix sockets may call the service (comma "
          "separated): a peer of any other uid is closed at accept on the gRPC unix socket and "
          "on the region socket (health, reflection and regions included). Empty: any user "
          "the socket file's mode lets connect. Needs plaintext unix sockets (not with "
          "--tls-cert).");
ABSL_FLAG(std::string, unix_socket_mode, "0660",
          "File mode (octal) of every unix:/PATH socket of --listen: who may connect.");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus endpoint HOST:PORT serving GET /metrics; empty disables it.");
ABSL_FLAG(std::string, backend, "auto",
          "auto|cuda|cpu. auto: CUDA when a driver loads and a device is usable, else CPU.");
ABSL_FLAG(std::string, cuda_driver, "",
          "CUDA driver library to dlopen; empty: $NORMGRAD_CUDA_DRIVER, else libcuda.so.1.");
ABSL_FLAG(int32_t, device, 0, "CUDA device ordinal.");
ABSL_FLAG(int32_t, cpu_threads, 0, "CPU backend threads; 0: all hardware threads.");
ABSL_FLAG(int32_t, worker_threads, 0,
          "Service threads running chunk compute and compiles; 0: max(2, hardware threads).");
ABSL_FLAG(uint64_t, cache_max_entries, 256, "Module and PTX caches: most entries (LRU).");
ABSL_FLAG(uint64_t, cache_max_bytes, 256ull << 20, "Module and PTX caches: most bytes (LRU).");
ABSL_FLAG(std::vector<std::string>, preload, {},
          "Comma-separated KERNEL:TARGET[:HIDDEN_DIM] configurations compiled before the server "
          "reports SERVING, e.g. batched_rms_norm_backward:sm_90:4096 (HIDDEN_DIM default 4096).");
ABSL_FLAG(uint32_t, max_streams, 64,
          "Concurrent RmsNormBackward streams; more get RESOURCE_EXHAUSTED at once.");
ABSL_FLAG(uint64_t, max_inflight_bytes, 1ull << 30,
          "Bytes held for chunks in flight across all streams (request + response of each chunk "
          "until written); a chunk past it ends its stream with RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint32_t, max_streams_per_client, 0,
          "RmsNormBackward streams one client may hold at once (client: the mTLS certificate's "
          "name; a unix-socket peer, and a TCP peer on a loopback address, by its user id; else the "
          "peer address without the port, an IPv6 one by its /64); more "
          "get RESOURCE_EXHAUSTED at once. 0: half of --max-streams (at least 1).");
ABSL_FLAG(uint64_t, min_stream_bytes_per_second, 1024,
          "End a stream whose x, dy and grad_input move slower than this over "
          "--min-stream-rate-window of waiting on its client, with DEADLINE_EXCEEDED; 0 disables.");
ABSL_FLAG(std::string, min_stream_rate_window, "30s",
          "The window of --min-stream-bytes-per-second (time waiting on the server not counted).");
ABSL_FLAG(int32_t, emit_ptx_threads, 1,
          "Threads running EmitPtx (emission, nvJitLink), apart from the chunk workers.");
ABSL_FLAG(uint32_t, max_emit_ptx_queue, 64,
          "EmitPtx calls queued or running at once, all clients together; more get "
          "RESOURCE_EXHAUSTED at once.");
ABSL_FLAG(uint32_t, max_emit_ptx_queue_per_connection, 8,
          "EmitPtx calls queued or running at once from one connection.");
ABSL_FLAG(uint64_t, max_emit_ptx_queue_bytes, 64ull << 20,
          "Request bytes of the EmitPtx calls queued or running, all clients together.");
ABSL_FLAG(uint64_t, max_emit_ptx_queue_bytes_per_connection, 16ull << 20,
          "Request bytes of the EmitPtx calls queued or running from one connection.");
ABSL_FLAG(uint32_t, max_hidden_dim, 65536, "Largest header.hidden_dim accepted.");
ABSL_FLAG(uint64_t, max_num_rows, uint64_t{1} << 32, "Largest header.num_rows accepted.");
ABSL_FLAG(uint64_t, max_message_bytes, 4ull << 20,
          "Largest request message the server receives (gRPC receive limit).");
// Durations are string flags parsed with absl::ParseDuration ("30s", "500ms"): absl's Duration
// flags use a sequence lock whose fences GCC's ThreadSanitizer build rejects.
ABSL_FLAG(std::string, stream_idle_timeout, "30s",
          "End a stream whose client sends nothing (or reads nothing) for this long, with "
          "DEADLINE_EXCEEDED; 0 disables.");
ABSL_FLAG(std::string, device_timeout, "60s",
          "GPU work (a stream synchronize) not done within this long marks the device hung: "
          "NOT_SERVING, streams UNAVAILABLE, exit 3; 0 disables.");
ABSL_FLAG(std::string, shutdown_grace, "30s",
          "On SIGTERM/SIGINT: how long in-flight streams may run before they are cancelled.");
ABSL_FLAG(std::string, nvjitlink, "",
          "nvJitLink library for EmitPtx cubins; empty: libnvJitLink.so.13, libnvJitLink.so, "
          "/usr/local/cuda/lib64/libnvJitLink.so*.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM server certificate (chain) for the gRPC port; with --tls-key enables TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, mutual TLS: every client must present a certificate it "
          "signed. Needs --tls-cert.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token (whitespace trimmed); every call except the health "
          "service must send \"authorization: Bearer <token>\" or gets UNAUTHENTICATED. Needs "
          "--tls-cert. The token itself is never accepted on the command line.");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT of a second, plaintext gRPC port serving only grpc.health.v1.Health with "
          "the main port's status (for probes that cannot speak TLS); empty: none.");
ABSL_FLAG(uint32_t, max_streams_per_connection, 100,
          "Calls one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); "
          "a client's further calls wait in its transport.");
ABSL_FLAG(std::string, min_client_ping_interval, "10s",
          "Least interval between a client's HTTP/2 pings without data; a client pinging faster "
          "has its connection closed (GOAWAY ENHANCE_YOUR_CALM).");
ABSL_FLAG(std::string, metrics_tls_cert, "",
          "PEM certificate for the metrics endpoint; with --metrics-tls-key it serves HTTPS.");
ABSL_FLAG(std::string, metrics_tls_key, "", "PEM private key of --metrics-tls-cert.");

namespace normgrad::server {

std::vector<std::string> NormalizeFlagSpelling(int argc, char** argv) {
  std::vector<std::string> out;
  bool flags_done = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0 && !flags_done && arg == "--") flags_done = true;
    if (i > 0 && !flags_done && arg.size() > 2 && arg[0] == '-') {
      const size_t start = arg[1] == '-' ? 2 : 1;
      const size_t end = std::min(arg.find('='), arg.size());
      for (size_t j = start; j < end; ++j) {
        if (arg[j] == '-') arg[j] = '_';
      }
    }
    out.push_back(std::move(arg));
  }
  // --listen may be repeated: absl keeps the last value of a repeated flag, so the values are
  // joined into one comma-separated --listen at the place of the first.
  std::vector<std::string> merged;
  std::vector<std::string> listen_values;
  size_t first_listen = 0;
  flags_done = false;
  for (size_t i = 0; i < out.size(); ++i) {
    const std::string& arg = out[i];
    if (i > 0 && !flags_done && arg == "--") flags_done = true;
    const bool listen_flag = i > 0 && !flags_done && (arg == "--listen" || arg == "-listen");
    const bool listen_value = i > 0 && !flags_done && (absl::StartsWith(arg, "--listen=") ||
                                                       absl::StartsWith(arg, "-listen="));
    if (!listen_flag && !listen_value) {
      merged.push_back(arg);
      continue;
    }
    if (listen_values.empty()) first_listen = merged.size();
    if (listen_value) {
      listen_values.push_back(arg.substr(arg.find('=') + 1));
    } else if (i + 1 < out.size()) {
      listen_values.push_back(out[++i]);
    } else {
      merged.push_back(arg);  // "--listen" with no value: absl reports it
    }
  }
  if (!listen_values.empty()) {
    merged.insert(merged.begin() + static_cast<std::ptrdiff_t>(first_listen),
                  absl::StrCat("--listen=", absl::StrJoin(listen_values, ",")));
  }
  return merged;
}

bool IsServerFlagsFile(absl::string_view path) {
  return absl::StrContains(path, "server_flags.");
}

absl::StatusOr<ServerOptions> ServerOptionsFromFlags() {
  ServerOptions o;
  o.listen.clear();
  for (const std::string& address : absl::GetFlag(FLAGS_listen)) {
    if (!address.empty()) o.listen.push_back(address);
  }
  const std::string mode = absl::GetFlag(FLAGS_unix_socket_mode);
  uint32_t mode_bits = 0;
  if (mode.empty() || mode.size() > 4 ||
      mode.find_first_not_of("01234567") != std::string::npos ||
      (mode_bits = static_cast<uint32_t>(std::stoul(mode, nullptr, 8))) > 0777) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--unix-socket-mode=", mode, ": not an octal file mode in 0..0777 such as 0660"));
  }
  o.unix_socket_mode = mode_bits;
  for (const std::string& text : absl::GetFlag(FLAGS_unix_allowed_uids)) {
    uint32_t uid = 0;
    if (!absl::SimpleAtoi(text, &uid)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--unix-allowed-uids: \"", text, "\" is not a user id (0..4294967295)"));
    }
    o.unix_allowed_uids.push_back(uid);
  }
  o.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  o.cuda_ipc = absl::GetFlag(FLAGS_cuda_ipc);
  o.backend.max_ipc_handles = absl::GetFlag(FLAGS_max_cuda_ipc_handles);
  o.regions.max_regions = absl::GetFlag(FLAGS_shared_memory_max_regions);
  o.regions.max_bytes = absl::GetFlag(FLAGS_shared_memory_max_bytes);
  // No user may take every region or byte (like --max-streams-per-client for streams).
  o.regions.max_regions_per_user = absl::GetFlag(FLAGS_shared_memory_max_regions_per_user);
  if (o.regions.max_regions_per_user == 0) {
    o.regions.max_regions_per_user = std::max<uint32_t>(1, o.regions.max_regions / 2);
  }
  o.regions.max_bytes_per_user = absl::GetFlag(FLAGS_shared_memory_max_bytes_per_user);
  if (o.regions.max_bytes_per_user == 0) {
    o.regions.max_bytes_per_user = std::max<uint64_t>(1, o.regions.max_bytes / 2);
  }
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  absl::StatusOr<BackendKind> kind = ParseBackendKind(absl::GetFlag(FLAGS_backend));
  if (!kind.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--backend=", absl::GetFlag(FLAGS_backend),
                                                   ": ", kind.status().message()));
  }
  o.backend.kind = *kind;
  o.backend.cuda_driver_library = absl::GetFlag(FLAGS_cuda_driver);
  o.backend.device_ordinal = absl::GetFlag(FLAGS_device);
  o.backend.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  if (o.backend.cpu_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-threads=", o.backend.cpu_threads, ": must be >= 0"));
  }
  if (o.backend.device_ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", o.backend.device_ordinal, ": must be >= 0"));
  }
  o.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  if (o.worker_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-threads=", o.worker_threads, ": must be >= 0"));
  }
  o.backend.cache_max_entries = absl::GetFlag(FLAGS_cache_max_entries);
  o.backend.cache_max_bytes = absl::GetFlag(FLAGS_cache_max_bytes);
  if (o.backend.cache_max_entries == 0) {
    return absl::InvalidArgumentError("--cache-max-entries=0: must be > 0");
  }
  if (o.backend.cache_max_bytes == 0) {
    return absl::InvalidArgumentError("--cache-max-bytes=0: must be > 0");
  }
  for (const std::string& entry : absl::GetFlag(FLAGS_preload)) {
    if (!entry.empty()) o.preload.push_back(entry);
  }
  o.admission.max_streams = absl::GetFlag(FLAGS_max_streams);
  o.admission.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  o.admission.max_streams_per_client = absl::GetFlag(FLAGS_max_streams_per_client);
  if (o.admission.max_streams_per_client == 0) {  // no client may take every slot
    o.admission.max_streams_per_client = std::max<uint32_t>(1, o.admission.max_streams / 2);
  }
  o.admission.max_emit_ptx_calls = absl::GetFlag(FLAGS_max_emit_ptx_queue);
  o.admission.max_emit_ptx_calls_per_connection =
      absl::GetFlag(FLAGS_max_emit_ptx_queue_per_connection);
  o.admission.max_emit_ptx_bytes = absl::GetFlag(FLAGS_max_emit_ptx_queue_bytes);
  o.admission.max_emit_ptx_bytes_per_connection =
      absl::GetFlag(FLAGS_max_emit_ptx_queue_bytes_per_connection);
  o.emit_ptx_threads = absl::GetFlag(FLAGS_emit_ptx_threads);
  o.min_stream_bytes_per_second = absl::GetFlag(FLAGS_min_stream_bytes_per_second);
  if (!absl::ParseDuration(absl::GetFlag(FLAGS_min_stream_rate_window),
                           &o.min_stream_rate_window)) {
    return absl::InvalidArgumentError(absl::StrCat("--min-stream-rate-window=",
                                                   absl::GetFlag(FLAGS_min_stream_rate_window),
                                                   " is not a duration such as 30s"));
  }
  o.batch.max_hidden_dim = absl::GetFlag(FLAGS_max_hidden_dim);
  o.batch.max_num_rows = absl::GetFlag(FLAGS_max_num_rows);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (!absl::ParseDuration(absl::GetFlag(FLAGS_stream_idle_timeout), &o.stream_idle_timeout)) {
    return absl::InvalidArgumentError(absl::StrCat("--stream-idle-timeout=",
                                                   absl::GetFlag(FLAGS_stream_idle_timeout),
                                                   " is not a duration such as 30s or 500ms"));
  }
  if (!absl::ParseDuration(absl::GetFlag(FLAGS_device_timeout), &o.device_timeout)) {
    return absl::InvalidArgumentError(absl::StrCat("--device-timeout=",
                                                   absl::GetFlag(FLAGS_device_timeout),
                                                   " is not a duration such as 60s or 500ms"));
  }
  o.nvjitlink_path = absl::GetFlag(FLAGS_nvjitlink);
  o.security.cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.security.key_file = absl::GetFlag(FLAGS_tls_key);
  o.security.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  o.security.token_file = absl::GetFlag(FLAGS_auth_token_file);
  o.health_listen = absl::GetFlag(FLAGS_health_listen);
  o.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  if (!absl::ParseDuration(absl::GetFlag(FLAGS_min_client_ping_interval),
                           &o.min_client_ping_interval)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-client-ping-interval=", absl::GetFlag(FLAGS_min_client_ping_interval),
        " is not a duration such as 10s"));
  }
  o.metrics_tls_cert_file = absl::GetFlag(FLAGS_metrics_tls_cert);
  o.metrics_tls_key_file = absl::GetFlag(FLAGS_metrics_tls_key);
  absl::Duration grace;
  if (!absl::ParseDuration(absl::GetFlag(FLAGS_shutdown_grace), &grace) ||
      grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--shutdown-grace=",
                                                   absl::GetFlag(FLAGS_shutdown_grace),
                                                   " is not a duration >= 0 such as 30s"));
  }
  NORMGRAD_RETURN_IF_ERROR(CheckServerOptions(o));
  return o;
}

absl::Duration ShutdownGraceFromFlags() {
  absl::Duration grace = absl::Seconds(30);
  (void)absl::ParseDuration(absl::GetFlag(FLAGS_shutdown_grace), &grace);  // checked above
  return grace;
}

}  // namespace normgrad::server
