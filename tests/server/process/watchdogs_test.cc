// The watchdog threads' loop and periods, alone: a PeriodicTask visits every period until
// stopped or until its visit says there is nothing more to watch; Stop is prompt even with a long
// period; the periods follow the flags within 10 ms .. 1 s. The listener watchdog on real
// listening sockets: one nobody accepts on is dead, one that accepts between visits is not.
#include "server/process/watchdogs.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

TEST(PeriodicTaskTest, VisitsEveryPeriodUntilStopped) {
  std::atomic<int> visits{0};
  PeriodicTask task(absl::Milliseconds(5), [&] {
    ++visits;
    return true;
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (visits.load() < 3 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  task.Stop();
  const int at_stop = visits.load();
  EXPECT_GE(at_stop, 3);
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(visits.load(), at_stop) << "visited after Stop";
  task.Stop();  // idempotent
}

TEST(PeriodicTaskTest, AVisitThatReturnsFalseIsTheLast) {
  std::atomic<int> visits{0};
  PeriodicTask task(absl::Milliseconds(2), [&] {
    ++visits;
    return false;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(visits.load(), 1);
}

TEST(PeriodicTaskTest, StopDoesNotWaitForThePeriod) {
  const absl::Time start = absl::Now();
  {
    PeriodicTask task(absl::Hours(1), [] { return true; });
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(WatchdogPeriodTest, AQuarterOfTheShortestStreamBoundWithin10MsAnd1s) {
  ServerOptions o;
  o.stream_idle_timeout = absl::Seconds(2);
  o.min_stream_bytes_per_second = 0;
  EXPECT_EQ(StreamWatchdogPeriod(o), absl::Milliseconds(500));
  o.min_stream_bytes_per_second = 1024;
  o.min_stream_rate_window = absl::Milliseconds(100);
  EXPECT_EQ(StreamWatchdogPeriod(o), absl::Milliseconds(25));
  o.stream_idle_timeout = absl::Hours(1);
  o.min_stream_rate_window = absl::Hours(1);
  EXPECT_EQ(StreamWatchdogPeriod(o), absl::Seconds(1));
  o.stream_idle_timeout = absl::ZeroDuration();
  o.min_stream_bytes_per_second = 0;
  EXPECT_EQ(StreamWatchdogPeriod(o), absl::InfiniteDuration());
  EXPECT_EQ(DeviceWatchdogPeriod(absl::Seconds(60)), absl::Seconds(1));
  EXPECT_EQ(DeviceWatchdogPeriod(absl::Milliseconds(50)), absl::Milliseconds(10));
}

// A listening socket on 127.0.0.1 with a port the kernel picked.
class Listening {
 public:
  Listening() : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      return;
    }
    port_ = ntohs(a.sin_port);
  }
  ~Listening() {
    for (int fd : connections_) close(fd);
    close(fd_);
  }
  int port() const { return port_; }
  void Connect() {
    const int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    connections_.push_back(c);
  }
  void AcceptAll() {
    for (uint64_t n = AcceptQueueLength(port_); n > 0; --n) {
      const int fd = accept(fd_, nullptr, nullptr);
      if (fd >= 0) connections_.push_back(fd);
    }
  }

 private:
  const int fd_;
  int port_ = 0;
  std::vector<int> connections_;
};

TEST(ListenerWatchdogTest, ConnectionsWaitingAtEveryVisitMeanADeadListener) {
  Listening l;
  ASSERT_GT(l.port(), 0);
  ListenerWatchdog watchdog(l.port(), 3);
  EXPECT_EQ(AcceptQueueLength(l.port()), 0u);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(watchdog.Visit()) << "nothing waits";
  l.Connect();
  l.Connect();
  EXPECT_EQ(AcceptQueueLength(l.port()), 2u);
  EXPECT_TRUE(watchdog.Visit());
  EXPECT_TRUE(watchdog.Visit());
  EXPECT_FALSE(watchdog.Visit());
  EXPECT_TRUE(watchdog.dead());
  EXPECT_FALSE(watchdog.Visit()) << "dead for good";
}

TEST(ListenerWatchdogTest, AListenerThatAcceptsBetweenVisitsIsAlive) {
  Listening l;
  ASSERT_GT(l.port(), 0);
  ListenerWatchdog watchdog(l.port(), 3);
  // Connections arrive before every visit; two visits in a row find some waiting, then the
  // listener takes them all before the third.
  for (int i = 0; i < 12; ++i) {
    l.Connect();
    if (i % 3 == 2) {
      l.AcceptAll();
      EXPECT_EQ(AcceptQueueLength(l.port()), 0u);
    }
    EXPECT_TRUE(watchdog.Visit()) << i;
  }
  EXPECT_FALSE(watchdog.dead());
}

}  // namespace
}  // namespace normgrad::server
