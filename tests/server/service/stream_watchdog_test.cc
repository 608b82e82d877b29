// StreamWatchdog alone, on a clock the test sets: the idle timeout counts from the last progress,
// the minimum rate only over time spent waiting on the client, one window at a time.
#include "server/service/stream_watchdog.h"

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

const absl::Time kStart = absl::FromUnixSeconds(1000);

StreamWatchdog::StreamState Waiting(uint64_t bytes_moved = 0, bool writing = false) {
  return {.waiting_on_client = true, .writing = writing, .rows_received = 5,
          .bytes_moved = bytes_moved};
}

TEST(StreamWatchdogTest, TheIdleTimeoutCountsFromTheLastProgressAndNamesWhatTheClientOwes) {
  StreamWatchdog w(kStart, {});
  EXPECT_TRUE(w.Visit(kStart + absl::Seconds(29), absl::Seconds(30), Waiting()).end.ok());
  w.NoteProgress(kStart + absl::Seconds(29));
  EXPECT_TRUE(w.Visit(kStart + absl::Seconds(58), absl::Seconds(30), Waiting()).end.ok());
  const StreamWatchdog::Verdict reading =
      w.Visit(kStart + absl::Seconds(59), absl::Seconds(30), Waiting());
  EXPECT_EQ(reading.end.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(reading.end.message(), HasSubstr("no request message for 30s after 5 rows"));
  EXPECT_FALSE(reading.below_min_rate);
  const StreamWatchdog::Verdict writing =
      w.Visit(kStart + absl::Seconds(60), absl::Seconds(30), Waiting(0, /*writing=*/true));
  EXPECT_THAT(writing.end.message(), HasSubstr("the client read no response for 30s"));
}

TEST(StreamWatchdogTest, AStreamTheServerIsBusyWithIsNeverEnded) {
  StreamWatchdog w(kStart, {.bytes_per_second = 1000, .window = absl::Seconds(10)});
  StreamWatchdog::StreamState busy = Waiting();
  busy.waiting_on_client = false;
  EXPECT_TRUE(w.Visit(kStart + absl::Hours(1), absl::Seconds(30), busy).end.ok());
  // The busy hour did not count as waiting on the client: the rate window has not passed.
  EXPECT_TRUE(w.Visit(kStart + absl::Hours(1) + absl::Seconds(5), absl::ZeroDuration(),
                      Waiting())
                  .end.ok());
}

TEST(StreamWatchdogTest, BelowTheMinimumRateOverAWindowEndsNamingTheBytesAndTheFlag) {
  StreamWatchdog w(kStart, {.bytes_per_second = 1000, .window = absl::Seconds(10)});
  EXPECT_TRUE(w.Visit(kStart + absl::Seconds(9), absl::ZeroDuration(), Waiting(500)).end.ok());
  const StreamWatchdog::Verdict v =
      w.Visit(kStart + absl::Seconds(10), absl::ZeroDuration(), Waiting(9000));
  EXPECT_TRUE(v.below_min_rate);
  EXPECT_EQ(v.end.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v.end.message(), HasSubstr("stream too slow: 9000 bytes"));
  EXPECT_THAT(v.end.message(), HasSubstr("in 10s of waiting on the client (900 B/s)"));
  EXPECT_THAT(v.end.message(), HasSubstr("below --min-stream-bytes-per-second=1000"));
}

TEST(StreamWatchdogTest, AWindowAtTheRateStartsTheNextWindowFromItsBytes) {
  StreamWatchdog w(kStart, {.bytes_per_second = 1000, .window = absl::Seconds(10)});
  EXPECT_TRUE(w.Visit(kStart + absl::Seconds(10), absl::ZeroDuration(), Waiting(10000)).end.ok());
  // The next window is judged on its own bytes: 10000 moved before it do not count.
  const StreamWatchdog::Verdict v =
      w.Visit(kStart + absl::Seconds(20), absl::ZeroDuration(), Waiting(10500));
  EXPECT_THAT(v.end.message(), HasSubstr("stream too slow: 500 bytes"));
}

TEST(StreamWatchdogTest, NoMinimumAndNoTimeoutNeverEnd) {
  StreamWatchdog w(kStart, {});
  EXPECT_TRUE(w.Visit(kStart + absl::Hours(24), absl::ZeroDuration(), Waiting()).end.ok());
}

}  // namespace
}  // namespace normgrad::server
