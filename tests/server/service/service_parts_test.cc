// The service's gRPC-free parts: metrics rendering, admission accounting, sha256, nvJitLink
// loading, host:port parsing and --preload entries.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/service/admission.h"
#include "server/service/metrics.h"
#include "server/service/process_memory.h"
#include "server/service/metrics_http_server.h"
#include "server/service/normgrad_server.h"
#include "server/service/nvjitlink.h"
#include "server/service/sha256.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

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

TEST(AdmissionControllerTest, RefusesStreamsAndBytesBeyondTheLimitsAndNamesTheFlags) {
  AdmissionController a({.max_streams = 2, .max_inflight_bytes = 100});
  EXPECT_TRUE(a.AdmitStream().ok());
  EXPECT_TRUE(a.AdmitStream().ok());
  absl::Status third = a.AdmitStream();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(), HasSubstr("--max-streams"));
  a.ReleaseStream();
  EXPECT_TRUE(a.AdmitStream().ok());

  EXPECT_TRUE(a.ReserveBytes(60).ok());
  absl::Status over = a.ReserveBytes(41);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("needs 41 bytes, 60 of 100 are in use"));
  EXPECT_TRUE(a.ReserveBytes(40).ok());
  a.ReleaseBytes(100);
  EXPECT_EQ(a.inflight_bytes(), 0u);
}

TEST(ProcessMemoryTest, HeapInUseFollowsAnAllocationAndItsRelease) {
  const ProcessMemory before = ReadProcessMemory();
  EXPECT_GT(before.resident_bytes, 0u);
  if (before.heap_in_use_bytes == 0) GTEST_SKIP() << "malloc is replaced (sanitizer build)";
  constexpr size_t kBytes = 64 << 20;
  std::vector<char> block(kBytes, 1);  // touched: resident too
  const ProcessMemory held = ReadProcessMemory();
  EXPECT_GE(held.heap_in_use_bytes, before.heap_in_use_bytes + kBytes);
  EXPECT_GE(held.resident_bytes, before.resident_bytes + kBytes / 2);
  block = {};
  block.shrink_to_fit();
  const ProcessMemory after = ReadProcessMemory();
  EXPECT_LT(after.heap_in_use_bytes, held.heap_in_use_bytes - kBytes / 2);
}

TEST(Sha256Test, KnownAnswers) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(NvJitLinkTest, MissingLibraryIsFailedPreconditionNamingThePath) {
  auto jit = NvJitLink::Load("/nonexistent/libnvJitLink.so");
  ASSERT_FALSE(jit.ok());
  EXPECT_EQ(jit.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(jit.status().message(), HasSubstr("/nonexistent/libnvJitLink.so"));
  EXPECT_THAT(jit.status().message(), HasSubstr("--nvjitlink"));
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

TEST(PreloadEntryTest, ParsesKernelTargetAndHiddenDim) {
  auto e = ParsePreloadEntry("batched_rms_norm_backward:sm_90:896");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->config.target_sm, 90);
  EXPECT_EQ(e->config.hidden_dim, 896u);
  EXPECT_THAT(ParsePreloadEntry("nope:sm_90").status().message(), HasSubstr("unknown kernel"));
  EXPECT_THAT(ParsePreloadEntry("batched_rms_norm_backward").status().message(),
              HasSubstr("KERNEL:TARGET[:HIDDEN_DIM]"));
  EXPECT_FALSE(ParsePreloadEntry("rms_norm_backward:sm_90:64").ok());  // warp kernel: <= 32
}

}  // namespace
}  // namespace normgrad::server
