// The gRPC health of the server: SetHealth sets grpc.health.v1.Health's status (the server's and
// the NormGrad service's) on a gRPC server, and HealthPort is the optional second port
// (--health-listen): always plaintext, serving the health service only (every other method is
// UNIMPLEMENTED), for probes that cannot speak the main port's TLS. Both ports share the
// per-connection bounds of AddConnectionLimits.
//
//   absl::StatusOr<std::unique_ptr<HealthPort>> h = HealthPort::Start(options);  // port 0: any
//   SetHealth((*h)->server(), true);
//   (*h)->Shutdown();  // after the main port is gone
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/process/grpc_listener.h"
#include "server/process/server_options.h"

namespace grpc {
class CallbackGenericService;
class Server;
class ServerBuilder;
}  // namespace grpc

namespace normgrad::server {

// Per-connection bounds of a gRPC port: concurrent calls, keepalive, ping-flood strikes, metadata
// size; a taken port fails instead of being shared (no SO_REUSEPORT).
void AddConnectionLimits(const ServerOptions& options, grpc::ServerBuilder& builder);

// SERVING or NOT_SERVING for "" and normgrad.v1.NormGrad; nothing when `server` is null.
void SetHealth(grpc::Server* server, bool serving);

class HealthPort {
 public:
  // Listens on options.health_listen (HOST:PORT). UNAVAILABLE naming the flag when it cannot.
  static absl::StatusOr<std::unique_ptr<HealthPort>> Start(const ServerOptions& options);
  ~HealthPort();  // Shutdown()

  HealthPort(const HealthPort&) = delete;
  HealthPort& operator=(const HealthPort&) = delete;

  grpc::Server* server() { return server_.get(); }
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  // Closes the port at once. Idempotent.
  void Shutdown();

 private:
  HealthPort() = default;

  std::unique_ptr<grpc::CallbackGenericService> rejecter_;  // every method but health
  std::unique_ptr<GrpcListener> listener_;  // accepts for server_; Shutdown stops it first
  std::unique_ptr<grpc::Server> server_;
  std::string host_;
  int port_ = 0;
};

}  // namespace normgrad::server
