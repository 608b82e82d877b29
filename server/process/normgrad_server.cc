#include "server/process/normgrad_server.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_http_server.h"
#include "server/process/device_self_test.h"
#include "server/process/health_port.h"
#include "server/process/listen_address.h"
#include "server/process/process_memory.h"
#include "server/process/server_metrics.h"
#include "server/process/watchdogs.h"
#include "server/ptx/ptx_service.h"
#include "server/service/normgrad_service.h"
#include "server/shared_memory/region_socket.h"
#include "server/thread_pool/thread_pool.h"
#include "server/listen_socket/acceptor.h"

#ifndef NORMGRAD_VERSION
#define NORMGRAD_VERSION "0.0.0"
#endif

namespace normgrad::server {
namespace {

// How long a draining server's gRPC shutdown lets the calls that arrived during the drain finish
// (the service answers them at once) before it cancels what is left (Shutdown).
constexpr absl::Duration kLateCallGrace = absl::Milliseconds(500);
// Visits (one a second) at which connections wait on a TLS port before its listener counts as
// dead (ListenerWatchdog).
constexpr int kListenerDeadVisits = 10;

}  // namespace

NormGradServer::NormGradServer(const ServerOptions& options, std::unique_ptr<Backend> backend)
    : options_(options), backend_(std::move(backend)) {}

// Everything is checked (options, credentials, --preload entries) before the backend is made:
// a bad flag fails fast, without touching a GPU.
absl::StatusOr<std::unique_ptr<NormGradServer>> NormGradServer::Start(
    const ServerOptions& options, std::unique_ptr<Backend> backend) {
  NORMGRAD_RETURN_IF_ERROR(CheckServerOptions(options));
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
  if (options.cuda_ipc && IpcDeviceUuid(*backend).empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--cuda-ipc: the ", backend->Name(), " backend cannot open other processes' device "
        "memory (it needs the CUDA backend on a driver with cuIpcOpenMemHandle)"));
  }
  // From here on a failure returns through ~NormGradServer, which stops what was started.
  std::unique_ptr<NormGradServer> server(new NormGradServer(options, std::move(backend)));
  server->open_file_limit_ = open_files;
  server->AssembleService();
  NormGradServer* self = server.get();
  if (DeviceBackend* device = server->backend_->device()) {
    device->SetFailureHandler([self](const absl::Status& reason) { self->FailDevice(reason); });
  }
  server->PublishBackendMetrics();
  NORMGRAD_RETURN_IF_ERROR(server->StartMetricsEndpoint());
  NORMGRAD_RETURN_IF_ERROR(server->StartGrpcPort(credentials));
  NORMGRAD_RETURN_IF_ERROR(server->StartRegionSockets());
  NORMGRAD_RETURN_IF_ERROR(server->StartHealthPort());
  server->SetServing(false);
  server->StartWatchdogs();
  NORMGRAD_RETURN_IF_ERROR(server->Preload(preload));
  server->SelfTest();
  server->SetServing(true);  // stays NOT_SERVING when the device is unhealthy
  return server;
}

void NormGradServer::AssembleService() {
  metrics_ = std::make_unique<MetricsRegistry>();
  server_metrics_ = std::make_unique<ServerMetrics>(*metrics_);
  service_metrics_ = std::make_unique<ServiceMetrics>(*metrics_);
  PtxServiceOptions ptx_options;
  ptx_options.cache.max_entries = options_.backend.cache_max_entries;
  ptx_options.cache.max_bytes = options_.backend.cache_max_bytes;
  ptx_options.nvjitlink_path = options_.nvjitlink_path;
  ptx_ = std::make_unique<PtxService>(ptx_options);
  admission_ = std::make_unique<AdmissionController>(options_.admission, service_metrics_.get());
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
  env_->metrics = service_metrics_.get();
  env_->pool = pool_.get();
  env_->emit_ptx_pool = emit_ptx_pool_.get();
  env_->streams = streams_.get();
  accepted_peers_ = std::make_unique<AcceptedPeers>();
  env_->accepted_peers = accepted_peers_.get();
  env_->cuda_ipc = options_.cuda_ipc;
  env_->max_cuda_ipc_handles = options_.backend.max_ipc_handles;
  if (options_.shared_memory) {
    // A backend with a device registers the regions with its driver; one without reads them as
    // they are.
    HostMemoryHooks hooks;
    if (DeviceBackend* device = backend_->device()) {
      hooks = HostMemoryHooks{
          [device](void* base, uint64_t bytes) { return device->RegisterHostMemory(base, bytes); },
          [device](void* base) { device->UnregisterHostMemory(base); }};
    }
    regions_ = std::make_unique<RegionRegistry>(options_.regions, std::move(hooks));
    env_->regions = regions_.get();
  }
  service_ = std::make_unique<NormGradService>(env_.get());
}

