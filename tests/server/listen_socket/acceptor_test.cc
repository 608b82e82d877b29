// Accepting on a unix socket the server owns: the allow-list closes a peer it does not list
// before it can say anything, and running out of descriptors pauses accepting instead of
// spinning on a listening socket that stays readable (the queued connection is taken once
// descriptors are back). The descriptor limit is raised and the connection bound derived from it.
#include "server/listen_socket/acceptor.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/listen_socket/listen_socket.h"
#include "tests/common/unix_socket_util.h"

namespace normgrad::server {
namespace {

class AcceptorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ListenSocket>> s =
        ListenSocket::Open(dir_.path() + "/listen.sock", {.backlog = 16, .what = "test"});
    ASSERT_TRUE(s.ok()) << s.status();
    socket_ = *std::move(s);
    listen_fd_ = socket_->fd();
  }
  int Connect() const {
    const int fd = testing::ConnectUnix(socket_->path(), SOCK_STREAM);
    EXPECT_GE(fd, 0);
    return fd;
  }

  testing::TempDir dir_{"normgrad-acceptor"};
  std::unique_ptr<ListenSocket> socket_;
  int listen_fd_ = -1;
};

TEST_F(AcceptorTest, APeerTheAllowListDoesNotNameIsClosedAndCounted) {
  std::atomic<uint64_t> refused{0};
  Acceptor acceptor(listen_fd_, {getuid() + 1}, "test socket", &refused);
  const int client = Connect();
  EXPECT_EQ(acceptor.AcceptOne(), std::nullopt);
  EXPECT_EQ(acceptor.refused(), 1u);
  EXPECT_EQ(refused.load(), 1u);
  char byte;
  EXPECT_EQ(recv(client, &byte, 1, 0), 0);  // closed by the server before a byte was read
  close(client);
}

TEST_F(AcceptorTest, APeerTheAllowListNamesIsTakenWithItsCredentials) {
  Acceptor acceptor(listen_fd_, {getuid()}, "test socket");
  const int client = Connect();
  std::optional<AcceptedPeer> peer = acceptor.AcceptOne();
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(peer->uid, getuid());
  EXPECT_EQ(peer->pid, getpid());
  close(peer->fd);
  close(client);
  EXPECT_EQ(acceptor.AcceptOne(), std::nullopt);  // none pending
  EXPECT_TRUE(acceptor.listening());
}

// In a child process (it lowers its own descriptor limit): with every descriptor taken, accept4
// fails with EMFILE once and accepting pauses; a thousand more calls meanwhile do not try again
// (no busy loop); once descriptors are free and the pause is over, the queued peer is taken.
TEST_F(AcceptorTest, RunningOutOfDescriptorsPausesInsteadOfSpinning) {
  const int client = Connect();  // queued before the child runs out
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    Acceptor acceptor(listen_fd_, {}, "test socket");
    rlimit low{64, 64};
    if (setrlimit(RLIMIT_NOFILE, &low) != 0) _exit(10);
    std::vector<int> taken;
    for (int fd; (fd = dup(0)) >= 0;) taken.push_back(fd);
    if (acceptor.AcceptOne().has_value()) code = 11;
    if (acceptor.exhausted() != 1) code = 12;
    if (acceptor.listening() || acceptor.PollTimeoutMs() <= 0 ||
        acceptor.PollTimeoutMs() > absl::ToInt64Milliseconds(Acceptor::kBackoff)) {
      code = 13;
    }
    for (int i = 0; i < 1000; ++i) (void)acceptor.AcceptOne();
    if (acceptor.exhausted() != 1) code = 14;  // each call would fail again if it tried
    for (int fd : taken) close(fd);
    absl::SleepFor(Acceptor::kBackoff + absl::Milliseconds(20));
    std::optional<AcceptedPeer> peer = acceptor.AcceptOne();
    if (!peer.has_value() || peer->pid != getppid()) code = code != 0 ? code : 15;
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: setrlimit, 11: accepted without descriptors, 12: "
                                       "no pause, 13: pause not reported, 14: spun, 15: the "
                                       "queued peer was not taken afterwards";
  close(client);
}

TEST(OpenFileLimitTest, TheSoftLimitIsRaisedToTheHardOneAndBoundsFollowIt) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  const uint64_t limit = RaiseOpenFileLimit();
  rlimit after{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &after), 0);
  EXPECT_EQ(after.rlim_cur, before.rlim_max);
  if (after.rlim_cur != RLIM_INFINITY) {
    EXPECT_EQ(limit, after.rlim_cur);
  }
  EXPECT_EQ(ConnectionBoundFor(1024), 256u);
  EXPECT_EQ(ConnectionBoundFor(40), 16u);  // at least 16
  EXPECT_EQ(ConnectionBoundFor(uint64_t{1} << 40), 1u << 20);
}

}  // namespace
}  // namespace normgrad::server
