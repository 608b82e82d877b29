// A unix-socket listener for the gRPC server that knows who connects: it accepts each
// connection itself (server/unix_socket: the allow-list, pauses when descriptors run out), reads
// the peer's credentials (SO_PEERCRED: pid, uid, gid) into UnixPeers, and only then hands the
// connection to gRPC (grpc::AddInsecureChannelFromFd), which names its
// calls' peer "fd:N". gRPC's own unix listener gives the service no way to learn the peer's
// credentials. Used for every --listen=unix:/PATH unless the gRPC port is TLS (a connection
// handed over this way is plaintext; unix sockets with TLS stay gRPC's).
//
//   auto l = UnixGrpcListener::Start(path, 0660, grpc_server, &peers);   // after BuildAndStart
//   ...
//   (*l)->Stop();   // no new connections; those accepted stay with gRPC until it shuts down
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
#include "server/service/unix_peers.h"
#include "server/unix_socket/unix_listen_socket.h"

namespace normgrad::server {

class UnixGrpcListener {
 public:
  // True when this gRPC build can take connections from descriptors.
  static bool Supported();

  // Binds and listens on `path` (which must be free: the caller removes a stale socket) with
  // file mode `mode` (never wider meanwhile), and starts accepting for `server`. A peer whose
  // uid `allowed_uids` does not list (when it is not empty) is closed at accept: it reaches no
  // method at all, health and reflection included.
  static absl::StatusOr<std::unique_ptr<UnixGrpcListener>> Start(
      const std::string& path, mode_t mode, grpc::Server* server, UnixPeers* peers,
      std::vector<uint32_t> allowed_uids = {}, std::atomic<uint64_t>* refused = nullptr);
  ~UnixGrpcListener();  // Stop()
  void Stop();

 private:
  explicit UnixGrpcListener(std::unique_ptr<UnixListenSocket> socket)
      : socket_(std::move(socket)) {}

  std::unique_ptr<UnixListenSocket> socket_;
};

}  // namespace normgrad::server
