// normgrad::Client against a real server on loopback: chunking of batches larger than the
// message limit, chunk boundaries, caller-provided buffers, rms, deadlines, retries onto a
// second server, concurrent asynchronous calls, and server errors passed through untouched.
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "tests/client/test_server.h"

namespace normgrad {
namespace {

using ::normgrad::testing::Address;
using ::normgrad::testing::Batch;
using ::normgrad::testing::DeadPort;
using ::normgrad::testing::ExpectClose;
using ::normgrad::testing::ExpectGradientsClose;

class ClientServerTest : public testing::TestServerFixture {
 protected:
  std::unique_ptr<Client> Connect(ClientOptions options = {}) {
    if (options.target == ClientOptions().target) options.target = Address(*server_);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
};

TEST_F(ClientServerTest, SmallBatchMatchesReference) {
  const Batch b(3, 8, /*seed=*/1);
  absl::StatusOr<Gradients> g = Connect()->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, b);
  EXPECT_EQ(g->summary.backend, "cpu");
  EXPECT_EQ(g->summary.rows, 3u);
  EXPECT_EQ(g->attempts, 1);
}

// The float call's gamma_offset: the bits of gamma + offset sent as gamma (exact for these
// values: gamma in [0.5, 1.5) plus 1 rounds the same in f32 either way); grad_gamma does not
// change with the offset.
TEST_F(ClientServerTest, GammaOffsetOfTheFloatCallScalesLikeTheOffsetAddedToGamma) {
  const Batch b(5, 24, /*seed=*/6);
  auto client = Connect();
  BackwardOptions offset;
  offset.gamma_offset = 1.0f;
  absl::StatusOr<Gradients> with_offset = client->Backward(b.x, b.dy, b.gamma, 1e-5f, offset);
  std::vector<float> shifted = b.gamma;
  for (float& g : shifted) g += 1.0f;
  absl::StatusOr<Gradients> added = client->Backward(b.x, b.dy, shifted, 1e-5f);
  absl::StatusOr<Gradients> plain = client->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(with_offset.ok() && added.ok() && plain.ok()) << with_offset.status();
  EXPECT_EQ(with_offset->dx, added->dx);
  EXPECT_NE(with_offset->dx, plain->dx);
  EXPECT_EQ(with_offset->dgamma, added->dgamma);
  offset.gamma_offset = std::nanf("");
  EXPECT_EQ(client->Backward(b.x, b.dy, b.gamma, 1e-5f, offset).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientServerTest, BatchLargerThanTheMessageLimitIsChunked) {
  // 2304 x 1024 f32: x alone is 9 MiB, over twice gRPC's 4 MiB default receive limit.
  const Batch b(2304, 1024, /*seed=*/2);
  ASSERT_GT(b.x.size() * sizeof(float), size_t{8} << 20);
  absl::StatusOr<Gradients> g = Connect()->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->summary.chunks, 9u);  // 1 MiB of x per message: 256 rows
  ExpectGradientsClose(g->dx, g->dgamma, b);
}

TEST_F(ClientServerTest, ChunkBoundariesDoNotChangeTheResult) {
  const Batch b(10, 16, /*seed=*/3);  // 64-byte rows
  const struct {
    uint64_t chunk_bytes;
    uint64_t chunks;
  } cases[] = {{1, 10},     {64, 10},     {3 * 64, 4}, {5 * 64, 2},
               {9 * 64, 2}, {10 * 64, 1}, {1 << 20, 1}};
  for (const auto& c : cases) {
    ClientOptions options;
    options.chunk_bytes = c.chunk_bytes;
    absl::StatusOr<Gradients> g = Connect(options)->Backward(b.x, b.dy, b.gamma, 1e-5f);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->summary.chunks, c.chunks) << c.chunk_bytes;
    ExpectGradientsClose(g->dx, g->dgamma, b);
  }
}

// A batch whose x fits one chunk is one RmsNormBackwardUnary call; more rows, or the option
// off, are the stream. The server's metrics count each method apart, and the results agree bit
// for bit (the CPU backend's sums do not depend on how the rows arrived).
TEST_F(ClientServerTest, ABatchThatFitsOneMessageIsOneUnaryCall) {
  auto served = [this](const std::string& method) {
    const std::string text = server_->metrics().RenderText();
    const std::string key =
        "normgrad_requests_total{code=\"OK\",method=\"" + method + "\"} ";
    const size_t at = text.find(key);
    return at == std::string::npos ? 0.0 : std::stod(text.substr(at + key.size()));
  };
  const Batch b(5, 64, /*seed=*/9);
  ClientOptions unary, stream;
  unary.chunk_bytes = stream.chunk_bytes = 5 * 64 * 4;
  stream.unary_small_batches = false;
  absl::StatusOr<Gradients> one = Connect(unary)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(served("RmsNormBackwardUnary"), 1);
  EXPECT_EQ(served("RmsNormBackward"), 0);
  absl::StatusOr<Gradients> streamed = Connect(stream)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  unary.chunk_bytes = 4 * 64 * 4;  // 5 rows no longer fit one message
  absl::StatusOr<Gradients> chunked = Connect(unary)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  // Counted once the server sent the status, which may come a moment after the answer.
  for (int i = 0; i < 200 && served("RmsNormBackward") < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(served("RmsNormBackward"), 2);
  EXPECT_EQ(served("RmsNormBackwardUnary"), 1);
  EXPECT_EQ(one->summary.chunks, 1u);
  EXPECT_EQ(chunked->summary.chunks, 2u);
  ExpectGradientsClose(one->dx, one->dgamma, b);
  EXPECT_EQ(one->dx, streamed->dx);
  EXPECT_EQ(one->dgamma, streamed->dgamma);
}

TEST_F(ClientServerTest, CallerProvidedBuffersAreFilledAndResultVectorsStayEmpty) {
  const Batch b(33, 64, /*seed=*/4);
  std::vector<float> dx(b.x.size(), -1.0f), dgamma(b.hidden, -1.0f);
  BackwardOptions call;
  call.dx = absl::MakeSpan(dx);
  call.dgamma = absl::MakeSpan(dgamma);
  ClientOptions options;
  options.chunk_bytes = 7 * 64 * 4;
  absl::StatusOr<Gradients> g = Connect(options)->Backward(b.x, b.dy, b.gamma, 1e-5f, call);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->dx.empty());
  EXPECT_TRUE(g->dgamma.empty());
  ExpectGradientsClose(dx, dgamma, b);
}

TEST_F(ClientServerTest, WrongSizedCallerBuffersAreRejectedBeforeAnyCall) {
  const Batch b(4, 8, /*seed=*/5);
  std::vector<float> dx(b.x.size() - 1);
  BackwardOptions call;
  call.dx = absl::MakeSpan(dx);
  absl::StatusOr<Gradients> g = Connect()->Backward(b.x, b.dy, b.gamma, 1e-5f, call);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("dx: 124 bytes, expected 128"), absl::string_view::npos)
      << g.status();
}