void NormGradServer::PublishBackendMetrics() {
  server_metrics_->PublishBackend(*backend_, NORMGRAD_VERSION);
  const ServerMetrics* server_metrics = server_metrics_.get();
  const ServiceMetrics* service_metrics = service_metrics_.get();
  metrics_->AddCollector([this, server_metrics](MetricsRegistry&) {
    server_metrics->unix_refused_connections.Set({{"socket", "grpc"}, {"reason", "uid"}},
                                                 static_cast<double>(refused_grpc_peers_.load()));
  });
  Backend* b = backend_.get();
  PtxService* ptx = ptx_.get();
  AdmissionController* admission = admission_.get();
  metrics_->AddCollector([=](MetricsRegistry&) {
    server_metrics->CollectCache("module", b->CacheStats());
    server_metrics->CollectCache("ptx", ptx->CacheStats());
    server_metrics->inflight_bytes.Set(static_cast<double>(admission->inflight_bytes()));
    service_metrics->emit_ptx_queued.Set(admission->emit_ptx_calls());
    service_metrics->emit_ptx_queued_bytes.Set(static_cast<double>(admission->emit_ptx_bytes()));
    server_metrics->CollectProcessMemory(ReadProcessMemory());
  });
  service_metrics_->inflight_streams.Set(0);
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
  // Plaintext listeners accept here and hand each connection to gRPC (GrpcListener): unix
  // sockets for the peers' credentials, TCP to survive running out of descriptors. With TLS
  // gRPC listens on them itself.
  const bool accept_here = options_.security.cert_file.empty() && GrpcListener::Supported();
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (accept_here) continue;
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
    const ListenAddress& a = addresses[i];
    if (grpc_server_ != nullptr && accept_here) {
      absl::StatusOr<std::unique_ptr<GrpcListener>> listener =
          a.kind == ListenAddress::kUnix
              ? GrpcListener::StartUnix(a.path, options_.unix_socket_mode, grpc_server_.get(),
                                        accepted_peers_.get(), options_.unix_allowed_uids,
                                        &refused_grpc_peers_)
              : GrpcListener::StartTcp(a.host, a.port, grpc_server_.get(), accepted_peers_.get(),
                                       absl::StrCat("--listen=", a.text));
      if (listener.ok()) {
        selected_ports[i] = a.kind == ListenAddress::kUnix ? 1 : (*listener)->port();
        listeners_.push_back(*std::move(listener));
      }
    }
    if (grpc_server_ != nullptr && selected_ports[i] != 0) continue;
    listeners_.clear();
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
  const ServerMetrics* server_metrics = server_metrics_.get();
  metrics_->AddCollector([this, server_metrics, regions](MetricsRegistry&) {
    server_metrics->unix_refused_connections.Set(
        {{"socket", "region"}, {"reason", "uid"}},
        static_cast<double>(refused_region_peers_.load()));
    server_metrics->unix_refused_connections.Set(
        {{"socket", "region"}, {"reason", "bound"}},
        static_cast<double>(refused_region_over_bound_.load()));
    server_metrics->CollectRegions(regions->Stats());
  });
  return absl::OkStatus();
}

