// The user that owns the other end of an accepted loopback TCP connection, asked of the kernel's
// socket diagnostics (NETLINK_SOCK_DIAG, one exact lookup by the connection's addresses and
// ports: tens of microseconds). /proc/net/tcp says the same, but reading it walks the whole
// connection table: milliseconds on a large machine even with a handful of sockets.
//
//   std::optional<uint32_t> uid = LoopbackPeerUidOf(accepted_fd);   // nullopt: not loopback
#pragma once

#include <cstdint>
#include <optional>

namespace normgrad::server {

// The uid of the socket at the other end of the TCP connection `fd` when that end is a loopback
// address of this host (127.0.0.0/8, ::1, or an IPv4-mapped 127.x) and the kernel finds it;
// nullopt otherwise.
std::optional<uint32_t> LoopbackPeerUidOf(int fd);

}  // namespace normgrad::server
