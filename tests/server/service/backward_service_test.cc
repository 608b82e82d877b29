// Backward over gRPC against the real server in-process: gradients against the reference with
// chunks that do not divide the batch, the forward's rms, NaN/Inf computed through, concurrent
// streams without cross-talk, the same bits for the same input, no gamma, cancellation, client
// deadlines and idle streams.
#include "tests/server/service/service_suite.h"

namespace normgrad::server::service_test {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

class GradientTest : public ServiceTest, public ::testing::WithParamInterface<Shape> {};

TEST_P(GradientTest, MatchesReferenceWithChunksThatDoNotDivideTheBatch) {
  const Shape s = GetParam();
  ExpectMatchesReference(*stub_, testing::RandomBatch(s.rows, s.hidden, s.hidden * 7 + 1),
                         s.chunk_rows);
}

std::vector<Shape> GradientShapes() {
  using testing::ShapeScale;
  return {
      {1, 1, 1},
      {1, ShapeScale(300007, 1001), ShapeScale(65521, 333)},
      {7, ShapeScale(100003, 501), ShapeScale(10007, 97)},
      {31, ShapeScale(20011, 301), ShapeScale(4099, 64)},
      {32, ShapeScale(8191, 129), ShapeScale(1000, 50)},
      {33, ShapeScale(4097, 65), ShapeScale(999, 20)},
      {896, 1, 1},
      {896, ShapeScale(1001, 17), ShapeScale(333, 5)},
      {4096, ShapeScale(67, 5), ShapeScale(10, 2)},
      {8192, ShapeScale(33, 3), ShapeScale(5, 2)},
  };
}

INSTANTIATE_TEST_SUITE_P(Shapes, GradientTest, ::testing::ValuesIn(GradientShapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return absl::StrCat("h", info.param.hidden, "_rows", info.param.rows,
                                               "_chunk", info.param.chunk_rows);
                         });

TEST_F(ServiceTest, RmsFromTheForwardPassIsUsedAsGiven) {
  Batch batch = testing::RandomBatch(testing::ShapeScale(1001, 33), 64, 5, /*with_rms=*/true);
  // Scale rms so that a server recomputing it would be visibly wrong.
  for (float& r : batch.rms) r *= 1.5f;
  ExpectMatchesReference(*stub_, batch, 77);
}

TEST_F(ServiceTest, NanAndInfInsideTheDataAreComputedThroughNotRejected) {
  Batch batch = testing::RandomBatch(4, 8, 3);
  batch.x[1 * 8 + 2] = std::nanf("");
  batch.dy[2 * 8 + 5] = INFINITY;
  BackwardResult r = testing::RunBackward(*stub_, batch, 3);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(std::isnan(r.dx[1 * 8 + 0]));       // the NaN row is NaN
  EXPECT_FALSE(std::isnan(r.dx[0]));              // row 0 is clean
  EXPECT_FALSE(std::isnan(r.dx[3 * 8 + 7]));      // row 3 is clean
}

TEST_F(ServiceTest, SixteenConcurrentStreamsOfDifferentShapesDoNotCrossTalk) {
  constexpr int kStreams = 16;
  std::vector<Batch> batches;
  std::vector<uint64_t> chunk_rows;
  for (int i = 0; i < kStreams; ++i) {
    const uint32_t hidden = 1 + 37 * i;
    const uint64_t rows = testing::ShapeScale(50 + 97 * i, 3 + i);
    batches.push_back(testing::RandomBatch(rows, hidden, 1000 + i));
    chunk_rows.push_back(1 + (rows / 3));
  }
  std::vector<BackwardResult> results(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      auto stub = testing::StubFor(server_->port());
      results[i] = testing::RunBackward(*stub, batches[i], chunk_rows[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    std::vector<float> dx, dgamma;
    testing::ReferenceFor(batches[i], dx, dgamma);
    EXPECT_LE(testing::MaxDxError(batches[i], results[i].dx, dx), Tolerance()) << "stream " << i;
    EXPECT_LE(testing::MaxScaledError(results[i].dgamma, dgamma), Tolerance()) << "stream " << i;
  }
}

TEST_F(ServiceTest, SameInputAndChunkingGiveTheSameBits) {
  const Batch batch = testing::RandomBatch(testing::ShapeScale(2001, 40), 96, 77);
  BackwardResult a = testing::RunBackward(*stub_, batch, 250);
  BackwardResult b = testing::RunBackward(*stub_, batch, 250);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  if (testing::TestBackendIsCuda()) GTEST_SKIP() << "the CUDA batched kernel sums with atomics";
  EXPECT_EQ(0, std::memcmp(a.dgamma.data(), b.dgamma.data(), a.dgamma.size() * 4));
}

// Bad input: each is one status naming the field and the numbers; the server keeps serving.

// docs/api.md: eps is neither checked nor used when the forward's rms is given.
TEST_F(ServiceTest, RmsProvidedWithEpsUnsetIsServed) {
  Batch batch = testing::RandomBatch(9, 16, 4, /*with_rms=*/true);
  batch.eps = 0;
  ExpectMatchesReference(*stub_, batch, 4);
}

TEST_F(ServiceTest, RmsThatIsNotFiniteAndPositiveIsInvalidArgumentNamingTheRow) {
  for (float bad : {0.0f, -2.0f, std::nanf(""), INFINITY}) {
    Batch batch = testing::RandomBatch(8, 8, 6, /*with_rms=*/true);
    batch.rms[6] = bad;
    grpc::Status s =
        testing::SendMessages(*stub_, {testing::HeaderFor(batch), testing::ChunkFor(batch, 0, 4),
                                       testing::ChunkFor(batch, 4, 4)});
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << bad << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("rms of row 6 is ", bad, ";")));
  }
}

// A batch without gamma: the final response carries no grad_gamma, and dx is that of a gamma of
// ones (a scale of 1 either way: the same bits).
TEST_F(ServiceTest, NoGammaFinalResponseCarriesNoGradGamma) {
  testing::Batch b = testing::RandomBatch(10, 8, 11);
  std::fill(b.gamma.begin(), b.gamma.end(), 1.0f);
  const testing::BackwardResult ones = testing::RunBackward(*stub_, b, 4);
  ASSERT_TRUE(ones.status.ok()) << ones.status.error_message();
  ASSERT_EQ(ones.dgamma.size(), 8u);

  v1::BackwardRequest header = testing::HeaderFor(b);
  header.mutable_header()->set_no_gamma(true);
  header.mutable_header()->clear_gamma();
  grpc::ClientContext context;
  auto stream = stub_->RmsNormBackward(&context);
  ASSERT_TRUE(stream->Write(header));
  ASSERT_TRUE(stream->Write(testing::ChunkFor(b, 0, 4)));
  ASSERT_TRUE(stream->Write(testing::ChunkFor(b, 4, 6)));
  stream->WritesDone();
  std::string dx;
  v1::BackwardResponse r, last;
  while (stream->Read(&r)) {
    dx += r.grad_input();
    last = r;
  }
  const grpc::Status status = stream->Finish();
  if (testing::TestBackendIsCuda() && status.error_code() == grpc::UNIMPLEMENTED) {
    GTEST_SKIP() << "this backend refuses the variant: " << status.error_message();
  }
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(last.has_summary());
  EXPECT_TRUE(last.grad_gamma().empty()) << last.grad_gamma().size() << " bytes";
  ASSERT_EQ(dx.size(), ones.dx.size() * 4);
  EXPECT_EQ(0, std::memcmp(dx.data(), ones.dx.data(), dx.size()));
}

// Cancellation, deadlines, idle streams

TEST_F(ServiceTest, CancelledStreamEndsAndReleasesItsMemory) {
  const Batch batch = testing::RandomBatch(100, 256, 21);
  grpc::ClientContext context;
  auto stream = stub_->RmsNormBackward(&context);
  v1::BackwardResponse response;
  ASSERT_TRUE(testing::WriteHeaderAndRowsThenRead(*stream, batch, 10, response));
  EXPECT_EQ(response.num_rows(), 10u);
  context.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::CANCELLED);
  EXPECT_TRUE(WaitFor([&] { return server_->live_streams() == 0; }));
  std::string text;
  EXPECT_TRUE(WaitFor([&] {
    int code = 0;
    auto m = testing::ParsePrometheusText(
        testing::HttpGet(server_->metrics_port(), "/metrics", &code), nullptr);
    return m["normgrad_inflight_bytes"] == 0 && m["normgrad_inflight_streams"] == 0;
  }));
}

