// The load generator's arithmetic and reports, on hand-made records with known answers.
#include "client/tools/load_stats.h"

#include <string>
#include <vector>

#include "client/tools/load_flags.h"
#include "client/tools/load_report.h"
#include "gtest/gtest.h"

namespace normgrad::tools {
namespace {

std::vector<RequestRecord> OneToHundredMs() {
  std::vector<RequestRecord> records;
  for (int i = 100; i >= 1; --i) records.push_back({i / 1000.0, absl::StatusCode::kOk, 1000});
  return records;
}

TEST(PercentileTest, NearestRankOnOneToHundred) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  EXPECT_EQ(Percentile(v, 0), 1);
  EXPECT_EQ(Percentile(v, 50), 50);
  EXPECT_EQ(Percentile(v, 90), 90);
  EXPECT_EQ(Percentile(v, 99), 99);
  EXPECT_EQ(Percentile(v, 99.9), 100);
  EXPECT_EQ(Percentile(v, 100), 100);
  EXPECT_EQ(Percentile(std::vector<double>{7}, 99.9), 7);
}

TEST(SummarizeTest, CountsThroughputAndLatencies) {
  std::vector<RequestRecord> records = OneToHundredMs();
  records.push_back({0.5, absl::StatusCode::kResourceExhausted, 1000});
  records.push_back({0.5, absl::StatusCode::kResourceExhausted, 1000});
  records.push_back({0.5, absl::StatusCode::kDeadlineExceeded, 1000});
  const RunStats s = Summarize(records, /*wall_seconds=*/2.0, /*concurrency=*/4);
  EXPECT_EQ(s.concurrency, 4);
  EXPECT_EQ(s.requests, 103u);
  EXPECT_EQ(s.successes, 100u);
  EXPECT_EQ(s.errors_by_code.at("RESOURCE_EXHAUSTED"), 2u);
  EXPECT_EQ(s.errors_by_code.at("DEADLINE_EXCEEDED"), 1u);
  EXPECT_EQ(s.errors_by_code.count("OK"), 0u);
  EXPECT_DOUBLE_EQ(s.requests_per_second, 51.5);
  EXPECT_DOUBLE_EQ(s.successes_per_second, 50);
  EXPECT_DOUBLE_EQ(s.payload_gb_per_second, 100 * 1000 / 2.0 / 1e9);  // successes only
  // Latencies of successes only: 1..100 ms.
  EXPECT_DOUBLE_EQ(s.min_ms, 1);
  EXPECT_DOUBLE_EQ(s.max_ms, 100);
  EXPECT_DOUBLE_EQ(s.mean_ms, 50.5);
  EXPECT_DOUBLE_EQ(s.p50_ms, 50);
  EXPECT_DOUBLE_EQ(s.p95_ms, 95);
  EXPECT_DOUBLE_EQ(s.p99_ms, 99);
  EXPECT_DOUBLE_EQ(s.p999_ms, 100);
}

TEST(SummarizeTest, NoRecordsGiveZerosNotNaN) {
  const RunStats s = Summarize({}, 0, 1);
  EXPECT_EQ(s.requests, 0u);
  EXPECT_EQ(s.p99_ms, 0);
  EXPECT_EQ(s.requests_per_second, 0);
  EXPECT_TRUE(s.histogram.empty());
}

TEST(HistogramTest, CountsSumToTheNumberOfSuccessesAndCoverMinToMax) {
  const RunStats s = Summarize(OneToHundredMs(), 1, 1, /*histogram_buckets=*/10);
  ASSERT_EQ(s.histogram.size(), 10u);
  uint64_t total = 0;
  for (const HistogramBucket& b : s.histogram) total += b.count;
  EXPECT_EQ(total, 100u);
  EXPECT_DOUBLE_EQ(s.histogram.front().lower_ms, 1);
  EXPECT_DOUBLE_EQ(s.histogram.back().upper_ms, 100);
  EXPECT_EQ(s.histogram.back().count, 10u);  // 90.1..100 ms, max included
}

TEST(HistogramTest, EqualLatenciesMakeOneBucket) {
  const std::vector<double> same = {2, 2, 2};
  const std::vector<HistogramBucket> h = Histogram(same, 20);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].count, 3u);
}

TEST(StabilityTest, NeedsThreeWindowsWithinTheBand) {
  auto window = [](double rps, double p99) {
    RunStats s;
    s.successes_per_second = rps;
    s.p99_ms = p99;
    return s;
  };
  EXPECT_FALSE(IsStable({window(100, 5), window(100, 5)}, 10));
  EXPECT_TRUE(IsStable({window(10, 50), window(100, 5), window(105, 5.2), window(97, 4.9)}, 10));
  EXPECT_FALSE(IsStable({window(100, 5), window(130, 5), window(100, 5)}, 10));  // throughput
  EXPECT_FALSE(IsStable({window(100, 5), window(100, 8), window(100, 5)}, 10));  // p99
}

TEST(ReportTest, JsonCarriesEveryCountAndErrorCode) {
  std::vector<RequestRecord> records = OneToHundredMs();
  records.push_back({0.5, absl::StatusCode::kResourceExhausted, 0});
  const std::vector<RunStats> runs = {Summarize(records, 2.0, 4)};
  const std::string json = FormatJson({"backward", "127.0.0.1:1", "2x8"}, runs);
  EXPECT_NE(json.find("\"requests\":101"), std::string::npos) << json;
  EXPECT_NE(json.find("\"successes\":100"), std::string::npos);
  EXPECT_NE(json.find("\"errors\":1"), std::string::npos);
  EXPECT_NE(json.find("\"errors_by_code\":{\"RESOURCE_EXHAUSTED\":1}"), std::string::npos);
  EXPECT_NE(json.find("\"p99\":99"), std::string::npos);
  EXPECT_NE(json.find("\"p99.9\":100"), std::string::npos);
  EXPECT_NE(json.find("\"histogram\":[{"), std::string::npos);
}

