#include "server/process/normgrad_server.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kernels/kernel_registry.h"
#include "kernels/status_macros.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_http_server.h"
#include "server/process/device_self_test.h"
#include "server/process/listen_address.h"
#include "server/process/process_memory.h"
#include "server/ptx/ptx_service.h"
#include "server/service/normgrad_service.h"
#include "server/shared_memory/region_socket.h"
#include "server/thread_pool/thread_pool.h"
#include "server/unix_socket/unix_acceptor.h"

#ifndef NORMGRAD_VERSION
#define NORMGRAD_VERSION "0.0.0"
#endif

namespace normgrad::server {
namespace {

constexpr char kServiceName[] = "normgrad.v1.NormGrad";
// How long a draining server's gRPC shutdown lets the calls that arrived during the drain finish
// (the service answers them at once) before it cancels what is left (Shutdown).
constexpr absl::Duration kLateCallGrace = absl::Milliseconds(500);

void SetHealth(grpc::Server* server, bool serving) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus("", serving);
    health->SetServingStatus(kServiceName, serving);
  }
}

// Drops the builder plugins registered process-wide (server reflection): the health port
// serves the health service and nothing else.
class WithoutPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

// The health port's answer to every method but the health service's: UNIMPLEMENTED. (It also
// gives that server the callback method gRPC requires of a server before it starts.)
class HealthPortRejecter final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Reject final : public grpc::ServerGenericBidiReactor {
     public:
      Reject() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this port serves grpc.health.v1.Health only; use the main port"));
      }
      void OnDone() override { delete this; }
    };
    return new Reject();
  }
};

// Per-connection bounds shared by both gRPC ports.
void AddConnectionLimits(const ServerOptions& options, grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a taken port must fail
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(options.max_streams_per_connection));
  // Find dead peers (a client that vanished without a FIN) instead of holding their streams.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  // Ping-flood protection: a client pinging more often than this without data gets a strike;
  // after GRPC_ARG_HTTP2_MAX_PING_STRIKES strikes the connection is closed (GOAWAY).
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.min_client_ping_interval)));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  // Request headers (metadata) are bounded too: 16 KiB per call.
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 16 * 1024);
}

void DescribeServerMetrics(MetricsRegistry& m) {
  m.DescribeGauge("normgrad_serving", "1 when health is SERVING, 0 while starting or draining.");
  m.DescribeGauge("normgrad_device_healthy",
                  "1 while the device may serve; 0 after a failed start-up self-test or once the "
                  "device failed (a sticky driver error, --device-timeout).");
  m.DescribeGauge("normgrad_inflight_streams", "RmsNormBackward streams admitted and not done.");
  m.DescribeGauge("normgrad_shm_regions", "Shared-memory regions registered now (--shared-memory).");
  m.DescribeCounter("normgrad_unix_refused_connections_total",
                    "Unix-socket connections closed at accept, by socket (grpc, region) and reason "
                    "(uid: --unix-allowed-uids does not list the peer; bound: the socket's "
                    "connection bound, in all or for the peer's user).");
  m.DescribeGauge("normgrad_shm_region_bytes", "Bytes of the shared-memory regions registered now.");
  m.DescribeGauge("normgrad_shm_registrations",
                  "Region registrations since start, by result (ok, refused).");
  m.DescribeGauge("normgrad_inflight_bytes",
                  "Bytes held for chunks being computed or written (admission control).");
  m.DescribeGauge("normgrad_backend_info", "Always 1; the labels describe backend and device.");
  m.DescribeGauge("normgrad_device_memory_bytes", "Total memory of the device.");
  m.DescribeGauge("normgrad_process_resident_bytes", "Resident memory of the server process.");
  m.DescribeGauge("normgrad_process_heap_in_use_bytes",
                  "Bytes malloc has handed out and not had back (0 where unknown).");
  m.DescribeGauge("normgrad_process_heap_free_bytes",
                  "Bytes malloc holds for reuse without handing them out (0 where unknown).");
  m.DescribeCounter("normgrad_cache_hits_total", "Cache lookups that found the entry.");
  m.DescribeCounter("normgrad_cache_misses_total", "Cache lookups that had to compile.");
  m.DescribeCounter("normgrad_cache_evictions_total", "Entries evicted by the LRU bounds.");
  m.DescribeCounter("normgrad_cache_compiles_total", "Compile functions run.");
  m.DescribeCounter("normgrad_cache_compile_failures_total", "Compile functions that failed.");
  m.DescribeCounter("normgrad_cache_compile_seconds_total", "Time spent compiling.");
  m.DescribeGauge("normgrad_cache_entries", "Entries in the cache.");
  m.DescribeGauge("normgrad_cache_bytes", "Bytes accounted to the cache's entries.");
  DescribeServiceMetrics(m);
}