TEST_F(ServiceTest, ClientDeadlineEndsTheStreamWithDeadlineExceeded) {
  const StalledStream stalled =
      SendTenRowsThenStall(*stub_, testing::RandomBatch(100, 16, 22), absl::Milliseconds(300));
  EXPECT_EQ(stalled.status.error_code(), grpc::DEADLINE_EXCEEDED);
  EXPECT_TRUE(WaitFor([&] { return server_->live_streams() == 0; }));
}

// A server whose watchdog ends streams that made no progress for 2 s. Long enough that a healthy
// stream never waits that long on its client even under ThreadSanitizer on 2 cores (with 300 ms,
// the "others are unaffected" streams were cut in about 1 run of 7 there, between a client's
// last chunk and its half-close), short against the stalled tests' 30 s client deadlines.
class ServiceIdleTest : public testing::InProcessServerTest {
 protected:
  void SetUp() override {
    ServerOptions options = testing::TestServerOptions();
    options.stream_idle_timeout = absl::Seconds(2);
    ASSERT_TRUE(Start(options));
  }
};

TEST_F(ServiceIdleTest, StreamThatStopsSendingEndsByTheIdleTimeoutWithAClearStatus) {
  const StalledStream stalled =
      SendTenRowsThenStall(*stub_, testing::RandomBatch(100, 16, 23), absl::Seconds(30));
  const grpc::Status& s = stalled.status;
  EXPECT_EQ(stalled.responses, 1);
  EXPECT_EQ(s.error_code(), grpc::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("stream idle timeout"));
  EXPECT_THAT(s.error_message(), HasSubstr("after 10 rows"));
  EXPECT_TRUE(WaitFor([&] { return server_->live_streams() == 0; }));
  // Others are unaffected.
  ExpectMatchesReference(*stub_, testing::RandomBatch(30, 8, 24), 7);
}

