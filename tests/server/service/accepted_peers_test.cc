// AcceptedPeers alone: a connection the server accepted itself is found by the "fd:N" gRPC names
// it with, a unix one by its credentials, a TCP one by its address written as gRPC writes peers;
// a reused descriptor is the new connection's; every other peer string passes through.
#include "server/service/accepted_peers.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>

#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

TEST(AcceptedPeersTest, UnixAndTcpConnectionsAreFoundByTheirDescriptor) {
  AcceptedPeers peers;
  peers.Set(7, {4242, 1000, 1000});
  peers.SetTcp(8, "ipv4:10.0.0.7:41234");
  ASSERT_TRUE(peers.Find("fd:7").has_value());
  EXPECT_EQ(peers.Find("fd:7")->uid, 1000u);
  EXPECT_EQ(peers.Address("fd:7"), "fd:7") << "a unix connection has no address";
  EXPECT_FALSE(peers.Find("fd:8").has_value()) << "a TCP connection has no credentials";
  EXPECT_EQ(peers.Address("fd:8"), "ipv4:10.0.0.7:41234");
  EXPECT_EQ(peers.Address("fd:9"), "fd:9");
  EXPECT_EQ(peers.Address("ipv4:127.0.0.1:5000"), "ipv4:127.0.0.1:5000");
  EXPECT_EQ(peers.Address("fd:"), "fd:");

  // Descriptor 7 closed and reused for a TCP connection, 8 for a unix one.
  peers.SetTcp(7, "ipv6:[2001:db8::1]:443");
  peers.Set(8, {1, 0, 0});
  EXPECT_FALSE(peers.Find("fd:7").has_value());
  EXPECT_EQ(peers.Address("fd:7"), "ipv6:[2001:db8::1]:443");
  EXPECT_EQ(peers.Address("fd:8"), "fd:8");
  EXPECT_EQ(peers.Find("fd:8")->uid, 0u);
}

TEST(AcceptedPeersTest, TcpAddressesAreWrittenAsGrpcWritesThem) {
  sockaddr_in v4{};
  v4.sin_family = AF_INET;
  v4.sin_port = htons(41234);
  ASSERT_EQ(inet_pton(AF_INET, "10.0.0.7", &v4.sin_addr), 1);
  EXPECT_EQ(TcpPeerAddress(reinterpret_cast<const sockaddr*>(&v4), sizeof(v4)),
            "ipv4:10.0.0.7:41234");

  sockaddr_in6 v6{};
  v6.sin6_family = AF_INET6;
  v6.sin6_port = htons(443);
  ASSERT_EQ(inet_pton(AF_INET6, "2001:db8::1", &v6.sin6_addr), 1);
  EXPECT_EQ(TcpPeerAddress(reinterpret_cast<const sockaddr*>(&v6), sizeof(v6)),
            "ipv6:[2001:db8::1]:443");

  // An IPv4 peer of a dual-stack socket ("[::]:PORT") is an IPv4 peer.
  ASSERT_EQ(inet_pton(AF_INET6, "::ffff:127.0.0.2", &v6.sin6_addr), 1);
  EXPECT_EQ(TcpPeerAddress(reinterpret_cast<const sockaddr*>(&v6), sizeof(v6)),
            "ipv4:127.0.0.2:443");

  EXPECT_EQ(TcpPeerAddress(reinterpret_cast<const sockaddr*>(&v4), sizeof(v4) - 1), "");
}

}  // namespace
}  // namespace normgrad::server