void CollectCache(MetricsRegistry& m, const char* cache, const ModuleCacheStats& s) {
  const MetricsRegistry::Labels l = {{"cache", cache}};
  m.SetCounter("normgrad_cache_hits_total", l, static_cast<double>(s.hits));
  m.SetCounter("normgrad_cache_misses_total", l, static_cast<double>(s.misses));
  m.SetCounter("normgrad_cache_evictions_total", l, static_cast<double>(s.evictions));
  m.SetCounter("normgrad_cache_compiles_total", l, static_cast<double>(s.compiles));
  m.SetCounter("normgrad_cache_compile_failures_total", l,
               static_cast<double>(s.compile_failures));
  m.SetCounter("normgrad_cache_compile_seconds_total", l, s.compile_seconds);
  m.SetGauge("normgrad_cache_entries", l, static_cast<double>(s.entries));
  m.SetGauge("normgrad_cache_bytes", l, static_cast<double>(s.bytes));
}

absl::Status ValidateOptions(const ServerOptions& o) {
  if (o.max_message_bytes < 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-message-bytes=", o.max_message_bytes, " is below the minimum of 4096"));
  }
  if (o.max_message_bytes > (2ull << 30) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-message-bytes=", o.max_message_bytes,
                                                   " is above protobuf's 2 GiB ceiling"));
  }
  if (o.batch.max_hidden_dim == 0) {
    return absl::InvalidArgumentError("--max-hidden-dim=0: must be > 0");
  }
  if (o.batch.max_num_rows == 0) {
    return absl::InvalidArgumentError("--max-num-rows=0: must be > 0");
  }
  // A batch's byte counts (rows x row bytes, and sums of a few of them) are computed in 64 bits
  // throughout the service: the largest batch accepted must leave them room.
  if (unsigned __int128 batch_bytes =
          static_cast<unsigned __int128>(o.batch.max_num_rows) * o.batch.max_hidden_dim * 4;
      batch_bytes > (uint64_t{1} << 60)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-num-rows=", o.batch.max_num_rows, " with --max-hidden-dim=",
        o.batch.max_hidden_dim, " allows batches above 2^60 bytes of x; lower one of them"));
  }
  // One row of x and dy (plus rms and framing) must fit in one message.
  const uint64_t one_row = 2 * uint64_t{o.batch.max_hidden_dim} * 4 + 4 + 64;
  if (one_row > o.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-hidden-dim=", o.batch.max_hidden_dim, " needs messages of at least ", one_row,
        " bytes for one row of x and dy, above --max-message-bytes=", o.max_message_bytes));
  }
  if (o.admission.max_streams == 0) {
    return absl::InvalidArgumentError("--max-streams=0: must be > 0");
  }
  NORMGRAD_RETURN_IF_ERROR(CheckAdmissionLimits(o.admission));
  if (o.emit_ptx_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--emit-ptx-threads=", o.emit_ptx_threads, ": must be >= 1"));
  }
  if (o.min_stream_bytes_per_second > 0 && o.min_stream_rate_window <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-stream-rate-window=", absl::FormatDuration(o.min_stream_rate_window),
        ": must be > 0 when --min-stream-bytes-per-second=", o.min_stream_bytes_per_second));
  }
  if (o.admission.max_inflight_bytes < 3 * one_row) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-inflight-bytes=", o.admission.max_inflight_bytes,
        " cannot hold even one row of the largest hidden_dim (", 3 * one_row, " bytes)"));
  }
  if (o.stream_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stream-idle-timeout=", absl::FormatDuration(o.stream_idle_timeout), ": must be >= 0"));
  }
  if (o.device_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device-timeout=", absl::FormatDuration(o.device_timeout), ": must be >= 0 (0: no bound)"));
  }
  if (o.listen.empty()) {
    return absl::InvalidArgumentError("--listen: give at least one HOST:PORT or unix:/PATH");
  }
  int tcp_listeners = 0;
  for (const std::string& address : o.listen) {
    NORMGRAD_ASSIGN_OR_RETURN(ListenAddress a, ParseListenAddress(address));
    if (a.kind == ListenAddress::kTcp && ++tcp_listeners > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", absl::StrJoin(o.listen, ","), ": at most one HOST:PORT (and any number "
          "of unix:/PATH)"));
    }
  }
  if (o.shared_memory) {
    const bool has_unix = std::any_of(o.listen.begin(), o.listen.end(), [](const std::string& a) {
      return absl::StartsWith(a, "unix:");
    });
    if (!has_unix) {
      return absl::InvalidArgumentError(
          "--shared-memory needs a --listen=unix:/PATH (clients register regions on PATH.shm)");
    }
    if (o.regions.max_regions == 0 || o.regions.max_bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shared-memory-max-regions=", o.regions.max_regions, " --shared-memory-max-bytes=",
          o.regions.max_bytes, ": both must be > 0"));
    }
  }
  if (!o.unix_allowed_uids.empty()) {
    const bool has_unix = std::any_of(o.listen.begin(), o.listen.end(), [](const std::string& a) {
      return absl::StartsWith(a, "unix:");
    });
    if (!has_unix) {
      return absl::InvalidArgumentError(
          "--unix-allowed-uids needs a --listen=unix:/PATH (it governs unix-socket clients)");
    }
    if (!o.security.cert_file.empty() || !UnixGrpcListener::Supported()) {
      return absl::InvalidArgumentError(
          "--unix-allowed-uids needs plaintext unix sockets: with --tls-cert gRPC accepts their "
          "connections itself and gives no peer credentials");
    }
  }
  if (o.unix_socket_mode > 0777) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--unix-socket-mode=%o: only permission bits (0..0777)", o.unix_socket_mode));
  }
  std::string host;
  int port;
  if (!o.metrics_listen.empty()) {
    NORMGRAD_RETURN_IF_ERROR(SplitHostPort(o.metrics_listen, "metrics-listen", &host, &port));
  }
  if (!o.health_listen.empty()) {
    NORMGRAD_RETURN_IF_ERROR(SplitHostPort(o.health_listen, "health-listen", &host, &port));
  }
  if (o.max_streams_per_connection == 0 || o.max_streams_per_connection > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-streams-per-connection=", o.max_streams_per_connection,
                     ": must be in 1..", INT32_MAX));
  }
  if (o.min_client_ping_interval < absl::ZeroDuration() ||
      o.min_client_ping_interval > absl::Milliseconds(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-client-ping-interval=", absl::FormatDuration(o.min_client_ping_interval),
        ": must be in 0..", absl::FormatDuration(absl::Milliseconds(INT32_MAX))));
  }
  if (o.metrics_tls_cert_file.empty() != o.metrics_tls_key_file.empty()) {
    return absl::InvalidArgumentError("--metrics-tls-cert and --metrics-tls-key go together");
  }
  if (!o.metrics_tls_cert_file.empty()) {
    NORMGRAD_RETURN_IF_ERROR(ReadPemFile(o.metrics_tls_cert_file, "metrics-tls-cert").status());
    NORMGRAD_RETURN_IF_ERROR(ReadPemFile(o.metrics_tls_key_file, "metrics-tls-key").status());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PreloadEntry> ParsePreloadEntry(absl::string_view text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() < 2 || parts.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\" is not KERNEL:TARGET[:HIDDEN_DIM]"));
  }
  PreloadEntry entry;
  entry.kernel = kernels::FindKernel(parts[0]);
  if (entry.kernel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": unknown kernel \"", parts[0], "\""));
  }
  absl::StatusOr<int> sm = kernels::ParseTarget(parts[1]);
  if (!sm.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": ", sm.status().message()));
  }
  entry.config.target_sm = *sm;
  entry.config.hidden_dim = 4096;
  if (parts.size() == 3 && !absl::SimpleAtoi(parts[2], &entry.config.hidden_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": hidden_dim \"", parts[2],
                     "\" is not a number"));
  }
  if (absl::Status s = entry.kernel->CanImplement(entry.config); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": ", s.message()));
  }
  return entry;
}

