// The metrics registry (rendering that parses, recording from many threads while rendering) and
// the HOST:PORT parsing of the listen flags. The concurrent test runs in the `tsan` stage
// (docs/testing.md).
#include "server/metrics/metrics.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics_http_server.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

constexpr int kThreads = 6;

TEST(MetricsRegistryTest, RendersCountersGaugesAndCumulativeHistogramsThatParse) {
  MetricsRegistry m;
  m.DescribeCounter("t_requests_total", "Requests.");
  m.DescribeGauge("t_inflight", "In flight.");
  m.DescribeHistogram("t_latency_seconds", "Latency.", {0.1, 1.0});
  m.IncrementCounter("t_requests_total", {{"method", "A"}, {"code", "OK"}});
  m.IncrementCounter("t_requests_total", {{"method", "A"}, {"code", "OK"}}, 2);
  m.SetGauge("t_inflight", {}, 3);
  m.Observe("t_latency_seconds", {{"method", "A"}}, 0.05);
  m.Observe("t_latency_seconds", {{"method", "A"}}, 0.5);
  m.Observe("t_latency_seconds", {{"method", "A"}}, 5);
  m.AddCollector([](MetricsRegistry& r) { r.SetGauge("t_inflight", {{"k", "q\"uote"}}, 7); });
  const std::string text = m.RenderText();
  EXPECT_THAT(text, HasSubstr("# TYPE t_requests_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE t_latency_seconds histogram\n"));
  std::string error;
  auto values = testing::ParsePrometheusText(text, &error);
  ASSERT_FALSE(values.empty()) << error << "\n" << text;
  EXPECT_EQ(values["t_requests_total{method=\"A\",code=\"OK\"}"], 3);
  EXPECT_EQ(values["t_inflight"], 3);
  EXPECT_EQ(values["t_inflight{k=\"q\\\"uote\"}"], 7);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"A\",le=\"0.1\"}"], 1);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"A\",le=\"1\"}"], 2);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"A\",le=\"+Inf\"}"], 3);
  EXPECT_EQ(values["t_latency_seconds_count{method=\"A\"}"], 3);
  EXPECT_DOUBLE_EQ(values["t_latency_seconds_sum{method=\"A\"}"], 5.55);
}

TEST(ConcurrentMetricsTest, RecordingFromManyThreadsWhileRenderingLosesNoUpdate) {
  MetricsRegistry m;
  m.DescribeCounter("t_requests_total", "Requests.");
  m.DescribeHistogram("t_latency_seconds", "Latency.", {0.001, 0.01, 0.1});
  m.DescribeGauge("t_collected", "Set by a collector.");
  std::atomic<int> collected{0};
  m.AddCollector([&](MetricsRegistry& r) { r.SetGauge("t_collected", {}, collected.fetch_add(1)); });
  constexpr int kPerThread = 2000;
  std::atomic<bool> done{false};
  std::atomic<int> renders{0};
  std::thread renderer([&] {
    while (!done.load()) {
      std::string error;
      ASSERT_FALSE(testing::ParsePrometheusText(m.RenderText(), &error).empty()) << error;
      renders.fetch_add(1);
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string method = t % 2 == 0 ? "A" : "B";
      for (int i = 0; i < kPerThread; ++i) {
        m.IncrementCounter("t_requests_total", {{"method", method}});
        m.Observe("t_latency_seconds", {{"method", method}}, (i % 4) * 0.004);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done.store(true);
  renderer.join();
  std::string error;
  auto values = testing::ParsePrometheusText(m.RenderText(), &error);
  ASSERT_TRUE(error.empty()) << error;
  const double per_method = kThreads / 2 * kPerThread;
  EXPECT_EQ(values["t_requests_total{method=\"A\"}"], per_method);
  EXPECT_EQ(values["t_requests_total{method=\"B\"}"], per_method);
  EXPECT_EQ(values["t_latency_seconds_count{method=\"A\"}"], per_method);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"B\",le=\"0.001\"}"], per_method / 4);
  EXPECT_GT(renders.load(), 0);
  EXPECT_EQ(values["t_collected"], collected.load() - 1);
}

TEST(SplitHostPortTest, ParsesHostsAndRejectsBadPorts) {
  std::string host;
  int port = -1;
  ASSERT_TRUE(SplitHostPort("127.0.0.1:0", "listen", &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 0);
  ASSERT_TRUE(SplitHostPort("[::1]:8080", "listen", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 8080);
  EXPECT_THAT(SplitHostPort("nohost", "listen", &host, &port).message(),
              HasSubstr("--listen=nohost is not HOST:PORT"));
  EXPECT_FALSE(SplitHostPort("h:70000", "listen", &host, &port).ok());
}

}  // namespace
}  // namespace normgrad::server
