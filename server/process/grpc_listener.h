// Listeners for a gRPC server that accept each connection themselves and only then hand it to
// gRPC (grpc::AddInsecureChannelFromFd, which names its calls' peer "fd:N"):
// - unix sockets, to know who connects: the peer's credentials (SO_PEERCRED: pid, uid, gid) go
//   into AcceptedPeers, and the uid allow-list closes a refused peer at accept. gRPC's own unix
//   listener gives the service no way to learn them.
// - plaintext TCP, to survive running out of descriptors: gRPC 1.51's own TCP accept loop stops
//   for good at the first accept4 that fails with EMFILE ("Failed accept4: Too many open
//   files"), and the port stays dead until a restart. Here accepting pauses and resumes
//   (server/listen_socket/acceptor.h), and the peer's address goes into AcceptedPeers so that
//   the service names the caller as gRPC would have ("ipv4:10.0.0.7:41234").
// Both run on server/listen_socket's sockets, one thread each. A connection handed over this way
// is plaintext: with TLS, gRPC listens itself.
//
//   auto u = GrpcListener::StartUnix(path, 0660, grpc_server, &peers);    // after BuildAndStart
//   auto t = GrpcListener::StartTcp("0.0.0.0", 50051, grpc_server, &peers, "--listen=...");
//   (*t)->port();  // the port chosen when 0 was asked for
//   (*u)->Stop();  // no new connections; those accepted stay with gRPC until it shuts down
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "server/listen_socket/listen_socket.h"
#include "server/service/accepted_peers.h"

namespace normgrad::server {

class GrpcListener {
 public:
  // True when this gRPC build can take connections from descriptors.
  static bool Supported();

  // Binds and listens on `path` (which must be free: the caller removes a stale socket) with
  // file mode `mode` (never wider meanwhile), and starts accepting for `server`. A peer whose
  // uid `allowed_uids` does not list (when it is not empty) is closed at accept: it reaches no
  // method at all, health and reflection included.
  static absl::StatusOr<std::unique_ptr<GrpcListener>> StartUnix(
      const std::string& path, mode_t mode, grpc::Server* server, AcceptedPeers* peers,
      std::vector<uint32_t> allowed_uids = {}, std::atomic<uint64_t>* refused = nullptr);

  // Binds and listens on every address `host` resolves to ("0.0.0.0", "::", "localhost", ...)
  // at `port` (0: one port the kernel picks, the same for all), and starts accepting for
  // `server`. `peers` may be null (the health port names no caller). `what` names the listener
  // in errors and the log ("--listen=0.0.0.0:50051"). UNAVAILABLE when an address cannot be
  // bound (in use, not local).
  static absl::StatusOr<std::unique_ptr<GrpcListener>> StartTcp(const std::string& host,
                                                                int port, grpc::Server* server,
                                                                AcceptedPeers* peers,
                                                                const std::string& what);
  ~GrpcListener();  // Stop()
  void Stop();

  int port() const;  // TCP: the port listened on; 0 for a unix socket

 private:
  GrpcListener() = default;

  std::vector<std::unique_ptr<ListenSocket>> sockets_;
};

}  // namespace normgrad::server
