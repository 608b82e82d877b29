// Who is on the other end of each unix-socket connection the server accepted itself
// (server/process/unix_grpc_listener.h): the credentials the kernel gave at accept (SO_PEERCRED),
// by the connection's descriptor, which gRPC names in the call's peer string ("fd:17"). The
// service takes a unix client's identity from it ("uid:1000": a per-client share counts one
// user's processes together, and no user can take another's share), and says who was refused.
//
//   peers.Set(fd, {pid, uid, gid});             // at accept, before gRPC sees the connection
//   std::optional<PeerCredentials> c = peers.Find(context->peer());
//
// A descriptor number is reused only after its connection closed, and Set for the new
// connection comes before any call on it: a call always finds its own connection's entry.
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <mutex>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"

namespace normgrad::server {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class UnixPeers {
 public:
  void Set(int fd, const PeerCredentials& credentials);
  // The credentials of the connection gRPC names `peer` ("fd:N"); nullopt for any other peer.
  std::optional<PeerCredentials> Find(absl::string_view peer) const;

 private:
  mutable std::mutex mu_;
  absl::flat_hash_map<int, PeerCredentials> by_fd_;  // guarded by mu_
};

// "uid:1000 (pid 4242)" for logs and messages.
std::string DescribePeer(const PeerCredentials& c);

}  // namespace normgrad::server
