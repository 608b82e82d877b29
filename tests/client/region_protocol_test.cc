// The client's side of the region socket against a scripted server in the test (a SOCK_SEQPACKET
// socket that answers when and how the test says): replies are matched to requests by
// request_id, so a late reply to an abandoned registration is never taken for the answer to a
// later one and its grant is released; a grant that does not fit the region is not used; and a
// connection the server closed is replaced by a new one at the next registration.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/src/shared_memory_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "normgrad/shared_memory.h"
#include "normgrad/v1/normgrad.pb.h"

namespace normgrad::client_internal {
namespace {

using ::testing::HasSubstr;

// A region socket whose every step the test takes by hand.
class ScriptedRegionSocket {
 public:
  ScriptedRegionSocket() {
    char dir[] = "/tmp/normgrad-region-protocol-XXXXXX";
    EXPECT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/grpc.sock.shm";
    listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.data(), path_.size());
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listen_fd_, 4), 0);
  }
  ~ScriptedRegionSocket() {
    if (conn_ >= 0) close(conn_);
    close(listen_fd_);
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }

  void Accept() {
    if (conn_ >= 0) close(conn_);
    conn_ = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    ASSERT_GE(conn_, 0);
  }
  void CloseConnection() {
    close(conn_);
    conn_ = -1;
  }
  // The next request, and the descriptor that came with it (closed here).
  v1::RegionRequest Receive(bool* had_fd = nullptr) {
    char bytes[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    iovec iov{bytes, sizeof(bytes)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(conn_, &msg, MSG_CMSG_CLOEXEC);
    EXPECT_GT(n, 0);
    bool fd = false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int received;
        std::memcpy(&received, CMSG_DATA(c), sizeof(int));
        close(received);
        fd = true;
      }
    }
    if (had_fd != nullptr) *had_fd = fd;
    v1::RegionRequest r;
    EXPECT_TRUE(r.ParseFromArray(bytes, static_cast<int>(n > 0 ? n : 0)));
    return r;
  }
  void Reply(uint64_t request_id, uint64_t region_id, uint64_t size, size_t key_bytes = 16) {
    v1::RegionReply r;
    r.set_request_id(request_id);
    r.set_region_id(region_id);
    r.set_region_key(std::string(key_bytes, static_cast<char>('a' + region_id % 26)));
    r.set_size_bytes(size);
    const std::string bytes = r.SerializeAsString();
    ASSERT_EQ(send(conn_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }

 private:
  std::string dir_, path_;
  int listen_fd_ = -1;
  int conn_ = -1;
};

SharedMemoryTransport TransportFor(const ScriptedRegionSocket& server) {
  return SharedMemoryTransport(Transport::kSharedMemory, server.path(),
                               [] { return absl::StatusOr<bool>(true); },
                               absl::Milliseconds(200));
}

// The plan's region id for a call whose tensors lie in `region`.
uint64_t PlannedRegion(SharedMemoryTransport& t, SharedMemoryRegion& region) {
  RawBackwardArgs a;
  a.num_rows = 1;
  a.hidden_dim = 4;
  a.x = absl::MakeConstSpan(region.data(), 16);
  a.dy = absl::MakeConstSpan(region.data() + 16, 16);
  a.dx = absl::MakeSpan(region.data() + 32, 16);
  absl::StatusOr<std::optional<ShmPlan>> plan = t.Plan(a);
  EXPECT_TRUE(plan.ok() && plan->has_value()) << plan.status();
  return plan.ok() && plan->has_value() ? (*plan)->region_id : 0;
}

// A registration the client gave up on (no answer in time) is answered late, right before the
// answer to the next registration: the client takes the next one's answer, not the stale one,
// and releases the stale grant (its memfd is closed here; the server would map zeros).
TEST(RegionProtocolTest, ALateReplyIsNeverTakenForTheNextRegistrationsAndItsGrantIsReleased) {
  ScriptedRegionSocket server;
  SharedMemoryTransport t = TransportFor(server);
  auto first = *SharedMemoryRegion::Create(4096);
  auto second = *SharedMemoryRegion::Create(8192);

  absl::Status s = t.Register(*first);  // connects; the server reads but does not answer
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("no answer to the region request within 200ms"));
  server.Accept();
  bool had_fd = false;
  const v1::RegionRequest r1 = server.Receive(&had_fd);
  EXPECT_TRUE(r1.register_region());
  EXPECT_TRUE(had_fd);

  // The second registration: the server answers the first (late), then the second.
  std::thread answer([&] {
    const v1::RegionRequest r2 = server.Receive();
    EXPECT_NE(r2.request_id(), r1.request_id());
    server.Reply(r1.request_id(), /*region_id=*/11, 4096);
    server.Reply(r2.request_id(), /*region_id=*/22, 8192);
    // The late grant is released.
    const v1::RegionRequest release = server.Receive();
    EXPECT_EQ(release.release_region_id(), 11u);
  });
  s = t.Register(*second);
  answer.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(PlannedRegion(t, *second), 22u);
}

// A reply whose size is not the region's, or whose key is short, is not a grant for it.
TEST(RegionProtocolTest, AGrantThatDoesNotFitTheRegionIsNotUsed) {
  ScriptedRegionSocket server;
  SharedMemoryTransport t = TransportFor(server);
  auto region = *SharedMemoryRegion::Create(4096);
  const std::pair<uint64_t, size_t> grants[] = {{1 << 20, 16}, {4096, 8}};  // size, key bytes
  std::thread answer([&] {
    server.Accept();
    for (const auto& [size, key] : grants) {
      const v1::RegionRequest r = server.Receive();
      server.Reply(r.request_id(), 33, size, key);
      EXPECT_EQ(server.Receive().release_region_id(), 33u);  // given back at once
    }
  });
  for (size_t i = 0; i < 2; ++i) {
    const absl::Status s = t.Register(*region);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr("does not fit the region"));
  }
  answer.join();
}

// The server closed the connection (a restart, or a bound): the registration on it fails, says
// so, and the next one connects again and works.
TEST(RegionProtocolTest, AClosedConnectionIsReplacedAtTheNextRegistration) {
  ScriptedRegionSocket server;
  SharedMemoryTransport t = TransportFor(server);
  auto region = *SharedMemoryRegion::Create(4096);
  std::thread first([&] {
    server.Accept();
    server.Receive();
    server.CloseConnection();
  });
  absl::Status s = t.Register(*region);
  first.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("connection closed by the server"));

  std::thread second([&] {
    server.Accept();
    const v1::RegionRequest r = server.Receive();
    server.Reply(r.request_id(), 44, 4096);
  });
  s = t.Register(*region);
  second.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(PlannedRegion(t, *region), 44u);
}

}  // namespace
}  // namespace normgrad::client_internal