namespace {

absl::StatusOr<std::vector<PreloadEntry>> ParsePreloadEntries(
    const std::vector<std::string>& texts) {
  std::vector<PreloadEntry> entries;
  for (const std::string& text : texts) {
    NORMGRAD_ASSIGN_OR_RETURN(const PreloadEntry entry, ParsePreloadEntry(text));
    entries.push_back(entry);
  }
  return entries;
}

}  // namespace

absl::Status CheckServerOptions(const ServerOptions& options) {
  NORMGRAD_RETURN_IF_ERROR(ValidateOptions(options));
  NORMGRAD_RETURN_IF_ERROR(MakeServerCredentials(options.security).status());
  return ParsePreloadEntries(options.preload).status();
}

NormGradServer::NormGradServer(const ServerOptions& options, std::unique_ptr<Backend> backend)
    : options_(options), backend_(std::move(backend)) {}

// Everything is checked (options, credentials, --preload entries) before the backend is made:
// a bad flag fails fast, without touching a GPU.
absl::StatusOr<std::unique_ptr<NormGradServer>> NormGradServer::Start(
    const ServerOptions& options, std::unique_ptr<Backend> backend) {
  NORMGRAD_RETURN_IF_ERROR(ValidateOptions(options));
  // A descriptor per connection and per region: the shell's soft limit (often 1024) is not a
  // server's. The sockets the server owns are bounded from what is in force afterwards.
  const uint64_t open_files = RaiseOpenFileLimit();
  NORMGRAD_ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ServerCredentials> credentials,
                            MakeServerCredentials(options.security));
  NORMGRAD_ASSIGN_OR_RETURN(const std::vector<PreloadEntry> preload,
                            ParsePreloadEntries(options.preload));
  if (backend == nullptr) {
    BackendOptions backend_options = options.backend;
    // The CUDA backend's staging pool stays within the in-flight budget (docs/operations.md).
    backend_options.max_staging_bytes = options.admission.max_inflight_bytes;
    NORMGRAD_ASSIGN_OR_RETURN(backend, CreateBackend(backend_options));
  }
  if (options.cuda_ipc && backend->DeviceUuid().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--cuda-ipc: the ", backend->Name(), " backend cannot open other processes' device "
        "memory (it needs the CUDA backend on a driver with cuIpcOpenMemHandle)"));
  }
  // From here on a failure returns through ~NormGradServer, which stops what was started.
  std::unique_ptr<NormGradServer> server(new NormGradServer(options, std::move(backend)));
  server->open_file_limit_ = open_files;
  server->AssembleService();
  NormGradServer* self = server.get();
  server->backend_->SetDeviceFailureHandler(
      [self](const absl::Status& reason) { self->FailDevice(reason); });
  server->PublishBackendMetrics();
  NORMGRAD_RETURN_IF_ERROR(server->StartMetricsEndpoint());
  NORMGRAD_RETURN_IF_ERROR(server->StartGrpcPort(credentials));
  NORMGRAD_RETURN_IF_ERROR(server->StartRegionSockets());
  NORMGRAD_RETURN_IF_ERROR(server->StartHealthPort());
  server->SetServing(false);
  server->StartWatchdog();
  server->StartDeviceWatchdog();
  NORMGRAD_RETURN_IF_ERROR(server->Preload(preload));
  server->SelfTest();
  server->SetServing(true);  // stays NOT_SERVING when the device is unhealthy
  return server;
}

