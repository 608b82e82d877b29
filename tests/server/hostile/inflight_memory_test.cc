// normgrad-server as a subprocess driven to --max-inflight-bytes with the biggest legal messages:
// bf16 chunks of as many rows as fit in --max-message-bytes (so the bf16 -> f32 conversion
// staging runs on every chunk), from more streams than the budget holds. The server's peak
// resident memory (VmHWM from /proc/PID/status) must stay within what docs/operations.md
// ("Memory and overload") says the server may hold at the limit, above its warmed-up peak:
//   messages and responses admitted       --max-inflight-bytes
//   one message being read per stream     --max-streams x --max-message-bytes
//   CUDA staging pool (emulated driver:   2 x --max-inflight-bytes (pinned, and device memory,
//     device memory is host memory)         which the emulated driver keeps in host memory)
//   bf16/f16 conversion staging           (--cpu-threads + --worker-threads) x 12 x
//                                           max(16384, hidden_dim)
//   kSlackBytes                           gRPC's transport buffers (up to 30 MiB measured here)
// The figures are printed. On the CUDA backend it runs over the emulated driver; skipped when the
// build has none. Under sanitizers the bound is printed, not asserted (their runtimes add memory).
#include <algorithm>
#include <cstdio>
#include <cstring>
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

#ifndef NORMGRAD_EMULATED_CUDA
#error "NORMGRAD_EMULATED_CUDA must name the emulated driver library (empty: none)"
#endif