TEST_F(ClientServerTest, ForwardRmsIsUsedWhenGiven) {
  const Batch b(12, 32, /*seed=*/6, 1e-5f, /*with_rms=*/true);
  BackwardOptions call;
  call.rms = b.rms;
  ClientOptions options;
  options.chunk_bytes = 5 * 32 * 4;
  absl::StatusOr<Gradients> g = Connect(options)->Backward(b.x, b.dy, b.gamma, 1e-5f, call);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, b);
}

TEST_F(ClientServerTest, ServerErrorsComeBackWithCodeAndMessageUntouched) {
  const Batch b(2, 8, /*seed=*/7);
  absl::StatusOr<Gradients> g = Connect()->Backward(b.x, b.dy, b.gamma, /*eps=*/0.0f);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("header.eps is 0"), absl::string_view::npos) << g.status();

  v1::EmitPtxRequest request;
  request.set_kernel("no_such_kernel");
  absl::StatusOr<v1::EmitPtxResponse> ptx = Connect()->EmitPtx(request);
  ASSERT_FALSE(ptx.ok());
  EXPECT_EQ(ptx.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ptx.status().message().find("no_such_kernel"), absl::string_view::npos) << ptx.status();
}

TEST_F(ClientServerTest, DeadlineExceededIsReported) {
  const Batch b(2304, 1024, /*seed=*/8);  // 9 MiB cannot cross in a microsecond
  BackwardOptions call;
  call.deadline = absl::Microseconds(1);
  absl::StatusOr<Gradients> g = Connect()->Backward(b.x, b.dy, b.gamma, 1e-5f, call);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded) << g.status();
}

TEST_F(ClientServerTest, TargetListWithADeadServerFirstStillServesEveryCall) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", DeadPort(), ",", Address(*server_));
  std::unique_ptr<Client> client = Connect(options);
  const Batch b(4, 16, /*seed=*/9);
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<Gradients> g = client->Backward(b.x, b.dy, b.gamma, 1e-5f);
    ASSERT_TRUE(g.ok()) << "call " << i << ": " << g.status();
    ExpectClose(g->dx, b.dx, "dx");
  }
  absl::StatusOr<HealthStatus> health = client->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);
}