void NormGradServer::AssembleService() {
  metrics_ = std::make_unique<MetricsRegistry>();
  DescribeServerMetrics(*metrics_);
  PtxServiceOptions ptx_options;
  ptx_options.cache.max_entries = options_.backend.cache_max_entries;
  ptx_options.cache.max_bytes = options_.backend.cache_max_bytes;
  ptx_options.nvjitlink_path = options_.nvjitlink_path;
  ptx_ = std::make_unique<PtxService>(ptx_options);
  admission_ = std::make_unique<AdmissionController>(options_.admission, metrics_.get());
  streams_ = std::make_unique<StreamRegistry>();
  const int threads = options_.worker_threads > 0
                          ? options_.worker_threads
                          : std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  pool_ = std::make_unique<ThreadPool>(threads);
  emit_ptx_pool_ = std::make_unique<ThreadPool>(options_.emit_ptx_threads);

  env_ = std::make_unique<ServiceEnv>();
  env_->config.version = NORMGRAD_VERSION;
  env_->config.batch_limits = options_.batch;
  env_->config.max_message_bytes = options_.max_message_bytes;
  env_->config.stream_idle_timeout = options_.stream_idle_timeout;
  env_->config.min_stream_bytes_per_second = options_.min_stream_bytes_per_second;
  env_->config.min_stream_rate_window = options_.min_stream_rate_window;
  env_->config.unix_allowed_uids = options_.unix_allowed_uids;
  env_->backend = backend_.get();
  env_->ptx = ptx_.get();
  env_->admission = admission_.get();
  env_->metrics = metrics_.get();
  env_->pool = pool_.get();
  env_->emit_ptx_pool = emit_ptx_pool_.get();
  env_->streams = streams_.get();
  unix_peers_ = std::make_unique<UnixPeers>();
  env_->unix_peers = unix_peers_.get();
  env_->cuda_ipc = options_.cuda_ipc;
  env_->max_cuda_ipc_handles = options_.backend.max_ipc_handles;
  if (options_.shared_memory) {
    Backend* backend = backend_.get();
    regions_ = std::make_unique<RegionRegistry>(
        options_.regions,
        HostMemoryHooks{[backend](void* base, uint64_t bytes) {
                          return backend->RegisterHostMemory(base, bytes);
                        },
                        [backend](void* base) { backend->UnregisterHostMemory(base); }});
    env_->regions = regions_.get();
  }
  service_ = std::make_unique<NormGradService>(env_.get());
}

