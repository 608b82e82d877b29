// Who is on the other end of each connection the server accepted itself and handed to gRPC
// (server/process/grpc_listener.h), by the connection's descriptor, which gRPC names in the
// call's peer string ("fd:17"): a unix peer's credentials (SO_PEERCRED, read at accept), a TCP
// peer's address. The service takes a unix client's identity from the credentials ("uid:1000": a
// per-client share counts one user's processes together, and no user can take another's share),
// and a TCP client's from its address, as if gRPC had accepted the connection itself.
//
//   peers.Set(fd, {pid, uid, gid});             // unix, at accept, before gRPC sees the connection
//   peers.SetTcp(fd, "ipv4:10.0.0.7:41234");    // TCP, likewise
//   std::optional<PeerCredentials> c = peers.Find(context->peer());
//   std::string address = peers.Address(context->peer());   // "ipv4:10.0.0.7:41234"
//
// A descriptor number is reused only after its connection closed, and Set for the new
// connection comes before any call on it: a call always finds its own connection's entry.
// Thread-safe.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
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

class AcceptedPeers {
 public:
  // A unix-socket connection and its peer's credentials.
  void Set(int fd, const PeerCredentials& credentials);
  // A TCP connection, its peer's address in gRPC's words (TcpPeerAddress) and, for a loopback
  // peer, the uid that owns its socket (read once, at accept).
  void SetTcp(int fd, std::string address, std::optional<uint32_t> loopback_uid = std::nullopt);
  // The credentials of the unix connection gRPC names `peer` ("fd:N"); nullopt for any other.
  std::optional<PeerCredentials> Find(absl::string_view peer) const;
  // The address of the TCP connection gRPC names `peer` ("fd:N"), as gRPC names a connection it
  // accepted itself ("ipv4:10.0.0.7:41234"); `peer` unchanged for any other.
  std::string Address(absl::string_view peer) const;
  // The uid owning the loopback peer of the TCP connection gRPC names `peer` ("fd:N"); nullopt
  // for any other.
  std::optional<uint32_t> LoopbackUid(absl::string_view peer) const;

 private:
  struct Entry {
    std::optional<PeerCredentials> credentials;  // unix
    std::string address;                         // TCP
    std::optional<uint32_t> loopback_uid;        // TCP, a loopback peer
  };
  std::optional<Entry> EntryOf(absl::string_view peer) const;

  mutable std::mutex mu_;
  absl::flat_hash_map<int, Entry> by_fd_;  // guarded by mu_
};

// "uid:1000 (pid 4242)" for logs and messages.
std::string DescribePeer(const PeerCredentials& c);

// A TCP peer's address as gRPC writes it in a call's peer string: "ipv4:10.0.0.7:41234",
// "ipv6:[2001:db8::1]:41234" (an IPv4-mapped IPv6 address as IPv4). Empty for other families.
std::string TcpPeerAddress(const sockaddr* address, socklen_t address_len);

}  // namespace normgrad::server