TEST_F(ClientServerTest, BackwardRetriesWholeCallWhileNoServerAnswersThenReportsUnavailable) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", DeadPort());
  options.max_attempts = 3;
  options.initial_backoff = absl::Milliseconds(1);
  const Batch b(2, 8, /*seed=*/10);
  absl::StatusOr<Gradients> g = Connect(options)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable) << g.status();
}

TEST_F(ClientServerTest, ThirtyTwoConcurrentFuturesAllMatchTheirReferences) {
  std::unique_ptr<Client> client = Connect();
  std::vector<std::unique_ptr<Batch>> batches;
  std::vector<std::future<absl::StatusOr<Gradients>>> futures;
  for (int i = 0; i < 32; ++i) batches.push_back(std::make_unique<Batch>(5 + i, 64, 100 + i));
  for (const auto& b : batches)
    futures.push_back(client->BackwardFuture(b->x, b->dy, b->gamma, 1e-5f));
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<Gradients> g = futures[i].get();
    ASSERT_TRUE(g.ok()) << "request " << i << ": " << g.status();
    ExpectGradientsClose(g->dx, g->dgamma, *batches[i]);
  }
}

TEST_F(ClientServerTest, CallbackFormRunsEachCallbackOnce) {
  std::unique_ptr<Client> client = Connect();
  const Batch b(6, 32, /*seed=*/11);
  constexpr int kCalls = 8;
  std::atomic<int> pending{kCalls};
  std::promise<void> all_done;
  std::future<void> finished = all_done.get_future();
  std::atomic<int> ok{0};
  for (int i = 0; i < kCalls; ++i) {
    client->BackwardAsync(b.x, b.dy, b.gamma, 1e-5f, {}, [&](absl::StatusOr<Gradients> g) {
      if (g.ok() && g->dx.size() == b.x.size()) ok.fetch_add(1);
      if (pending.fetch_sub(1) == 1) all_done.set_value();
    });
  }
  finished.wait();
  EXPECT_EQ(ok.load(), kCalls);
}

TEST_F(ClientServerTest, ProgressReachesEveryRow) {
  const Batch b(40, 16, /*seed=*/12);
  ClientOptions options;
  options.chunk_bytes = 7 * 16 * 4;
  std::vector<uint64_t> seen;
  BackwardOptions call;
  call.on_progress = [&seen](uint64_t done, uint64_t total) { seen.push_back(done); };
  ASSERT_TRUE(Connect(options)->Backward(b.x, b.dy, b.gamma, 1e-5f, call).ok());
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), 40u);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
}

TEST_F(ClientServerTest, EmitPtxServerInfoAndHealth) {
  std::unique_ptr<Client> client = Connect();
  v1::EmitPtxRequest request;
  request.set_kernel("batched_rms_norm_backward");
  request.set_hidden_dim(896);
  request.set_target("sm_90");
  absl::StatusOr<v1::EmitPtxResponse> ptx = client->EmitPtx(request);
  ASSERT_TRUE(ptx.ok()) << ptx.status();
  EXPECT_EQ(ptx->entry(), "batched_rms_norm_backward");
  EXPECT_NE(ptx->ptx().find(".entry batched_rms_norm_backward"), std::string::npos);
  EXPECT_EQ(ptx->digest().size_bytes(), ptx->ptx().size());
  EXPECT_EQ(ptx->digest().sha256().size(), 64u);

  absl::StatusOr<v1::GetServerInfoResponse> info = client->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");

  absl::StatusOr<HealthStatus> overall = client->Health();
  ASSERT_TRUE(overall.ok()) << overall.status();
  EXPECT_EQ(*overall, HealthStatus::kServing);
  absl::StatusOr<HealthStatus> service = client->Health("normgrad.v1.NormGrad");
  ASSERT_TRUE(service.ok()) << service.status();
  EXPECT_EQ(*service, HealthStatus::kServing);
  absl::StatusOr<HealthStatus> unknown = client->Health("no.such.Service");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientServerTest, BearerTokenIsSentWithoutBreakingCalls) {
  ClientOptions options;
  options.bearer_token = "secret-token";
  absl::StatusOr<v1::GetServerInfoResponse> info = Connect(options)->ServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
}

}  // namespace
}  // namespace normgrad
