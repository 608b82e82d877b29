// Hundreds of RmsNormBackward streams at once against normgrad-server as a subprocess, far past
// --max-streams and --max-inflight-bytes: the excess get RESOURCE_EXHAUSTED, and each refusal
// names the limit that refused it (both limits must refuse some; their latency is printed), every
// accepted stream returns the reference result, and the server's peak resident
// memory (VmHWM from /proc/PID/status) stays under its warmed-up peak + --max-inflight-bytes +
// kOverheadBytes (gRPC's per-stream transport buffers and thread stacks; docs/testing.md).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/common/child_process.h"
#include "tests/common/sanitized.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::normgrad::testing::ChildProcess;

// 16 admitted streams x 3 chunks held x 768 KiB reserved per chunk (below) is 36 MiB, far past
// this: streams whose first chunk finds the budget spent are refused by --max-inflight-bytes.
constexpr uint64_t kMaxInflightBytes = 4ull << 20;
constexpr uint64_t kOverheadBytes = 96ull << 20;
constexpr int kStreams = 256;

// Sanitizer runtimes (ASan's quarantine, TSan's shadow) add their own memory to the server's:
// there the bound is printed, not asserted. The server is built in the same tree as this test.
using ::normgrad::testing::kSanitized;

TEST(OverloadTest, StreamsBeyondAdmissionLimitsAreRefusedAcceptedOnesExactMemoryBounded) {
  // stdout on a pipe for the ready line, stderr inherited; SIGKILL at the end.
  absl::StatusOr<ChildProcess> server = ChildProcess::Start(
      {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--metrics-listen=", "--backend=cpu",
       "--cpu-threads=2", "--max-streams=16",
       // One client here (every channel from 127.0.0.1): the global limits are under test, not
       // the per-client share (fairness_test).
       "--max-streams-per-client=16",
       absl::StrCat("--max-inflight-bytes=", kMaxInflightBytes), "--stream-idle-timeout=20s"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->AwaitReady(absl::Seconds(60)).grpc_port;
  ASSERT_GT(port, 0);

  // 64 rows x 4096 f32: 1 MiB of x and of dy per stream, in 16-row chunks of 256 KiB (each
  // reserves its request, x and dy, and its response, dx: 768 KiB).
  const testing::Batch batch = testing::RandomBatch(64, 4096, 21);
  std::vector<float> dx, dgamma;
  testing::ReferenceFor(batch, dx, dgamma);
  auto warm_stub = testing::StubFor(port);
  const testing::BackwardResult warm = testing::RunBackward(*warm_stub, batch, 16);
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  const uint64_t baseline = server->StatusBytes("VmHWM:");
  ASSERT_GT(baseline, 0u);

  std::vector<std::unique_ptr<v1::NormGrad::Stub>> stubs;
  for (int c = 0; c < 8; ++c) stubs.push_back(testing::StubFor(port));
  std::vector<testing::BackwardResult> results(kStreams);
  std::vector<double> seconds(kStreams);
  std::promise<void> start;
  std::shared_future<void> go = start.get_future().share();
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      go.wait();
      const absl::Time start = absl::Now();
      results[i] = testing::RunBackward(*stubs[i % stubs.size()], batch, 16, absl::Seconds(120));
      seconds[i] = absl::ToDoubleSeconds(absl::Now() - start);
    });
  }
  std::atomic<bool> done{false};
  uint64_t peak_rss_sampled = 0;
  std::thread sampler([&] {
    while (!done.load()) {
      peak_rss_sampled = std::max(peak_rss_sampled, server->StatusBytes("VmRSS:"));
      absl::SleepFor(absl::Milliseconds(10));
    }
  });
  start.set_value();
  for (std::thread& t : threads) t.join();
  done.store(true);
  sampler.join();
  const uint64_t peak = server->StatusBytes("VmHWM:");

  int ok = 0, refused = 0, refused_by_streams = 0, refused_by_bytes = 0;
  std::vector<double> refused_seconds;
  for (int i = 0; i < kStreams; ++i) {
    const testing::BackwardResult& r = results[i];
    if (r.status.ok()) {
      ++ok;
      EXPECT_LE(testing::MaxDxError(batch, r.dx, dx), 1e-5) << "stream " << i;
      EXPECT_LE(testing::MaxScaledError(r.dgamma, dgamma), 1e-5) << "stream " << i;
    } else {
      EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED)
          << "stream " << i << ": " << r.status.error_message();
      // The refusal names its flag (docs/api.md): exactly one of the two.
      const bool by_streams = r.status.error_message().find("(--max-streams)") != std::string::npos;
      const bool by_bytes =
          r.status.error_message().find("(--max-inflight-bytes)") != std::string::npos;
      EXPECT_NE(by_streams, by_bytes) << "stream " << i << ": " << r.status.error_message();
      refused_by_streams += by_streams;
      refused_by_bytes += by_bytes;
      ++refused;
      refused_seconds.push_back(seconds[i]);
    }
  }
  // Most admitted streams find the 4 MiB budget spent (5-16 of 256 completed in runs here).
  EXPECT_GE(ok, 1);
  EXPECT_GT(refused_by_streams, 0) << "--max-streams never refused a stream";
  EXPECT_GT(refused_by_bytes, 0) << "--max-inflight-bytes never refused a stream";
  if (!kSanitized) {
    EXPECT_LE(peak, baseline + kMaxInflightBytes + kOverheadBytes);
  }
  std::sort(refused_seconds.begin(), refused_seconds.end());
  std::printf(
      "overload: %d streams, %d completed, %d RESOURCE_EXHAUSTED (%d by --max-streams, %d by "
      "--max-inflight-bytes; median %.3f s, max %.3f s); "
      "server VmHWM %.1f MiB after warm-up, %.1f MiB peak (sampled VmRSS peak %.1f MiB); "
      "bound %.1f MiB\n",
      kStreams, ok, refused, refused_by_streams, refused_by_bytes,
      refused_seconds.empty() ? 0.0 : refused_seconds[refused_seconds.size() / 2],
      refused_seconds.empty() ? 0.0 : refused_seconds.back(), baseline / 1048576.0,
      peak / 1048576.0, peak_rss_sampled / 1048576.0,
      (baseline + kMaxInflightBytes + kOverheadBytes) / 1048576.0);
}

}  // namespace
}  // namespace normgrad::server