TEST(ReportTest, CsvHasAHeaderAndOneRowPerRun) {
  const std::vector<RunStats> runs = {Summarize(OneToHundredMs(), 1, 1),
                                      Summarize(OneToHundredMs(), 1, 2)};
  const std::string csv = FormatCsv(runs);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 3);
  EXPECT_EQ(csv.rfind("concurrency,requests,successes,errors,", 0), 0u);
  EXPECT_NE(csv.find("\n2,100,100,0,"), std::string::npos) << csv;
}

TEST(ReportTest, HtmlIsSelfContainedWithHistogramAndSweepCharts) {
  std::vector<RunStats> runs = {Summarize(OneToHundredMs(), 1, 1),
                                Summarize(OneToHundredMs(), 1, 2)};
  ReportContext context{"backward", "a<b", "1x8"};
  context.sweep = true;
  const std::string html = FormatHtml(context, runs);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_NE(html.find("<polyline"), std::string::npos);  // throughput / p99 vs concurrency
  EXPECT_NE(html.find("p99 latency (ms) vs concurrency"), std::string::npos);
  EXPECT_NE(html.find("<rect"), std::string::npos);   // histogram bars
  EXPECT_NE(html.find("a&lt;b"), std::string::npos);  // escaped
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("http://cdn"), std::string::npos);
  EXPECT_EQ(html.find("https://"), std::string::npos);
}

TEST(ReportTest, SummaryListsStatusCodes) {
  std::vector<RequestRecord> records = OneToHundredMs();
  records.push_back({0.5, absl::StatusCode::kUnavailable, 0});
  const std::string text = FormatSummary({"backward", "t", "1x8"}, {Summarize(records, 1, 1)});
  EXPECT_NE(text.find("Requests:      101 (successes 100, errors 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("UNAVAILABLE"), std::string::npos);
  EXPECT_NE(text.find("p99.9 100.000"), std::string::npos);
}

TEST(LoadFlagsTest, ParsesShapesAndRejectsBadOnes) {
  absl::StatusOr<std::vector<Shape>> shapes = ParseShapes("64x4096, 1x8");
  ASSERT_TRUE(shapes.ok());
  ASSERT_EQ(shapes->size(), 2u);
  EXPECT_EQ((*shapes)[1].rows, 1u);
  EXPECT_EQ((*shapes)[1].hidden_dim, 8u);
  for (const char* bad : {"", "64", "0x8", "8x0", "axb", "1x2x3"})
    EXPECT_FALSE(ParseShapes(bad).ok()) << bad;
}

TEST(LoadFlagsTest, DefaultsAreBoundedAndFlagsLandInTheConfig) {
  absl::StatusOr<LoadCommand> d = ParseLoadCommand({}, "");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->config.total, 200u);  // never unbounded
  EXPECT_EQ(d->config.max_duration, absl::Seconds(60));
  EXPECT_EQ(d->target_text, "localhost:50051");

  absl::StatusOr<LoadCommand> c =
      ParseLoadCommand({"--target=127.0.0.1:5,127.0.0.1:6", "--call", "emit-ptx", "--concurrency=3",
                        "--connections=2", "--duration=2s", "--rate=50", "--rate-dist=poisson",
                        "--concurrency-sweep=1:9:4", "--format=json", "--warmup=5"},
                       "ignored:1");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->config.client.target, "127.0.0.1:5,127.0.0.1:6");
  EXPECT_EQ(c->config.call, LoadCall::kEmitPtx);
  EXPECT_EQ(c->config.concurrency, 3);
  EXPECT_EQ(c->config.connections, 2);
  EXPECT_EQ(c->config.total, 0u);
  EXPECT_EQ(c->config.duration, absl::Seconds(2));
  EXPECT_TRUE(c->config.poisson);
  EXPECT_TRUE(c->config.sweep);
  EXPECT_EQ(c->config.sweep_end, 9);
  EXPECT_EQ(c->config.sweep_step, 4);
  EXPECT_EQ(c->config.warmup, 5u);
  EXPECT_EQ(c->output.format, "json");
}

TEST(LoadFlagsTest, BadFlagsAreInvalidArgumentNamingTheFlag) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--call=frob"},
                                             {"--concurrency=x"},
                                             {"--duration=soon"},
                                             {"--rate-dist=uniform"},
                                             {"--format=xml"},
                                             {"--concurrency-sweep=4"},
                                             {"--bogus"}}) {
    absl::StatusOr<LoadCommand> c = ParseLoadCommand(args, "");
    ASSERT_FALSE(c.ok()) << args[0];
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string flag = args[0].substr(0, args[0].find('='));
    EXPECT_NE(c.status().message().find(flag), absl::string_view::npos) << c.status();
  }
}

TEST(LoadRunnerTest, RejectsUnboundedAndEmptyConfigurations) {
  LoadConfig config;
  config.total = 0;
  config.duration = absl::ZeroDuration();
  EXPECT_FALSE(LoadRunner::Create(config).ok());
  config.total = 1;
  config.concurrency = 0;
  EXPECT_FALSE(LoadRunner::Create(config).ok());
  config.concurrency = 1;
  config.sweep = true;
  config.sweep_start = 5;
  config.sweep_end = 2;
  EXPECT_FALSE(LoadRunner::Create(config).ok());
}

}  // namespace
}  // namespace normgrad::tools
