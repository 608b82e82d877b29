// The service's own concurrent parts, driven from many threads without gRPC in between:
// admission, and the metrics the service records for every call. These are among the tests the
// `tsan` stage runs (docs/testing.md): every handoff here goes through our own locks, which
// ThreadSanitizer sees, so any report is ours. Each test also checks the counts that a lost
// update would break.
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics.h"
#include "server/service/admission.h"
#include "server/service/normgrad_service.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

constexpr int kThreads = 6;

TEST(ConcurrentAdmissionTest, ManyThreadsNeverHoldMoreThanTheLimitsAndReleaseEverything) {
  const AdmissionLimits limits{.max_streams = 4, .max_inflight_bytes = 10000};
  AdmissionController admission(limits);
  std::atomic<int> streams_held{0}, max_streams_held{0};
  std::atomic<int64_t> bytes_held{0}, max_bytes_held{0};
  std::atomic<int> admitted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 3000; ++i) {
        if (!admission.AdmitStream().ok()) {
          refused.fetch_add(1);
          continue;
        }
        admitted.fetch_add(1);
        const int s = streams_held.fetch_add(1) + 1;
        int m = max_streams_held.load();
        while (s > m && !max_streams_held.compare_exchange_weak(m, s)) {}
        const uint64_t want = 1 + rng() % 4000;
        if (admission.ReserveBytes(want).ok()) {
          const int64_t b = bytes_held.fetch_add(want) + want;
          int64_t mb = max_bytes_held.load();
          while (b > mb && !max_bytes_held.compare_exchange_weak(mb, b)) {}
          bytes_held.fetch_sub(want);
          admission.ReleaseBytes(want);
        }
        streams_held.fetch_sub(1);
        admission.ReleaseStream();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(max_streams_held.load(), static_cast<int>(limits.max_streams));
  EXPECT_LE(max_bytes_held.load(), static_cast<int64_t>(limits.max_inflight_bytes));
  EXPECT_EQ(admitted.load() + refused.load(), kThreads * 3000);
  EXPECT_GT(admitted.load(), 0);
  EXPECT_EQ(admission.active_streams(), 0u);
  EXPECT_EQ(admission.inflight_bytes(), 0u);
}

// A scrape must never count a call before its latency and bytes: dashboards divide one by the
// other, and a test that waits for requests_total then reads the rest relies on it.
TEST(ConcurrentMetricsTest, AScrapeThatCountsACallAlsoSeesItsLatencyAndBytes) {
  MetricsRegistry m;
  const ServiceMetrics metrics(m);
  constexpr int kPerThread = 3000;
  constexpr uint64_t kBytesIn = 100, kBytesOut = 40;
  std::atomic<bool> done{false};
  std::atomic<int> scrapes{0}, behind{0};
  std::string first_behind;
  std::thread scraper([&] {
    while (!done.load()) {
      auto v = testing::ParsePrometheusText(m.RenderText(), nullptr);
      const double calls = v["normgrad_requests_total{code=\"OK\",method=\"RmsNormBackward\"}"];
      const double timed = v["normgrad_request_duration_seconds_count{method=\"RmsNormBackward\"}"];
      const double in = v["normgrad_received_bytes_total{method=\"RmsNormBackward\"}"];
      const double out = v["normgrad_sent_bytes_total{method=\"RmsNormBackward\"}"];
      if (timed < calls || in < calls * kBytesIn || out < calls * kBytesOut) {
        if (behind.fetch_add(1) == 0) {
          first_behind = absl::StrCat(calls, " calls; ", timed, " timed, ", in, " bytes in, ",
                                      out, " bytes out");
        }
      }
      scrapes.fetch_add(1);
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics.RecordRpc("RmsNormBackward", absl::StatusCode::kOk, 0.001, kBytesIn, kBytesOut);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done.store(true);
  scraper.join();
  EXPECT_GT(scrapes.load(), 0);
  EXPECT_EQ(behind.load(), 0) << "first scrape with the count ahead: " << first_behind;
  auto v = testing::ParsePrometheusText(m.RenderText(), nullptr);
  EXPECT_EQ(v["normgrad_requests_total{code=\"OK\",method=\"RmsNormBackward\"}"],
            kThreads * kPerThread);
}

}  // namespace
}  // namespace normgrad::server