void NormGradServer::PublishBackendMetrics() {
  const DeviceDescription d = backend_->Device();
  metrics_->SetGauge("normgrad_backend_info",
                     {{"backend", std::string(backend_->Name())},
                      {"device", d.name},
                      {"compute_capability",
                       absl::StrCat(d.compute_capability_major, ".", d.compute_capability_minor)},
                      {"driver_version", d.driver_version},
                      {"version", NORMGRAD_VERSION}},
                     1);
  metrics_->SetGauge("normgrad_device_memory_bytes", {}, static_cast<double>(d.total_memory_bytes));
  Backend* b = backend_.get();
  PtxService* ptx = ptx_.get();
  AdmissionController* admission = admission_.get();
  metrics_->AddCollector([this](MetricsRegistry& m) {
    m.SetCounter("normgrad_unix_refused_connections_total", {{"socket", "grpc"}, {"reason", "uid"}},
                 static_cast<double>(refused_grpc_peers_.load()));
  });
  metrics_->AddCollector([b, ptx, admission](MetricsRegistry& m) {
    CollectCache(m, "module", b->CacheStats());
    CollectCache(m, "ptx", ptx->CacheStats());
    m.SetGauge("normgrad_inflight_bytes", {}, static_cast<double>(admission->inflight_bytes()));
    m.SetGauge("normgrad_emit_ptx_queued", {}, admission->emit_ptx_calls());
    m.SetGauge("normgrad_emit_ptx_queued_bytes", {},
               static_cast<double>(admission->emit_ptx_bytes()));
    const ProcessMemory memory = ReadProcessMemory();
    m.SetGauge("normgrad_process_resident_bytes", {}, static_cast<double>(memory.resident_bytes));
    m.SetGauge("normgrad_process_heap_in_use_bytes", {},
               static_cast<double>(memory.heap_in_use_bytes));
    m.SetGauge("normgrad_process_heap_free_bytes", {}, static_cast<double>(memory.heap_free_bytes));
  });
  metrics_->SetGauge("normgrad_inflight_streams", {}, 0);
}

absl::Status NormGradServer::StartMetricsEndpoint() {
  if (options_.metrics_listen.empty()) return absl::OkStatus();
  int port;
  NORMGRAD_RETURN_IF_ERROR(
      SplitHostPort(options_.metrics_listen, "metrics-listen", &metrics_host_, &port));
  NORMGRAD_ASSIGN_OR_RETURN(
      metrics_http_,
      MetricsHttpServer::Start(options_.metrics_listen, metrics_.get(),
                               {options_.metrics_tls_cert_file, options_.metrics_tls_key_file}));
  metrics_port_ = metrics_http_->port();
  return absl::OkStatus();
}