namespace normgrad::server {
namespace {

using ::normgrad::testing::ChildProcess;

constexpr uint64_t kMaxMessageBytes = 1ull << 20;
constexpr uint64_t kMaxInflightBytes = 12ull << 20;
constexpr uint32_t kStreams = 32;
constexpr uint32_t kHidden = 4096;
constexpr int kCpuThreads = 2;
constexpr int kWorkerThreads = 2;
constexpr uint64_t kSlackBytes = 48ull << 20;
// The largest chunk whose message (x and dy in bf16, with framing) fits in a message.
constexpr uint64_t kChunkRows = (kMaxMessageBytes - 64) / (2 * kHidden * 2);

using ::normgrad::testing::kSanitized;

// bf16 of a float (truncated: any finite value will do as input).
uint16_t Bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

std::string Bf16Bytes(uint64_t n, uint32_t seed) {
  std::string bytes(n * 2, '\0');
  uint32_t state = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    const float v = static_cast<float>(static_cast<int>(state >> 8) % 2001 - 1000) / 500.0f;
    const uint16_t b = Bf16(v == 0 ? 0.5f : v);
    std::memcpy(&bytes[i * 2], &b, 2);
  }
  return bytes;
}

struct StreamOutcome {
  grpc::Status status;
  uint64_t rows_back = 0;
};

// One bf16 stream of `chunks` chunks of `rows` rows (the same x and dy each chunk).
StreamOutcome RunBf16Stream(v1::NormGrad::Stub& stub, uint64_t rows, uint32_t chunks) {
  v1::BackwardRequest header;
  v1::BackwardHeader* h = header.mutable_header();
  h->set_num_rows(rows * chunks);
  h->set_hidden_dim(kHidden);
  h->set_eps(1e-5f);
  h->set_dtype(v1::DTYPE_BF16);
  h->set_gamma(Bf16Bytes(kHidden, 1));
  v1::BackwardRequest chunk;
  chunk.set_x(Bf16Bytes(rows * kHidden, 2));
  chunk.set_dy(Bf16Bytes(rows * kHidden, 3));

  StreamOutcome outcome;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto stream = stub.RmsNormBackward(&context);
  std::thread writer([&] {
    if (!stream->Write(header)) return;
    for (uint32_t c = 0; c < chunks; ++c) {
      if (!stream->Write(chunk)) return;
    }
    stream->WritesDone();
  });
  v1::BackwardResponse response;
  while (stream->Read(&response)) outcome.rows_back += response.num_rows();
  writer.join();
  outcome.status = stream->Finish();
  return outcome;
}

// Starts the server on `backend`, warms it up (modules loaded, threads started), then runs
// `rounds` of kStreams concurrent streams of `chunks` maximal chunks each. `bound_factor`: how
// many times --max-inflight-bytes the documented bound allows (1 on the CPU backend; 3 on the
// emulated driver, whose pinned and device staging are host memory).
void DriveToTheLimit(const std::string& backend, uint32_t chunks, int rounds,
                     uint64_t bound_factor) {
  // As the image runs it (Dockerfile): two malloc arenas, so freed memory is reused rather
  // than kept per thread (docs/operations.md).
  std::vector<std::string> args = {"/usr/bin/env", "MALLOC_ARENA_MAX=2"};
  if (backend == "cuda") {
    args.push_back(absl::StrCat("NORMGRAD_CUDA_DRIVER=", NORMGRAD_EMULATED_CUDA));
  }
  for (const std::string& a :
       {std::string(NORMGRAD_SERVER_BINARY), std::string("--listen=127.0.0.1:0"),
        std::string("--metrics-listen="), absl::StrCat("--backend=", backend),
        absl::StrCat("--cpu-threads=", kCpuThreads),
        absl::StrCat("--worker-threads=", kWorkerThreads), absl::StrCat("--max-streams=", kStreams),
        absl::StrCat("--max-streams-per-client=", kStreams),
        absl::StrCat("--max-message-bytes=", kMaxMessageBytes),
        absl::StrCat("--max-inflight-bytes=", kMaxInflightBytes),
        std::string("--stream-idle-timeout=60s")}) {
    args.push_back(a);
  }
  absl::StatusOr<ChildProcess> server = ChildProcess::Start(args);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->AwaitReady(absl::Seconds(60)).grpc_port;
  ASSERT_GT(port, 0);

  auto warm_stub = testing::StubFor(port);
  const StreamOutcome warm = RunBf16Stream(*warm_stub, 1, 1);
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  const uint64_t baseline = server->StatusBytes("VmHWM:");
  ASSERT_GT(baseline, 0u);

  std::vector<std::unique_ptr<v1::NormGrad::Stub>> stubs;
  for (uint32_t i = 0; i < kStreams; ++i) stubs.push_back(testing::StubFor(port));
  int ok = 0, refused_by_bytes = 0;
  for (int round = 0; round < rounds; ++round) {
    std::vector<StreamOutcome> outcomes(kStreams);
    std::vector<std::thread> threads;
    for (uint32_t i = 0; i < kStreams; ++i) {
      threads.emplace_back([&, i] { outcomes[i] = RunBf16Stream(*stubs[i], kChunkRows, chunks); });
    }
    for (std::thread& t : threads) t.join();
    for (const StreamOutcome& o : outcomes) {
      if (o.status.ok()) {
        ++ok;
        EXPECT_EQ(o.rows_back, kChunkRows * chunks);
        continue;
      }
      // The only refusal expected: the budget, named in the message.
      EXPECT_EQ(o.status.error_code(), grpc::RESOURCE_EXHAUSTED) << o.status.error_message();
      EXPECT_NE(o.status.error_message().find("(--max-inflight-bytes)"), std::string::npos)
          << o.status.error_message();
      ++refused_by_bytes;
    }
  }
  const uint64_t peak = server->StatusBytes("VmHWM:");
  const uint64_t reading = uint64_t{kStreams} * kMaxMessageBytes;
  const uint64_t conversion =
      uint64_t{kCpuThreads + kWorkerThreads} * 12 * std::max<uint64_t>(16384, kHidden);
  const uint64_t bound =
      baseline + bound_factor * kMaxInflightBytes + reading + conversion + kSlackBytes;
  std::printf(
      "inflight memory (%s): %u streams x %d rounds of %u bf16 chunks of %llu rows x %u "
      "(%.2f MiB messages); %d completed, %d refused by --max-inflight-bytes; VmHWM %.1f MiB "
      "warmed up, %.1f MiB peak (+%.1f MiB) vs bound %.1f MiB (+%.1f MiB: %llu x "
      "--max-inflight-bytes %.0f MiB, reads %.0f MiB, conversion %.2f MiB, slack %.0f MiB)\n",
      backend.c_str(), kStreams, rounds, chunks, static_cast<unsigned long long>(kChunkRows),
      kHidden, (2.0 * kChunkRows * kHidden * 2) / 1048576.0, ok, refused_by_bytes,
      baseline / 1048576.0, peak / 1048576.0, (peak - baseline) / 1048576.0, bound / 1048576.0,
      (bound - baseline) / 1048576.0, static_cast<unsigned long long>(bound_factor),
      kMaxInflightBytes / 1048576.0, reading / 1048576.0, conversion / 1048576.0,
      kSlackBytes / 1048576.0);
  EXPECT_GE(ok, 1);
  // The streams' demand (3 chunks held each) is past the budget: it was reached.
  EXPECT_GT(uint64_t{kStreams} * 3 * (3 * kMaxMessageBytes / 2), kMaxInflightBytes);
  if (!kSanitized) {
    EXPECT_LE(peak, bound);
  }
}

TEST(InflightMemoryTest, CpuBackendStaysWithinTheDocumentedBoundWithMaximalBf16Chunks) {
  DriveToTheLimit("cpu", 8, 2, 1);
}

TEST(InflightMemoryTest, EmulatedCudaStaysWithinTheDocumentedBoundWithMaximalBf16Chunks) {
  if (std::string(NORMGRAD_EMULATED_CUDA).empty()) {
    GTEST_SKIP() << "built without the emulated CUDA driver (no cuda.h)";
  }
  DriveToTheLimit("cuda", 4, 1, 3);
}

}  // namespace
}  // namespace normgrad::server