TEST_F(ServiceIdleTest, StreamWhoseClientStopsReadingIsCancelledByTheIdleTimeout) {
  if (testing::TestBackendIsCuda()) {
    GTEST_SKIP() << "needs 64 MiB of dx to fill the windows; too slow on an emulated driver, "
                    "and the watchdog does not depend on the backend";
  }
  // 64 MiB of dx to send back: far more than HTTP/2 windows hold while nobody reads.
  const Batch batch = testing::RandomBatch(4096, 4096, 29);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto stream = stub_->RmsNormBackward(&context);
  std::thread writer([&] {
    if (!stream->Write(testing::HeaderFor(batch))) return;
    for (uint64_t first = 0; first < batch.rows; first += 64) {
      if (!stream->Write(testing::ChunkFor(batch, first, std::min<uint64_t>(64, batch.rows - first)))) {
        return;
      }
    }
    stream->WritesDone();
  });
  // Never read. The server must give up on its own, long before the 60 s client deadline: it
  // cancels the call (its trailers could not get through the full window anyway), frees the
  // stream and counts it as DEADLINE_EXCEEDED. (gRPC 1.51's sync client does not always wake a
  // Write blocked on flow control when the server resets the stream, so the test cancels its
  // side once the server is done.)
  ASSERT_TRUE(WaitFor([&] { return server_->live_streams() == 1; }, absl::Seconds(30)));
  const bool server_ended = WaitFor([&] { return server_->live_streams() == 0; }, absl::Seconds(30));
  context.TryCancel();
  writer.join();
  stream->Finish();
  ASSERT_TRUE(server_ended);
  int code = 0;
  auto m = testing::ParsePrometheusText(
      testing::HttpGet(server_->metrics_port(), "/metrics", &code), nullptr);
  EXPECT_EQ(m["normgrad_inflight_bytes"], 0);
  EXPECT_EQ(m["normgrad_requests_total{code=\"DEADLINE_EXCEEDED\",method=\"RmsNormBackward\"}"], 1);
  ExpectMatchesReference(*stub_, testing::RandomBatch(30, 8, 30), 7);
}

}  // namespace
}  // namespace normgrad::server::service_test
