// LoopbackPeerUidOf on real loopback connections: the uid that owns the other end (this test's
// own), over IPv4 from 127.0.0.1 and 127.0.0.2 and over IPv6; none for the listening socket or a
// unix socket.
#include "server/listen_socket/peer_uid.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

// A listening socket on `family`'s loopback, a client bound to `client_address` connected to it,
// and the accepted end; -1s when the host lacks the family.
struct Connection {
  Connection(int family, const char* client_address) {
    listener = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    client = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_storage server{}, from{};
    socklen_t len;
    if (family == AF_INET) {
      auto* s = reinterpret_cast<sockaddr_in*>(&server);
      s->sin_family = AF_INET;
      s->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      auto* c = reinterpret_cast<sockaddr_in*>(&from);
      c->sin_family = AF_INET;
      inet_pton(AF_INET, client_address, &c->sin_addr);
      len = sizeof(sockaddr_in);
    } else {
      auto* s = reinterpret_cast<sockaddr_in6*>(&server);
      s->sin6_family = AF_INET6;
      s->sin6_addr = in6addr_loopback;
      auto* c = reinterpret_cast<sockaddr_in6*>(&from);
      c->sin6_family = AF_INET6;
      c->sin6_addr = in6addr_loopback;
      len = sizeof(sockaddr_in6);
    }
    socklen_t server_len = len;
    if (bind(listener, reinterpret_cast<sockaddr*>(&server), len) != 0 ||
        listen(listener, 4) != 0 ||
        getsockname(listener, reinterpret_cast<sockaddr*>(&server), &server_len) != 0 ||
        bind(client, reinterpret_cast<sockaddr*>(&from), len) != 0 ||
        connect(client, reinterpret_cast<sockaddr*>(&server), len) != 0) {
      return;
    }
    accepted = accept(listener, nullptr, nullptr);
  }
  ~Connection() {
    for (int fd : {accepted, client, listener}) {
      if (fd >= 0) close(fd);
    }
  }
  int listener = -1, client = -1, accepted = -1;
};

TEST(LoopbackPeerUidTest, TheUidOwningTheOtherEndOfALoopbackConnection) {
  for (const char* from : {"127.0.0.1", "127.0.0.2"}) {
    Connection c(AF_INET, from);
    ASSERT_GE(c.accepted, 0) << from;
    const std::optional<uint32_t> uid = LoopbackPeerUidOf(c.accepted);
    ASSERT_TRUE(uid.has_value()) << from;
    EXPECT_EQ(*uid, getuid()) << from;
    // The client's end has the server for its peer: the same user.
    EXPECT_EQ(LoopbackPeerUidOf(c.client), getuid()) << from;
    EXPECT_FALSE(LoopbackPeerUidOf(c.listener).has_value()) << "a listening socket has no peer";
  }
  Connection v6(AF_INET6, "::1");
  if (v6.accepted >= 0) {
    EXPECT_EQ(LoopbackPeerUidOf(v6.accepted), getuid());
  }
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_FALSE(LoopbackPeerUidOf(pair[0]).has_value()) << "not TCP";
  close(pair[0]);
  close(pair[1]);
}

}  // namespace
}  // namespace normgrad::server
