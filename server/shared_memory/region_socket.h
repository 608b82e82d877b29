// The region socket: where co-located clients register shared-memory regions. A unix
// SOCK_SEQPACKET socket (message boundaries kept, file descriptors passed with SCM_RIGHTS), one
// thread polling it and its connections. Each message is a normgrad.v1.RegionRequest, each answer a
// RegionReply carrying the request's request_id; a region registered on a connection is released
// when that connection closes, so a client that dies leaves nothing behind. Peers that
// --unix-allowed-uids does not list are closed at accept; connections are bounded in all and
// per user, and a user's regions by the registry's per-user share.
//
//   absl::StatusOr<std::unique_ptr<RegionSocket>> s =
//       RegionSocket::Start("/run/normgrad/grpc.sock.shm", {.mode = 0660}, &registry);
//   ...
//   (*s)->Stop();   // closes every connection (their regions are released) and the socket
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/shared_memory/region_registry.h"
#include "server/listen_socket/listen_socket.h"

namespace normgrad::server {

struct RegionSocketOptions {
  mode_t mode = 0660;  // the socket file's mode
  // --unix-allowed-uids: a peer whose uid it does not list is closed at accept. Empty: anyone
  // who can open the socket file.
  std::vector<uint32_t> allowed_uids;
  // Connections at once, all users together and one user's share; more are accepted and closed
  // at once (the client sees its connection reset). The process derives them from its
  // descriptor limit (ConnectionBoundFor).
  uint32_t max_connections = 256;
  uint32_t max_connections_per_user = 128;
  // Optional counters (outliving the socket), for metrics: peers the allow-list refused, and
  // connections closed at accept past a bound.
  std::atomic<uint64_t>* refused_peers = nullptr;
  std::atomic<uint64_t>* refused_over_bound = nullptr;
};

class RegionSocket {
 public:
  // Binds and listens on `path` (which must be free: the caller removes a stale socket).
  static absl::StatusOr<std::unique_ptr<RegionSocket>> Start(const std::string& path,
                                                             const RegionSocketOptions& options,
                                                             RegionRegistry* registry);
  ~RegionSocket();  // Stop()
  void Stop();

  const std::string& path() const { return socket_->path(); }

 private:
  RegionSocket(std::unique_ptr<ListenSocket> socket, RegionRegistry* registry,
               RegionSocketOptions options);
  void Run();

  const RegionSocketOptions options_;
  RegionRegistry* const registry_;
  std::unique_ptr<ListenSocket> socket_;
};

}  // namespace normgrad::server
