// The metrics registry (rendering that parses, the latency buckets' le labels, what counters and
// gauges do with a set value, recording from many threads while rendering), the
// HTTP server's bound on slow clients, and the HOST:PORT parsing of the listen flags. The two
// concurrent tests run in the `tsan` stage (docs/testing.md).
#include "server/metrics/metrics.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
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
  EXPECT_EQ(values["t_requests_total{code=\"OK\",method=\"A\"}"], 3);
  EXPECT_EQ(values["t_inflight"], 3);
  EXPECT_EQ(values["t_inflight{k=\"q\\\"uote\"}"], 7);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"A\",le=\"0.1\"}"], 1);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"A\",le=\"1\"}"], 2);
  EXPECT_EQ(values["t_latency_seconds_bucket{method=\"A\",le=\"+Inf\"}"], 3);
  EXPECT_EQ(values["t_latency_seconds_count{method=\"A\"}"], 3);
  EXPECT_DOUBLE_EQ(values["t_latency_seconds_sum{method=\"A\"}"], 5.55);
}

// The le labels dashboards name: LatencyBuckets' bounds are rounded to the 9 digits they have
// always been rendered with, and prometheus-cpp's 16 digits print them the same, but for the
// last (no double prints as 93.1322575).
TEST(MetricsRegistryTest, LatencyBucketsKeepTheirLeLabels) {
  MetricsRegistry m;
  m.DescribeHistogram("t_seconds", "Latency.", MetricsRegistry::LatencyBuckets());
  m.Observe("t_seconds", {}, 0.2);
  std::vector<std::string> le;
  for (absl::string_view line : absl::StrSplit(m.RenderText(), '\n')) {
    if (absl::ConsumePrefix(&line, "t_seconds_bucket{le=\"")) {
      le.emplace_back(line.substr(0, line.find('"')));
    }
  }
  EXPECT_THAT(le,
              ::testing::ElementsAre("0.0001", "0.00025", "0.000625", "0.0015625", "0.00390625",
                                     "0.009765625", "0.0244140625", "0.0610351562", "0.152587891",
                                     "0.381469727", "0.953674316", "2.38418579", "5.96046448",
                                     "14.9011612", "37.252903", "93.13225749999999", "+Inf"));
}

// A counter set from a total kept elsewhere follows it up and never goes down (an older total,
// read by a collector that came second, is ignored), nor does a negative increment take it
// down; a gauge goes both ways. A metric never described is rendered untyped; one described
// without a series yet has its HELP and TYPE and no sample.
TEST(MetricsRegistryTest, CountersOnlyGoUpGaugesBothWaysUndescribedIsUntyped) {
  MetricsRegistry m;
  const Counter total(m, "t_total", "A total kept elsewhere.", {"k"});
  const Gauge level(m, "t_level", "A level.");
  const Counter unused(m, "t_unused_total", "Never recorded.");
  auto value = [&m](const std::string& key) {
    std::string error;
    std::map<std::string, double> values = testing::ParsePrometheusText(m.RenderText(), &error);
    EXPECT_TRUE(error.empty()) << error;
    return values.count(key) == 0 ? -1 : values[key];
  };
  total.Set({{"k", "a"}}, 5);
  EXPECT_EQ(value("t_total{k=\"a\"}"), 5);
  total.Set({{"k", "a"}}, 12.5);
  EXPECT_EQ(value("t_total{k=\"a\"}"), 12.5);
  total.Set({{"k", "a"}}, 7);
  total.Increment({{"k", "a"}}, -1);
  EXPECT_EQ(value("t_total{k=\"a\"}"), 12.5);
  total.Increment({{"k", "a"}}, 0.5);
  EXPECT_EQ(value("t_total{k=\"a\"}"), 13);
  level.Set(3);
  level.Set(1);
  level.Add({}, -0.25);
  EXPECT_EQ(value("t_level"), 0.75);
  m.IncrementCounter("t_undescribed", {{"k", "b"}}, 2);
  EXPECT_EQ(value("t_undescribed{k=\"b\"}"), 2);
  const std::string text = m.RenderText();
  EXPECT_THAT(text, HasSubstr("# TYPE t_undescribed untyped\n"));
  EXPECT_THAT(text, HasSubstr("# HELP t_unused_total Never recorded.\n"
                              "# TYPE t_unused_total counter\n"));
  EXPECT_EQ(value("t_unused_total"), -1);
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

// A client that sends a request a byte at a time, each byte well within the read timeout, never
// finishing: every read succeeds in time, so only a bound on the whole connection ends it.
class Trickler {
 public:
  explicit Trickler(int port) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    thread_ = std::thread([this] {
      const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: ";
      for (size_t i = 0; !stop_.load(); ++i) {
        const char byte = i < request.size() ? request[i] : 'a';
        if (send(fd_, &byte, 1, MSG_NOSIGNAL) != 1) {
          closed_by_server_ = true;
          return;
        }
        for (int t = 0; t < 20 && !stop_.load(); ++t) absl::SleepFor(absl::Milliseconds(10));
      }
    });
  }
  ~Trickler() {
    stop_ = true;
    thread_.join();
    close(fd_);
  }
  bool connected() const { return connected_; }
  bool closed_by_server() const { return closed_by_server_.load(); }

 private:
  const int fd_;
  bool connected_ = false;
  std::atomic<bool> stop_{false};
  std::atomic<bool> closed_by_server_{false};
  std::thread thread_;
};

// More slow clients than workers: with each read and write bounded but not the connection, they
// held every worker for ever and scrapes timed out. Each is now cut when its connection has run
// for connection_time, and a scrape waiting behind them is answered.
TEST(ConcurrentMetricsHttpTest, SlowClientsAreCutAtTheConnectionTimeAndScrapesGetThrough) {
  MetricsRegistry registry;
  Counter scrapes(registry, "normgrad_test_total", "A counter to find in the scrape.");
  scrapes.Increment();
  MetricsHttpLimits limits;
  limits.workers = 2;
  limits.connection_time = absl::Milliseconds(1500);
  limits.io_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", &registry, {}, limits);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<std::unique_ptr<Trickler>> slow;
  for (int i = 0; i < 4; ++i) {
    slow.push_back(std::make_unique<Trickler>((*server)->port()));
    ASSERT_TRUE(slow.back()->connected());
  }
  absl::SleepFor(absl::Milliseconds(300));  // the slow clients hold both workers
  const absl::Time start = absl::Now();
  std::future<std::pair<int, std::string>> scrape = std::async(std::launch::async, [&] {
    int status = 0;
    std::string body = testing::HttpGet((*server)->port(), "/metrics", &status);
    return std::make_pair(status, body);
  });
  // Two connection times for the first two slow clients, two more for the other two if they
  // came first: the scrape is answered well within 10 s; without the bound it never is.
  ASSERT_EQ(scrape.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the scrape waited behind slow clients for 10 s";
  const std::pair<int, std::string> answer = scrape.get();
  EXPECT_EQ(answer.first, 200);
  EXPECT_THAT(answer.second, HasSubstr("normgrad_test_total 1"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900)) << "it did wait for a worker";
  // The slow clients were closed by the server, not left waiting.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  auto all_closed = [&] {
    for (const auto& t : slow) {
      if (!t->closed_by_server()) return false;
    }
    return true;
  };
  while (!all_closed() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(all_closed());
}

}  // namespace
}  // namespace normgrad::server
