// A listening unix socket the server owns: the path length is checked before anything is made,
// the socket file ends up with the mode asked for, Poll reports the caller's connections and a
// pending peer, Stop wakes a Poll that waits forever, and the file is removed on Stop only when
// it is still the one Open made.
#include "server/listen_socket/listen_socket.h"

#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/unix_socket_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

class ListenSocketTest : public ::testing::Test {
 protected:
  int Connect(int type) const {
    const int fd = testing::ConnectUnix(path_, type);
    EXPECT_GE(fd, 0);
    return fd;
  }

  testing::TempDir dir_{"normgrad-listen"};
  const std::string path_ = dir_.path() + "/s.sock";
};

TEST_F(ListenSocketTest, APathLongerThanSockaddrIsRefusedNamingBothLengths) {
  const std::string long_path = dir_.path() + "/" + std::string(200, 'p');
  auto s = ListenSocket::Open(long_path, {.what = "--listen=unix:x"});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(absl::StrCat("--listen=unix:x: the path is ", long_path.size(), " bytes")));
  EXPECT_THAT(s.status().message(), HasSubstr("the most is 107"));
  struct stat st;
  EXPECT_NE(lstat(long_path.c_str(), &st), 0);
}

TEST_F(ListenSocketTest, TheSocketFileHasTheModeAskedFor) {
  for (mode_t mode : {0600, 0660, 0666}) {
    auto s = ListenSocket::Open(path_, {.mode = mode, .what = "test"});
    ASSERT_TRUE(s.ok()) << s.status();
    struct stat st;
    ASSERT_EQ(lstat(path_.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, mode);
    s->reset();
    unlink(path_.c_str());
  }
}

TEST_F(ListenSocketTest, AnOccupiedPathIsUnavailable) {
  auto first = ListenSocket::Open(path_, {.what = "region socket"});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ListenSocket::Open(path_, {.what = "region socket"});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("region socket: cannot listen there"));
}

TEST_F(ListenSocketTest, PollReportsPeersAndConnectionsAndStopWakesIt) {
  auto s = ListenSocket::Open(path_, {.type = SOCK_SEQPACKET, .what = "test"});
  ASSERT_TRUE(s.ok()) << s.status();
  ListenSocket* socket = s->get();
  std::atomic<int> accepted{0}, messages{0}, polls_after_stop{0};
  socket->Start([&] {
    Acceptor acceptor(socket->fd(), {}, "test");
    std::vector<int> connections;
    std::vector<pollfd> polled;
    while (true) {
      polled.clear();
      for (int fd : connections) polled.push_back({fd, POLLIN, 0});
      if (!socket->Poll(acceptor, polled)) break;
      for (size_t i = 0; i < polled.size(); ++i) {
        char byte;
        if ((polled[i].revents & POLLIN) != 0 && recv(polled[i].fd, &byte, 1, 0) == 1) {
          messages.fetch_add(1);
        }
      }
      while (std::optional<AcceptedPeer> peer = acceptor.AcceptOne()) {
        connections.push_back(peer->fd);
        accepted.fetch_add(1);
      }
    }
    polls_after_stop.store(socket->Poll(acceptor, polled) ? 1 : 0);
    for (int fd : connections) close(fd);
  });
  const int client = Connect(SOCK_SEQPACKET);
  while (accepted.load() == 0) usleep(1000);
  ASSERT_EQ(send(client, "x", 1, 0), 1);
  ASSERT_EQ(send(client, "y", 1, 0), 1);
  while (messages.load() < 2) usleep(1000);
  socket->Stop();  // the thread waits in poll with no timeout: only the wake ends it
  EXPECT_EQ(accepted.load(), 1);
  EXPECT_EQ(messages.load(), 2);
  EXPECT_EQ(polls_after_stop.load(), 0);
  close(client);
}

TEST_F(ListenSocketTest, StopRemovesTheFileOnlyWhenItIsStillTheOneOpenMade) {
  struct stat st;
  {
    auto s = ListenSocket::Open(path_, {.what = "test", .remove_on_stop = true});
    ASSERT_TRUE(s.ok()) << s.status();
    (*s)->Stop();
    EXPECT_NE(lstat(path_.c_str(), &st), 0);
  }
  {
    auto s = ListenSocket::Open(path_, {.what = "test", .remove_on_stop = true});
    ASSERT_TRUE(s.ok()) << s.status();
    // Another process took the path over (removed the socket and made its own file).
    ASSERT_EQ(unlink(path_.c_str()), 0);
    FILE* f = std::fopen(path_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
    (*s)->Stop();
    EXPECT_EQ(lstat(path_.c_str(), &st), 0);
  }
  {
    auto s = ListenSocket::Open(dir_.path() + "/kept.sock", {.what = "test"});
    ASSERT_TRUE(s.ok()) << s.status();
    (*s)->Stop();
    EXPECT_EQ(lstat((dir_.path() + "/kept.sock").c_str(), &st), 0);
    unlink((dir_.path() + "/kept.sock").c_str());
  }
}

}  // namespace
}  // namespace normgrad::server
