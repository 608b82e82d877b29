// A unix-socket listener for the gRPC server that knows who connects: it accepts each
// connection itself, reads the peer's credentials (SO_PEERCRED: pid, uid, gid) into UnixPeers,
// and only then hands the connection to gRPC (grpc::AddInsecureChannelFromFd), which names its
// calls' peer "fd:N". gRPC's own unix listener gives the service no way to learn the peer's
// credentials. Used for every --listen=unix:/PATH unless the gRPC port is TLS (a connection
// handed over this way is plaintext; unix sockets with TLS stay gRPC's).
//
//   auto l = UnixGrpcListener::Start(path, 0660, grpc_server, &peers);   // after BuildAndStart
//   ...
//   (*l)->Stop();   // no new connections; those accepted stay with gRPC until it shuts down
#ifndef NORMGRAD_SERVER_PROCESS_UNIX_GRPC_LISTENER_H_
#define NORMGRAD_SERVER_PROCESS_UNIX_GRPC_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "server/service/unix_peers.h"

namespace normgrad::server {

class UnixGrpcListener {
 public:
  // True when this gRPC build can take connections from descriptors.
  static bool Supported();

  // Binds and listens on `path` (which must be free: the caller removes a stale socket) with
  // file mode `mode` (never wider meanwhile), and starts accepting for `server`.
  static absl::StatusOr<std::unique_ptr<UnixGrpcListener>> Start(const std::string& path,
                                                                 mode_t mode, grpc::Server* server,
                                                                 UnixPeers* peers);
  ~UnixGrpcListener();  // Stop()
  void Stop();

 private:
  UnixGrpcListener(int listen_fd, int wake_fd, grpc::Server* server, UnixPeers* peers)
      : listen_fd_(listen_fd), wake_fd_(wake_fd), server_(server), peers_(peers) {}
  void Run();

  const int listen_fd_;
  const int wake_fd_;  // an eventfd: Stop writes it to end Run
  grpc::Server* const server_;
  UnixPeers* const peers_;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_PROCESS_UNIX_GRPC_LISTENER_H_