absl::Status NormGradServer::StartHealthPort() {
  if (options_.health_listen.empty()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<HealthPort>> health = HealthPort::Start(options_);
  if (!health.ok()) {
    grpc_server_->Shutdown(std::chrono::system_clock::now());
    grpc_server_->Wait();
    grpc_server_.reset();
    return health.status();
  }
  health_port_ = *std::move(health);
  return absl::OkStatus();
}

void NormGradServer::StartWatchdogs() {
  if (options_.stream_idle_timeout > absl::ZeroDuration() ||
      options_.min_stream_bytes_per_second > 0) {
    StreamRegistry* streams = streams_.get();
    const absl::Duration timeout = options_.stream_idle_timeout;
    stream_watchdog_ = std::make_unique<PeriodicTask>(StreamWatchdogPeriod(options_), [=] {
      streams->CheckIdle(absl::Now(), timeout);
      return true;
    });
  }
  DeviceBackend* device = backend_->device();
  if (options_.device_timeout > absl::ZeroDuration() && device != nullptr) {
    // A failure the backend finds reaches FailDevice through its handler, once: nothing more
    // to watch after it.
    const absl::Duration bound = options_.device_timeout;
    device_watchdog_ = std::make_unique<PeriodicTask>(
        DeviceWatchdogPeriod(bound), [=] { return device->CheckDevice(bound).ok(); });
  }
  const bool grpc_listens_on_tcp =
      !options_.security.cert_file.empty() || !GrpcListener::Supported();
  if (grpc_listens_on_tcp && port_ > 0) {
    auto watchdog = std::make_shared<ListenerWatchdog>(port_, kListenerDeadVisits);
    listener_watchdog_ = std::make_unique<PeriodicTask>(absl::Seconds(1), [this, watchdog] {
      if (watchdog->Visit()) return true;
      std::fprintf(stderr,
                   "normgrad-server: --listen=%s:%d: connections have waited %d s to be "
                   "accepted: gRPC's accept loop has stopped (it ends when accept4 runs out of "
                   "descriptors); health is NOT_SERVING from now on: restart this replica\n",
                   host_.c_str(), port_, kListenerDeadVisits);
      listener_dead_.store(true);
      SetServing(false);
      return false;
    });
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
  if (health_port_ != nullptr) {
    absl::StrAppend(&line, " health=", health_port_->host(), ":", health_port_->port());
  }
  if (!options_.security.cert_file.empty()) {
    absl::StrAppend(&line, options_.security.client_ca_file.empty() ? " tls=on" : " tls=mtls");
  }
  return line;
}

void NormGradServer::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(serving_mu_);
  serving = serving && env_->device_health.healthy() && !listener_dead_.load();
  SetHealth(grpc_server_.get(), serving);
  if (health_port_ != nullptr) SetHealth(health_port_->server(), serving);
  server_metrics_->serving.Set(serving ? 1 : 0);
}

int NormGradServer::health_port() const {
  return health_port_ != nullptr ? health_port_->port() : 0;
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
  server_metrics_->device_healthy.Set(env_->device_health.healthy() ? 1 : 0);
}

void NormGradServer::FailDevice(const absl::Status& reason) {
  env_->device_health.MarkUnhealthy(reason);
  server_metrics_->device_healthy.Set(0);
  SetServing(false);
  // Streams computing now get UNAVAILABLE from the backend, new ones from the service.
  if (options_.on_device_failure) options_.on_device_failure(reason);
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
    for (auto& listener : listeners_) listener->Stop();
    grpc_server_->Shutdown(absl::ToChronoTime(std::min(deadline, absl::Now() + kLateCallGrace)));
    streams_->WaitUntilEmpty(absl::InfiniteFuture());  // workers finish their current chunk
  }
  if (stream_watchdog_ != nullptr) stream_watchdog_->Stop();
  if (device_watchdog_ != nullptr) device_watchdog_->Stop();
  if (listener_watchdog_ != nullptr) listener_watchdog_->Stop();
  if (metrics_http_ != nullptr) metrics_http_->Stop();
  emit_ptx_pool_.reset();  // calls still queued were answered before grpc's Shutdown returned
  pool_.reset();  // runs what is queued (nothing but finished streams' leftovers), joins
  if (grpc_server_ != nullptr) grpc_server_->Wait();
  for (size_t i = 0; i < unix_paths_.size(); ++i) RemoveUnixSocket(unix_paths_[i], unix_inodes_[i]);
  region_sockets_.clear();  // closes the region connections: their regions are released
  // The health port answers NOT_SERVING until the main port is gone, then closes.
  if (health_port_ != nullptr) health_port_->Shutdown();
}

}  // namespace normgrad::server
