#include "server/process/health_port.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/metrics/metrics_http_server.h"
#include "server/process/grpc_listener.h"

namespace normgrad::server {
namespace {

constexpr char kServiceName[] = "normgrad.v1.NormGrad";

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

}  // namespace

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
  // No BDP probing: each stream's receive window stays at the message being read plus gRPC's
  // 64 KiB lookahead, so what the transport buffers is bounded by --max-streams x
  // --max-message-bytes (docs/operations.md). With probing the windows grew to several MiB per
  // stream and the server's peak memory rose by 50-115 MiB on the same load; large-batch
  // throughput over loopback TCP did not drop (docs/benchmarks.md).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
}

void SetHealth(grpc::Server* server, bool serving) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus("", serving);
    health->SetServingStatus(kServiceName, serving);
  }
}

absl::StatusOr<std::unique_ptr<HealthPort>> HealthPort::Start(const ServerOptions& options) {
  std::unique_ptr<HealthPort> port(new HealthPort());
  int wanted_port;
  NORMGRAD_RETURN_IF_ERROR(
      SplitHostPort(options.health_listen, "health-listen", &port->host_, &wanted_port));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<WithoutPlugins>());
  port->rejecter_ = std::make_unique<HealthPortRejecter>();
  builder.RegisterCallbackGenericService(port->rejecter_.get());
  // Accepted here where gRPC can take connections from descriptors (GrpcListener: accepting
  // survives running out of descriptors, which gRPC's own TCP listener does not).
  const bool accept_here = GrpcListener::Supported();
  int selected_port = 0;
  if (!accept_here) {
    builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                             &selected_port);
  }
  builder.SetMaxReceiveMessageSize(4096);  // a HealthCheckRequest is a service name
  AddConnectionLimits(options, builder);
  port->server_ = builder.BuildAndStart();
  const std::string what = absl::StrCat("--health-listen=", options.health_listen);
  if (port->server_ != nullptr && accept_here) {
    absl::StatusOr<std::unique_ptr<GrpcListener>> listener =
        GrpcListener::StartTcp(port->host_, wanted_port, port->server_.get(), nullptr, what);
    if (listener.ok()) {
      selected_port = (*listener)->port();
      port->listener_ = *std::move(listener);
    }
  }
  if (port->server_ == nullptr || selected_port == 0) {
    port->Shutdown();
    return absl::UnavailableError(
        absl::StrCat(what, ": cannot listen there (address in use or not local)"));
  }
  port->port_ = selected_port;
  return port;
}

HealthPort::~HealthPort() { Shutdown(); }

void HealthPort::Shutdown() {
  if (listener_ != nullptr) listener_->Stop();
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  server_.reset();
}

}  // namespace normgrad::server