absl::Status NormGradServer::StartGrpcPort(
    const std::shared_ptr<grpc::ServerCredentials>& credentials) {
  std::vector<ListenAddress> addresses;
  for (const std::string& text : options_.listen) {
    NORMGRAD_ASSIGN_OR_RETURN(ListenAddress a, ParseListenAddress(text));
    if (a.kind == ListenAddress::kUnix) NORMGRAD_RETURN_IF_ERROR(PrepareUnixSocketPath(a.path));
    addresses.push_back(std::move(a));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::vector<int> selected_ports(addresses.size(), 0);
  // Plaintext unix sockets are accepted here, for the peers' credentials (UnixGrpcListener);
  // with TLS gRPC listens on them itself.
  const bool accept_unix_here =
      options_.security.cert_file.empty() && UnixGrpcListener::Supported();
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (accept_unix_here && addresses[i].kind == ListenAddress::kUnix) continue;
    builder.AddListeningPort(addresses[i].text, credentials, &selected_ports[i]);
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  AddConnectionLimits(options_, builder);
  builder.RegisterService(service_.get());
  // Sockets are created owner-only, then opened up to --unix-socket-mode: no moment where a
  // wider mode than asked for lets someone connect.
  const mode_t old_umask = umask(0077);
  grpc_server_ = builder.BuildAndStart();
  umask(old_umask);
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (grpc_server_ != nullptr && accept_unix_here && addresses[i].kind == ListenAddress::kUnix) {
      absl::StatusOr<std::unique_ptr<UnixGrpcListener>> listener = UnixGrpcListener::Start(
          addresses[i].path, options_.unix_socket_mode, grpc_server_.get(), unix_peers_.get(),
          options_.unix_allowed_uids, &refused_grpc_peers_);
      if (listener.ok()) {
        unix_listeners_.push_back(*std::move(listener));
        selected_ports[i] = 1;  // listening
      }
    }
    if (grpc_server_ != nullptr && selected_ports[i] != 0) continue;
    unix_listeners_.clear();
    if (grpc_server_ != nullptr) {
      grpc_server_->Shutdown(std::chrono::system_clock::now());
      grpc_server_->Wait();
      grpc_server_.reset();
    }
    return absl::UnavailableError(absl::StrCat("--listen=", addresses[i].text,
                                               ": cannot listen there (address in use, not "
                                               "local, or the socket's directory is missing)"));
  }
  for (size_t i = 0; i < addresses.size(); ++i) {
    const ListenAddress& a = addresses[i];
    if (a.kind == ListenAddress::kTcp) {
      host_ = a.host;
      port_ = selected_ports[i];
      continue;
    }
    unix_paths_.push_back(a.path);
    unix_inodes_.push_back(UnixSocketInode(a.path));
    if (absl::Status s = SetUnixSocketMode(a.path, options_.unix_socket_mode); !s.ok()) {
      grpc_server_->Shutdown(std::chrono::system_clock::now());
      grpc_server_->Wait();
      grpc_server_.reset();
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status NormGradServer::StartRegionSockets() {
  if (regions_ == nullptr) return absl::OkStatus();
  RegionSocketOptions region_socket_options;
  region_socket_options.mode = options_.unix_socket_mode;
  region_socket_options.allowed_uids = options_.unix_allowed_uids;
  // A quarter of the descriptors for all region connections, half of that for one user.
  region_socket_options.max_connections = ConnectionBoundFor(open_file_limit_);
  region_socket_options.max_connections_per_user =
      std::max<uint32_t>(1, region_socket_options.max_connections / 2);
  region_socket_options.refused_peers = &refused_region_peers_;
  region_socket_options.refused_over_bound = &refused_region_over_bound_;
  for (const std::string& grpc_path : unix_paths_) {
    const std::string path = grpc_path + ".shm";
    absl::Status s = PrepareUnixSocketPath(path, SOCK_SEQPACKET);
    absl::StatusOr<std::unique_ptr<RegionSocket>> socket =
        s.ok() ? RegionSocket::Start(path, region_socket_options, regions_.get())
               : absl::StatusOr<std::unique_ptr<RegionSocket>>(s);
    if (!socket.ok()) {
      grpc_server_->Shutdown(std::chrono::system_clock::now());
      grpc_server_->Wait();
      grpc_server_.reset();
      return absl::Status(socket.status().code(),
                          absl::StrCat("--shared-memory: ", socket.status().message()));
    }
    region_sockets_.push_back(*std::move(socket));
  }
  RegionRegistry* regions = regions_.get();
  metrics_->AddCollector([this](MetricsRegistry& m) {
    m.SetCounter("normgrad_unix_refused_connections_total", {{"socket", "region"}, {"reason", "uid"}},
               static_cast<double>(refused_region_peers_.load()));
    m.SetCounter("normgrad_unix_refused_connections_total",
               {{"socket", "region"}, {"reason", "bound"}},
               static_cast<double>(refused_region_over_bound_.load()));
  });
  metrics_->AddCollector([regions](MetricsRegistry& m) {
    const RegionStats st = regions->Stats();
    m.SetGauge("normgrad_shm_regions", {}, static_cast<double>(st.regions));
    m.SetGauge("normgrad_shm_region_bytes", {}, static_cast<double>(st.bytes));
    m.SetGauge("normgrad_shm_registrations", {{"result", "ok"}},
               static_cast<double>(st.registered));
    m.SetGauge("normgrad_shm_registrations", {{"result", "refused"}},
               static_cast<double>(st.refused));
  });
  return absl::OkStatus();
}

absl::Status NormGradServer::StartHealthPort() {
  if (options_.health_listen.empty()) return absl::OkStatus();
  int port;
  NORMGRAD_RETURN_IF_ERROR(
      SplitHostPort(options_.health_listen, "health-listen", &health_host_, &port));
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<WithoutPlugins>());
  health_port_rejecter_ = std::make_unique<HealthPortRejecter>();
  builder.RegisterCallbackGenericService(health_port_rejecter_.get());
  int selected_port = 0;
  builder.AddListeningPort(options_.health_listen, grpc::InsecureServerCredentials(),
                           &selected_port);
  builder.SetMaxReceiveMessageSize(4096);  // a HealthCheckRequest is a service name
  AddConnectionLimits(options_, builder);
  health_server_ = builder.BuildAndStart();
  if (health_server_ == nullptr || selected_port == 0) {
    health_server_.reset();
    grpc_server_->Shutdown(std::chrono::system_clock::now());
    grpc_server_->Wait();
    grpc_server_.reset();
    return absl::UnavailableError(
        absl::StrCat("--health-listen=", options_.health_listen,
                     ": cannot listen there (address in use or not local)"));
  }
  health_port_ = selected_port;
  return absl::OkStatus();
}

void NormGradServer::StartWatchdog() {
  if (options_.stream_idle_timeout > absl::ZeroDuration() ||
      options_.min_stream_bytes_per_second > 0) {
    watchdog_ = std::thread([this] { RunWatchdog(); });
  }
}

absl::Status NormGradServer::Preload(const std::vector<PreloadEntry>& entries) {
  for (const PreloadEntry& entry : entries) {
    v1::EmitPtxRequest request;
    request.set_kernel(std::string(entry.kernel->EntryName()));
    request.set_hidden_dim(entry.config.hidden_dim);
    request.set_target(absl::StrCat("sm_", entry.config.target_sm));
    absl::Status st = ptx_->Emit(request).status();
    if (st.ok()) st = backend_->Preload(*entry.kernel, entry.config);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("--preload ", entry.kernel->EntryName(),
                                                  ":sm_", entry.config.target_sm, ":",
                                                  entry.config.hidden_dim, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

NormGradServer::~NormGradServer() { Shutdown(absl::ZeroDuration()); }

std::string NormGradServer::ReadyLine() const {
  const std::string metrics =
      metrics_port_ > 0 ? absl::StrCat(metrics_host_, ":", metrics_port_) : "off";
  const std::string grpc = port_ > 0 ? absl::StrCat(host_, ":", port_) : "off";
  std::string line =
      absl::StrCat("normgrad-server ready grpc=", grpc, " metrics=", metrics,
                   " backend=", backend_->Name(), " device=\"", backend_->Device().name, "\"");
  for (const std::string& path : unix_paths_) absl::StrAppend(&line, " unix=", path);
  for (const auto& socket : region_sockets_) absl::StrAppend(&line, " shm=", socket->path());
  if (health_port_ > 0) absl::StrAppend(&line, " health=", health_host_, ":", health_port_);
  if (!options_.security.cert_file.empty()) {
    absl::StrAppend(&line, options_.security.client_ca_file.empty() ? " tls=on" : " tls=mtls");
  }
  return line;
}

void NormGradServer::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(serving_mu_);
  serving = serving && env_->device_health.healthy();
  SetHealth(grpc_server_.get(), serving);
  SetHealth(health_server_.get(), serving);
  metrics_->SetGauge("normgrad_serving", {}, serving ? 1 : 0);
}

size_t NormGradServer::live_streams() const { return streams_->size(); }

absl::Status NormGradServer::device_health() const { return env_->device_health.reason(); }

void NormGradServer::SelfTest() {
  if (backend_->Name() == "cuda") {
    if (absl::Status s = RunDeviceSelfTest(*backend_); !s.ok()) {
      // A lost device has also called FailDevice (on_device_failure: the process exits).
      env_->device_health.MarkUnhealthy(
          absl::Status(s.code(), absl::StrCat("start-up self-test failed: ", s.message())));
    }
  }
  metrics_->SetGauge("normgrad_device_healthy", {}, env_->device_health.healthy() ? 1 : 0);
}

void NormGradServer::FailDevice(const absl::Status& reason) {
  env_->device_health.MarkUnhealthy(reason);
  metrics_->SetGauge("normgrad_device_healthy", {}, 0);
  SetServing(false);
  // Streams computing now get UNAVAILABLE from the backend, new ones from BackwardPipeline.
  if (options_.on_device_failure) options_.on_device_failure(reason);
}

void NormGradServer::StartDeviceWatchdog() {
  if (options_.device_timeout > absl::ZeroDuration()) {
    device_watchdog_ = std::thread([this] { RunDeviceWatchdog(); });
  }
}

// Polls the backend for work overdue by more than --device-timeout: the worker stuck in the
// driver cannot be interrupted, so the check runs here, and a failure it finds reaches
// FailDevice through the backend's handler.
void NormGradServer::RunDeviceWatchdog() {
  const absl::Duration bound = options_.device_timeout;
  const absl::Duration period = std::clamp(bound / 10, absl::Milliseconds(10), absl::Seconds(1));
  std::unique_lock<std::mutex> lock(watchdog_mu_);
  while (!stopping_) {
    watchdog_wake_.wait_for(lock, absl::ToChronoMilliseconds(period), [this] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    const bool failed = !backend_->CheckDevice(bound).ok();
    lock.lock();
    if (failed) break;  // reported once; nothing more to watch
  }
}

void NormGradServer::RunWatchdog() {
  const absl::Duration timeout = options_.stream_idle_timeout;
  absl::Duration shortest = options_.min_stream_bytes_per_second > 0
                                ? options_.min_stream_rate_window
                                : absl::InfiniteDuration();
  if (timeout > absl::ZeroDuration()) shortest = std::min(shortest, timeout);
  const absl::Duration period =
      std::clamp(shortest / 4, absl::Milliseconds(10), absl::Seconds(1));
  std::unique_lock<std::mutex> lock(watchdog_mu_);
  while (!stopping_) {
    watchdog_wake_.wait_for(lock, absl::ToChronoMilliseconds(period), [this] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    streams_->CheckIdle(absl::Now(), timeout);
    lock.lock();
  }
}

void NormGradServer::Shutdown(absl::Duration grace) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (grpc_server_ != nullptr) {
    env_->draining.store(true);
    SetServing(false);
    const absl::Time deadline = absl::Now() + grace;
    // 1. The work admitted before the drain (streams, EmitPtx calls) runs to its end, up to the
    //    deadline. Calls arriving meanwhile are answered UNAVAILABLE at once by the draining
    //    service (clients retry them elsewhere) and are not waited for: clients that keep
    //    retrying on the open connection cannot hold the drain open. Polled: the counts live
    //    in the admission controller, and 5 ms is nothing against a drain.
    while ((env_->admission->active_streams() > 0 || env_->admission->emit_ptx_calls() > 0) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    // 2. GOAWAY, and the listeners close. The calls the transport accepted meanwhile finish
    //    (the service refuses them at once) within kLateCallGrace; gRPC then cancels what is
    //    left (the calls it took but never handed to the service wait for their own deadlines
    //    otherwise, and the process would linger until that client's deadline). A stream still
    //    running when the grace ran out is cancelled here too; its client sees UNAVAILABLE
    //    ("Cancelling all calls"), which it retries. (Shutdown(now) cancelled the late arrivals
    //    before the service saw them: their clients saw CANCELLED, which they do not retry.)
    for (auto& listener : unix_listeners_) listener->Stop();
    grpc_server_->Shutdown(absl::ToChronoTime(std::min(deadline, absl::Now() + kLateCallGrace)));
    streams_->WaitUntilEmpty(absl::InfiniteFuture());  // workers finish their current chunk
  }
  {
    std::lock_guard<std::mutex> wl(watchdog_mu_);
    stopping_ = true;
  }
  watchdog_wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (device_watchdog_.joinable()) device_watchdog_.join();
  if (metrics_http_ != nullptr) metrics_http_->Stop();
  emit_ptx_pool_.reset();  // calls still queued were answered before grpc's Shutdown returned
  pool_.reset();  // runs what is queued (nothing but finished streams' leftovers), joins
  if (grpc_server_ != nullptr) grpc_server_->Wait();
  for (size_t i = 0; i < unix_paths_.size(); ++i) RemoveUnixSocket(unix_paths_[i], unix_inodes_[i]);
  region_sockets_.clear();  // closes the region connections: their regions are released
  // The health port answers NOT_SERVING until the main port is gone, then closes.
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
}

}  // namespace normgrad::server
