// The region socket and registry against raw clients in the test: the uid allow-list closes a
// peer it does not list at accept (nothing is registered for it), connections are bounded in all
// and per user, a 0-byte datagram is a message (not a close), and the per-user shares of
// regions and bytes keep one user from locking out another.
#include "server/shared_memory/region_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/src/descriptor_passing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/shared_memory/region_registry.h"
#include "tests/common/unix_socket_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

template <typename Condition>
bool Eventually(Condition condition) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

RegionSocketOptions Options(std::vector<uint32_t> allowed_uids, uint32_t max_connections = 256,
                            uint32_t max_connections_per_user = 128) {
  RegionSocketOptions o;
  o.allowed_uids = std::move(allowed_uids);
  o.max_connections = max_connections;
  o.max_connections_per_user = max_connections_per_user;
  return o;
}

RegionOwner Owner(uint64_t connection, uid_t uid) {
  RegionOwner o;
  o.connection = connection;
  o.uid = uid;
  return o;
}

// A sealed, allocated memfd of `bytes`, as the client library makes them.
int AllocatedMemfd(uint64_t bytes) {
  const int fd = memfd_create("region-socket-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(posix_fallocate(fd, 0, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

class RegionSocketTest : public ::testing::Test {
 protected:
  void TearDown() override { socket_.reset(); }
  void Start(RegionSocketOptions options, RegionLimits limits = {}) {
    registry_ = std::make_unique<RegionRegistry>(limits);
    options.refused_peers = &refused_peers_;
    options.refused_over_bound = &refused_over_bound_;
    absl::StatusOr<std::unique_ptr<RegionSocket>> s =
        RegionSocket::Start(dir_.path() + "/grpc.sock.shm", options, registry_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    socket_ = *std::move(s);
  }
  int Connect() {
    const int fd = testing::ConnectUnix(socket_->path(), SOCK_SEQPACKET);
    EXPECT_GE(fd, 0);
    return fd;
  }
  // Sends a registration of a new `bytes` region; the connection's reply, or nullopt when the
  // server closed the connection (or said nothing within 5 s).
  static std::optional<v1::RegionReply> Register(int conn, uint64_t bytes, uint64_t request_id) {
    v1::RegionRequest request;
    request.set_register_region(true);
    request.set_request_id(request_id);
    const std::string wire = request.SerializeAsString();
    const int region = AllocatedMemfd(bytes);
    const ssize_t sent = client_internal::SendWithDescriptor(conn, wire, region);
    close(region);
    if (sent < 0) return std::nullopt;
    return Await(conn);
  }
  static std::optional<v1::RegionReply> Await(int conn) {
    pollfd p{conn, POLLIN, 0};
    if (poll(&p, 1, 5000) != 1) return std::nullopt;
    char bytes[4096];
    const ssize_t n = recv(conn, bytes, sizeof(bytes), 0);
    if (n <= 0) return std::nullopt;  // closed (0) or reset
    v1::RegionReply reply;
    EXPECT_TRUE(reply.ParseFromArray(bytes, static_cast<int>(n)));
    return reply;
  }

  testing::TempDir dir_{"normgrad-region-socket"};
  std::unique_ptr<RegionRegistry> registry_;
  std::unique_ptr<RegionSocket> socket_;
  std::atomic<uint64_t> refused_peers_{0}, refused_over_bound_{0};
};

// A client passes a TCP socket whose close blocks (SO_LINGER of 20 s, unsent bytes, a peer that
// never reads) and drops its own copy: the server's is the last. Another client's registration is
// still answered at once, and the passed socket is gone (closed, in the background).
TEST_F(RegionSocketTest, ADescriptorWhoseCloseBlocksStallsNoOne) {
  Start(Options({}));
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int lingering = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  connect(lingering, reinterpret_cast<sockaddr*>(&addr), len);  // in progress or done
  const int never_reads = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(never_reads, 0);
  const std::string junk(1 << 16, 'j');
  while (send(lingering, junk.data(), junk.size(), MSG_NOSIGNAL) > 0) {
  }  // both buffers full
  const linger twenty{1, 20};
  ASSERT_EQ(setsockopt(lingering, SOL_SOCKET, SO_LINGER, &twenty, sizeof(twenty)), 0);
  const int flags = fcntl(lingering, F_GETFL);
  ASSERT_EQ(fcntl(lingering, F_SETFL, flags & ~O_NONBLOCK), 0);  // close() lingers when blocking

  v1::RegionRequest request;
  request.set_register_region(true);
  request.set_request_id(1);
  const int hostile = Connect();
  ASSERT_GE(client_internal::SendWithDescriptor(hostile, request.SerializeAsString(), lingering),
            0);
  close(lingering);  // the server's copy is the last
  const absl::Time start = absl::Now();
  std::optional<v1::RegionReply> refused = Await(hostile);
  ASSERT_TRUE(refused.has_value());
  EXPECT_NE(refused->code(), 0);
  EXPECT_THAT(refused->message(), HasSubstr("not a memfd"));
  const int other = Connect();
  std::optional<v1::RegionReply> ok = Register(other, 4096, 2);
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(ok->code(), 0) << ok->message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "a close blocked the region socket";
  close(other);
  close(hostile);
  close(never_reads);
  close(listener);
}

TEST_F(RegionSocketTest, APeerTheAllowListDoesNotNameIsClosedAtAcceptAndRegistersNothing) {
  Start(Options({getuid() + 1}));
  const int conn = Connect();
  EXPECT_EQ(Register(conn, 4096, 1), std::nullopt);
  close(conn);
  EXPECT_TRUE(Eventually([&] { return refused_peers_.load() >= 1; }));  // counted after the close
  EXPECT_EQ(registry_->Stats().regions, 0u);
  EXPECT_EQ(registry_->Stats().registered, 0u);
}

TEST_F(RegionSocketTest, APeerTheAllowListNamesRegisters) {
  Start(Options({getuid() + 1, getuid()}));
  const int conn = Connect();
  std::optional<v1::RegionReply> reply = Register(conn, 4096, 7);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->code(), 0) << reply->message();
  EXPECT_EQ(reply->request_id(), 7u);
  EXPECT_EQ(reply->size_bytes(), 4096u);
  EXPECT_EQ(refused_peers_.load(), 0u);
  close(conn);
}

// One user holds its share of connections; another connection of the same user is closed at
// accept, and closing one makes room again.
TEST_F(RegionSocketTest, ConnectionsPastAUsersShareAreClosedAtAccept) {
  Start(Options({}, 8, 2));
  const int a = Connect(), b = Connect();
  ASSERT_TRUE(Register(a, 4096, 1).has_value());
  ASSERT_TRUE(Register(b, 4096, 1).has_value());
  const int c = Connect();
  EXPECT_EQ(Register(c, 4096, 1), std::nullopt);
  EXPECT_TRUE(Eventually([&] { return refused_over_bound_.load() >= 1; }));
  close(c);
  close(a);
  // a's region goes with its connection; then a new connection fits the share again.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (registry_->Stats().regions != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(registry_->Stats().regions, 1u);
  const int d = Connect();
  EXPECT_TRUE(Register(d, 4096, 2).has_value());
  close(b);
  close(d);
}

// A 0-byte datagram is a message that does not parse as a request, not an end of the
// connection: the connection and its regions stay.
TEST_F(RegionSocketTest, AnEmptyDatagramIsNotACloseAndKeepsTheConnectionsRegions) {
  Start(Options({}));
  const int conn = Connect();
  ASSERT_TRUE(Register(conn, 4096, 1).has_value());
  ASSERT_EQ(send(conn, "", 0, MSG_NOSIGNAL), 0);
  (void)Await(conn);  // whatever it says of the empty message
  std::optional<v1::RegionReply> again = Register(conn, 8192, 2);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->code(), 0) << again->message();
  EXPECT_EQ(again->request_id(), 2u);
  EXPECT_EQ(registry_->Stats().regions, 2u);
  close(conn);
}

// One user at its shares of regions and bytes is refused, naming the flag; another user still
// registers: no user can lock out another.
TEST(RegionRegistryTest, PerUserSharesRefuseOneUserAndLeaveRoomForAnother) {
  RegionRegistry registry({.max_regions = 8,
                           .max_bytes = 1 << 24,
                           .max_regions_per_user = 3,
                           .max_bytes_per_user = 1 << 20});
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(registry.Register(OwnedFd(AllocatedMemfd(4096)), Owner(1, 1000))
                    .ok());
  }
  absl::StatusOr<RegionGrant> g =
      registry.Register(OwnedFd(AllocatedMemfd(4096)), Owner(1, 1000));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(g.status().message(), HasSubstr("uid:1000 holds 3 shared-memory regions"));
  EXPECT_THAT(g.status().message(), HasSubstr("--shared-memory-max-regions-per-user=3"));
  g = registry.Register(OwnedFd(AllocatedMemfd(2 << 20)), Owner(2, 2000));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(g.status().message(), HasSubstr("--shared-memory-max-bytes-per-user=1048576"));
  EXPECT_TRUE(registry.Register(OwnedFd(AllocatedMemfd(4096)), Owner(2, 2000))
                  .ok());
  EXPECT_EQ(registry.Stats().regions, 4u);
  // Released regions give the share back.
  EXPECT_EQ(registry.ReleaseOwner(1), 3);
  EXPECT_TRUE(registry.Register(OwnedFd(AllocatedMemfd(4096)), Owner(3, 1000))
                  .ok());
}

}  // namespace
}  // namespace normgrad::server
