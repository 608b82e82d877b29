#include "server/listen_socket/peer_uid.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>

namespace normgrad::server {
namespace {

// One end of a connection as sock_diag names it: the family, the address (4 or 16 bytes, network
// order) and the port (network order). An IPv4-mapped IPv6 address is given as IPv4: the other
// end of such a connection is an IPv4 socket.
struct End {
  int family = 0;
  uint8_t addr[16] = {};
  uint16_t port = 0;
  bool loopback = false;
};

bool EndOf(const sockaddr_storage& a, End* e) {
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    e->family = AF_INET;
    std::memcpy(e->addr, &in->sin_addr, 4);
    e->port = in->sin_port;
    e->loopback = e->addr[0] == 127;
    return true;
  }
  if (a.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
    e->port = in6->sin6_port;
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      e->family = AF_INET;
      std::memcpy(e->addr, &in6->sin6_addr.s6_addr[12], 4);
      e->loopback = e->addr[0] == 127;
    } else {
      e->family = AF_INET6;
      std::memcpy(e->addr, &in6->sin6_addr, 16);
      e->loopback = IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
    }
    return true;
  }
  return false;
}

}  // namespace

std::optional<uint32_t> LoopbackPeerUidOf(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
  End here, there;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 ||
      !EndOf(local, &here) || !EndOf(peer, &there) || !there.loopback ||
      here.family != there.family) {
    return std::nullopt;
  }
  const int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) return std::nullopt;
  const timeval timeout{1, 0};  // the kernel answers at once; never wait long for it
  setsockopt(nl, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } message{};
  message.header.nlmsg_len = sizeof(message);
  message.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  message.header.nlmsg_flags = NLM_F_REQUEST;  // one socket, looked up by its four parts
  message.request.sdiag_family = static_cast<uint8_t>(there.family);
  message.request.sdiag_protocol = IPPROTO_TCP;
  message.request.idiag_states = ~0u;
  // The peer's socket: its local end is `there`, its remote end `here`.
  message.request.id.idiag_sport = there.port;
  message.request.id.idiag_dport = here.port;
  std::memcpy(message.request.id.idiag_src, there.addr, sizeof(message.request.id.idiag_src));
  std::memcpy(message.request.id.idiag_dst, here.addr, sizeof(message.request.id.idiag_dst));
  message.request.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  message.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  std::optional<uint32_t> uid;
  if (sendto(nl, &message, sizeof(message), 0, reinterpret_cast<sockaddr*>(&kernel),
             sizeof(kernel)) == static_cast<ssize_t>(sizeof(message))) {
    alignas(nlmsghdr) char reply[8192];
    const ssize_t n = recv(nl, reply, sizeof(reply), 0);
    if (n > 0) {
      const auto* h = reinterpret_cast<const nlmsghdr*>(reply);
      size_t left = static_cast<size_t>(n);
      for (; NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
        if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) break;  // NLMSG_ERROR: no such socket
        if (h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) break;
        const auto* m = reinterpret_cast<const inet_diag_msg*>(NLMSG_DATA(h));
        uid = m->idiag_uid;
        break;
      }
    }
  }
  close(nl);
  return uid;
}

}  // namespace normgrad::server
