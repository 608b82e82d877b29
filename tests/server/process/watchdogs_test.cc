// The watchdog threads' loop and periods, alone: a PeriodicTask visits every period until
// stopped or until its visit says there is nothing more to watch; Stop is prompt even with a long
// period; the periods follow the flags within 10 ms .. 1 s.
#include "server/process/watchdogs.h"

#include <atomic>

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

}  // namespace
}  // namespace normgrad::server
