// The real server in-process on 127.0.0.1:0, driven over loopback through the generated stub:
// gradients against the reference, every bad input, cancellation, deadlines, idle streams,
// admission limits, concurrency without cross-talk, drain on shutdown, EmitPtx (digest, cubin,
// single-flight) and the metrics endpoint.
#include <dlfcn.h>
#include <fcntl.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/process/normgrad_server.h"
#include "server/shared_memory/region_registry.h"
#include "tests/server/service/in_process_server_test.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;
using testing::Batch;
using testing::BackwardResult;

double Tolerance() { return testing::TestBackendIsCuda() ? 1e-3 : 1e-5; }

// A client that sends the header and 10 rows of `batch`, then nothing more (without
// half-closing), and reads until the stream ends; its deadline is `deadline` from now.
struct StalledStream {
  int responses = 0;
  grpc::Status status;
};
StalledStream SendTenRowsThenStall(v1::NormGrad::Stub& stub, const Batch& batch,
                                   absl::Duration deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  auto stream = stub.RmsNormBackward(&context);
  StalledStream out;
  if (testing::WriteHeaderAndRows(*stream, batch, 10)) {
    v1::BackwardResponse response;
    while (stream->Read(&response)) ++out.responses;
  } else {
    ADD_FAILURE() << "the header or the first rows could not be written";
  }
  out.status = stream->Finish();
  return out;
}

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options = testing::TestServerOptions();
    options.preload = {"batched_rms_norm_backward:sm_80:896"};
    server_ = testing::StartServer(options).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = testing::StubFor(server_->port());
  }

  static NormGradServer* server_;
  std::unique_ptr<v1::NormGrad::Stub> stub_;
};
NormGradServer* ServiceTest::server_ = nullptr;

// ---------------------------------------------------------------------------------------------
// Gradients

struct Shape {
  uint32_t hidden;
  uint64_t rows;
  uint64_t chunk_rows;  // chosen not to divide rows
};

void ExpectMatchesReference(v1::NormGrad::Stub& stub, const Batch& batch, uint64_t chunk_rows) {
  BackwardResult r = testing::RunBackward(stub, batch, chunk_rows);
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  ASSERT_TRUE(r.saw_final);
  std::vector<float> dx, dgamma;
  testing::ReferenceFor(batch, dx, dgamma);
  EXPECT_LE(testing::MaxDxError(batch, r.dx, dx), Tolerance());
  EXPECT_LE(testing::MaxScaledError(r.dgamma, dgamma), Tolerance());
  // Responses come in order, one per chunk, covering every row once.
  const uint64_t expected_chunks = (batch.rows + chunk_rows - 1) / chunk_rows;
  ASSERT_EQ(r.chunks.size(), expected_chunks);
  for (uint64_t i = 0; i < expected_chunks; ++i) {
    EXPECT_EQ(r.chunks[i].first, i * chunk_rows);
    EXPECT_EQ(r.chunks[i].second, std::min(chunk_rows, batch.rows - i * chunk_rows));
  }
  EXPECT_EQ(r.summary.rows(), batch.rows);
  EXPECT_EQ(r.summary.chunks(), expected_chunks);
  EXPECT_EQ(r.summary.backend(), testing::TestBackendName());
  EXPECT_FALSE(r.summary.kernel().empty());
  EXPECT_GE(r.summary.total_seconds(), r.summary.compute_seconds() * 0.0);
}

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

// ---------------------------------------------------------------------------------------------
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

struct BadInput {
  std::string name;
  std::vector<v1::BackwardRequest> messages;
  grpc::StatusCode code;
  std::string message;  // substring
};

std::vector<BadInput> BadInputs() {
  const Batch b = testing::RandomBatch(10, 8, 11);
  const v1::BackwardRequest header = testing::HeaderFor(b);
  const v1::BackwardRequest chunk4 = testing::ChunkFor(b, 0, 4);
  std::vector<BadInput> cases;
  auto with_header = [&](auto edit) {
    v1::BackwardRequest h = header;
    edit(*h.mutable_header());
    return h;
  };
  auto with_chunk = [&](auto edit) {
    v1::BackwardRequest c = chunk4;
    edit(c);
    return c;
  };
  cases.push_back({"no header", {chunk4}, grpc::INVALID_ARGUMENT,
                   "the first message must carry `header`"});
  cases.push_back({"repeated header", {header, chunk4, header}, grpc::INVALID_ARGUMENT,
                   "chunk 1: header repeated"});
  cases.push_back({"num_rows 0", {with_header([](auto& h) { h.set_num_rows(0); })},
                   grpc::INVALID_ARGUMENT, "header.num_rows is 0"});
  cases.push_back({"num_rows absurd",
                   {with_header([](auto& h) { h.set_num_rows(uint64_t{1} << 60); })},
                   grpc::RESOURCE_EXHAUSTED, "header.num_rows is 1152921504606846976, above"});
  cases.push_back({"hidden_dim 0", {with_header([](auto& h) { h.set_hidden_dim(0); })},
                   grpc::INVALID_ARGUMENT, "header.hidden_dim is 0"});
  cases.push_back({"hidden_dim absurd",
                   {with_header([](auto& h) { h.set_hidden_dim(1u << 30); })},
                   grpc::RESOURCE_EXHAUSTED, "header.hidden_dim is 1073741824, above"});
  cases.push_back({"eps 0", {with_header([](auto& h) { h.set_eps(0); })},
                   grpc::INVALID_ARGUMENT, "header.eps is 0"});
  cases.push_back({"eps negative", {with_header([](auto& h) { h.set_eps(-1); })},
                   grpc::INVALID_ARGUMENT, "header.eps is -1"});
  cases.push_back({"eps nan", {with_header([](auto& h) { h.set_eps(std::nanf("")); })},
                   grpc::INVALID_ARGUMENT, "header.eps is nan"});
  cases.push_back({"eps inf", {with_header([](auto& h) { h.set_eps(INFINITY); })},
                   grpc::INVALID_ARGUMENT, "header.eps is inf"});
  cases.push_back({"gamma length", {with_header([](auto& h) { h.set_gamma(std::string(12, 'g')); })},
                   grpc::INVALID_ARGUMENT, "header.gamma has 12 bytes, not hidden_dim*4 = 32"});
  cases.push_back({"unknown dtype",
                   {with_header([](auto& h) { h.set_dtype(static_cast<v1::DType>(9)); })},
                   grpc::INVALID_ARGUMENT, "header.dtype is 9"});
  cases.push_back({"unknown kernel",
                   {with_header([](auto& h) { h.mutable_options()->set_kernel("fast_one"); })},
                   grpc::INVALID_ARGUMENT, "header.options.kernel \"fast_one\" is unknown"});
  {
    const Batch wide = testing::RandomBatch(2, 33, 12, /*with_rms=*/true);
    v1::BackwardRequest h = testing::HeaderFor(wide);
    h.mutable_header()->mutable_options()->set_kernel("rms_norm_backward");
    cases.push_back({"warp kernel hidden_dim 33", {h}, grpc::INVALID_ARGUMENT, "33"});
  }
  cases.push_back({"x and dy differ",
                   {header, with_chunk([](auto& c) { c.mutable_dy()->resize(64); })},
                   grpc::INVALID_ARGUMENT, "chunk 0: x has 128 bytes but dy has 64"});
  cases.push_back({"not a multiple of 4",
                   {header, with_chunk([](auto& c) {
                      c.mutable_x()->resize(127);
                      c.mutable_dy()->resize(127);
                    })},
                   grpc::INVALID_ARGUMENT, "chunk 0: x has 127 bytes, not a multiple of 4"});
  cases.push_back({"not a multiple of hidden_dim",
                   {header, with_chunk([](auto& c) {
                      c.mutable_x()->resize(100);
                      c.mutable_dy()->resize(100);
                    })},
                   grpc::INVALID_ARGUMENT,
                   "chunk 0: x has 100 bytes, not a multiple of hidden_dim*4 = 32"});
  cases.push_back({"more rows than declared",
                   {header, chunk4, chunk4, chunk4}, grpc::INVALID_ARGUMENT,
                   "chunk 2: 4 rows after 8 would exceed header.num_rows = 10"});
  cases.push_back({"fewer rows than declared", {header, chunk4}, grpc::INVALID_ARGUMENT,
                   "the stream ended after 4 of header.num_rows = 10 rows"});
  cases.push_back({"empty stream", {}, grpc::INVALID_ARGUMENT,
                   "the stream ended before its header"});
  cases.push_back({"rms without rms_provided",
                   {header, with_chunk([](auto& c) { c.set_rms(std::string(16, 'r')); })},
                   grpc::INVALID_ARGUMENT, "chunk 0: rms has 16 bytes but header.rms_provided is false"});
  cases.push_back({"rms wrong length",
                   {with_header([](auto& h) { h.set_rms_provided(true); }),
                    with_chunk([](auto& c) { c.set_rms(std::string(12, 'r')); })},
                   grpc::INVALID_ARGUMENT, "chunk 0: rms has 12 bytes, not rows*4 = 16"});
  // The variant fields (gamma is 8 f32 values = 32 bytes).
  cases.push_back({"gamma_offset nan",
                   {with_header([](auto& h) { h.set_gamma_offset(std::nanf("")); })},
                   grpc::INVALID_ARGUMENT,
                   "header.gamma_offset is nan; must be finite"});
  cases.push_back({"gamma_offset with no_gamma",
                   {with_header([](auto& h) {
                     h.set_no_gamma(true);
                     h.clear_gamma();
                     h.set_gamma_offset(1.0f);
                   })},
                   grpc::INVALID_ARGUMENT,
                   "header.gamma_offset is 1 with header.no_gamma"});
  cases.push_back({"gamma bytes with no_gamma",
                   {with_header([](auto& h) { h.set_no_gamma(true); })},
                   grpc::INVALID_ARGUMENT,
                   "header.gamma has 32 bytes; must be empty with header.no_gamma"});
  cases.push_back(
      {"casting_mode 7",
       {with_header([](auto& h) { h.set_casting_mode(static_cast<v1::CastingMode>(7)); })},
       grpc::INVALID_ARGUMENT,
       "header.casting_mode is 7; must be one of"});
  {
    // One message above the server's receive limit (4 MiB by default).
    v1::BackwardRequest big;
    big.set_x(std::string(3 << 20, '\0'));
    big.set_dy(std::string(3 << 20, '\0'));
    cases.push_back({"message over the size limit", {header, big}, grpc::RESOURCE_EXHAUSTED,
                     "larger than max"});
  }
  return cases;
}

TEST_F(ServiceTest, EveryBadInputGetsItsCodeAndAMessageNamingFieldAndNumbers) {
  for (const BadInput& c : BadInputs()) {
    SCOPED_TRACE(c.name);
    grpc::Status s = testing::SendMessages(*stub_, c.messages);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
  }
  // ... and the server still serves everyone.
  ExpectMatchesReference(*stub_, testing::RandomBatch(20, 16, 9), 7);
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

// ---------------------------------------------------------------------------------------------
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
  EXPECT_EQ(m["normgrad_requests_total{method=\"RmsNormBackward\",code=\"DEADLINE_EXCEEDED\"}"], 1);
  ExpectMatchesReference(*stub_, testing::RandomBatch(30, 8, 30), 7);
}

// gRPC itself refuses a message above --max-message-bytes (RESOURCE_EXHAUSTED, "larger than
// max"); the server's own count of the call must say what the client saw.
TEST_F(ServiceTest, AMessageOverTheSizeLimitIsCountedAsTheClientSawIt) {
  const testing::Batch b = testing::RandomBatch(10, 8, 31);
  auto counts = [&] {
    int code = 0;
    return testing::ParsePrometheusText(
        testing::HttpGet(server_->metrics_port(), "/metrics", &code), nullptr);
  };
  const std::string exhausted =
      "normgrad_requests_total{method=\"RmsNormBackward\",code=\"RESOURCE_EXHAUSTED\"}";
  const std::string invalid =
      "normgrad_requests_total{method=\"RmsNormBackward\",code=\"INVALID_ARGUMENT\"}";
  auto before = counts();
  v1::BackwardRequest big;
  big.set_x(std::string(3 << 20, '\0'));
  big.set_dy(std::string(3 << 20, '\0'));
  grpc::Status s = testing::SendMessages(*stub_, {testing::HeaderFor(b), big});
  ASSERT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  ASSERT_TRUE(WaitFor([&] { return server_->live_streams() == 0; }, absl::Seconds(30)));
  auto after = counts();
  // gRPC tells the server only that the call was cancelled, not why: when the cancellation
  // reaches the server before the failed read, the call is counted CANCELLED (about 1 in 8
  // runs here); never as the "stream ended early" it is not.
  const std::string cancelled =
      "normgrad_requests_total{method=\"RmsNormBackward\",code=\"CANCELLED\"}";
  EXPECT_EQ(after[exhausted] - before[exhausted] + after[cancelled] - before[cancelled], 1);
  EXPECT_EQ(after[invalid] - before[invalid], 0);
  EXPECT_EQ(after["normgrad_inflight_bytes"], 0);
}

// ---------------------------------------------------------------------------------------------
// Reflection

// A streaming call made by hand through a GenericStub (bytes the generated stub would not send),
// one operation at a time on a completion queue of its own; tags are small integers. Started
// with tag 1; 10 s deadline.
class GenericStreamingCall {
 public:
  GenericStreamingCall(grpc::GenericStub& stub, const std::string& method) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    call_ = stub.PrepareCall(&context_, method, &cq_);
    call_->StartCall(reinterpret_cast<void*>(1));
  }
  ~GenericStreamingCall() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  grpc::GenericClientAsyncReaderWriter* operator->() { return call_.get(); }
  // Writes `bytes` as one message tagged `tag` and waits for it: true when it went.
  bool Write(const std::string& bytes, intptr_t tag) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    call_->Write(buffer, reinterpret_cast<void*>(tag));
    return Step(tag);
  }
  // Waits for the next operation to complete; false when none can. `ok`: whether it succeeded.
  bool Next(bool* ok) {
    void* tag;
    return cq_.Next(&tag, ok);
  }
  // Waits for the next operation: true when it is the one tagged `want` and it succeeded.
  bool Step(intptr_t want) {
    void* tag;
    bool ok;
    return cq_.Next(&tag, &ok) && reinterpret_cast<intptr_t>(tag) == want && ok;
  }

 private:
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

// gRPC parses a callback method's messages itself unless the method is raw: then a unary call
// whose request does not parse got UNIMPLEMENTED with no message, and a stream's unparsable
// message ended its reads like a half-close. The service parses them and says so.
TEST_F(ServiceTest, AMessageThatDoesNotParseIsInvalidArgumentSayingWhich) {
  grpc::GenericStub stub(testing::ChannelFor(server_->port()));
  const std::string garbage("\xff\xff\xff", 3);  // a field tag whose varint never ends
  for (const auto& [method, type] :
       {std::pair{"EmitPtx", "EmitPtxRequest"}, std::pair{"GetServerInfo", "GetServerInfoRequest"}}) {
    grpc::Slice slice(garbage);
    grpc::ByteBuffer in(&slice, 1), out;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, absl::StrCat("/normgrad.v1.NormGrad/", method), grpc::StubOptions(),
                   &in, &out, [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status s = done.get_future().get();
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << method << ": " << s.error_message();
    EXPECT_EQ(s.error_message(), absl::StrCat("the request (3 bytes) does not parse as a "
                                              "normgrad.v1.", type));
  }

  // The stream: a good header, then a chunk that does not parse.
  GenericStreamingCall call(stub, "/normgrad.v1.NormGrad/RmsNormBackward");
  ASSERT_TRUE(call.Step(1));
  const std::string header = testing::HeaderFor(testing::RandomBatch(4, 8, 1)).SerializeAsString();
  for (const std::string& message : {header, garbage}) ASSERT_TRUE(call.Write(message, 2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  bool ok;
  ASSERT_TRUE(call.Next(&ok));
  EXPECT_FALSE(ok) << "a response to an unparsable chunk";
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  ASSERT_TRUE(call.Next(&ok));
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(status.error_message(),
            "chunk 0 (3 bytes) does not parse as a normgrad.v1.BackwardRequest");
}

TEST_F(ServiceTest, ReflectionListsTheService) {
  // ServerReflectionInfo by hand: request {list_services: ""} is field 7, an empty string.
  grpc::GenericStub stub(testing::ChannelFor(server_->port()));
  GenericStreamingCall call(stub, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo");
  ASSERT_TRUE(call.Step(1));
  ASSERT_TRUE(call.Write(std::string("\x3a\x00", 2), 2));
  grpc::ByteBuffer in_buffer;
  call->Read(&in_buffer, reinterpret_cast<void*>(3));
  ASSERT_TRUE(call.Step(3));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in_buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  EXPECT_THAT(bytes, HasSubstr("normgrad.v1.NormGrad"));
  EXPECT_THAT(bytes, HasSubstr("grpc.health.v1.Health"));
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(call.Step(4));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  bool ok;
  ASSERT_TRUE(call.Next(&ok));
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// ---------------------------------------------------------------------------------------------
// Admission control

class ServiceAdmissionTest : public testing::InProcessServerTest {
 protected:
  // A 64 KiB budget of bytes in flight, rows up to 1024 wide.
  static ServerOptions SmallInflightBudget() {
    ServerOptions options = testing::TestServerOptions();
    options.batch.max_hidden_dim = 1024;
    options.admission.max_inflight_bytes = 64 << 10;
    return options;
  }
};

TEST_F(ServiceAdmissionTest, StreamsBeyondMaxStreamsGetResourceExhaustedAtOnce) {
  ServerOptions options = testing::TestServerOptions();
  options.admission.max_streams = 2;
  ASSERT_TRUE(Start(options));
  const Batch batch = testing::RandomBatch(10, 8, 25);
  grpc::ClientContext c1, c2;
  auto s1 = stub_->RmsNormBackward(&c1);
  auto s2 = stub_->RmsNormBackward(&c2);
  ASSERT_TRUE(s1->Write(testing::HeaderFor(batch)));
  ASSERT_TRUE(s2->Write(testing::HeaderFor(batch)));
  ASSERT_TRUE(WaitFor([&] { return server_->live_streams() == 2; }));
  grpc::Status third = testing::SendMessages(*stub_, {testing::HeaderFor(batch)});
  EXPECT_EQ(third.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_THAT(third.error_message(), HasSubstr("--max-streams"));
  // The admitted ones still complete correctly.
  ASSERT_TRUE(s1->Write(testing::ChunkFor(batch, 0, 10)));
  s1->WritesDone();
  v1::BackwardResponse r;
  int n = 0;
  while (s1->Read(&r)) ++n;
  EXPECT_TRUE(s1->Finish().ok());
  EXPECT_EQ(n, 2);
  c2.TryCancel();
  s2->Finish();
}

TEST_F(ServiceAdmissionTest, ChunkBeyondMaxInflightBytesGetsResourceExhausted) {
  ASSERT_TRUE(Start(SmallInflightBudget()));
  const Batch batch = testing::RandomBatch(100, 128, 26);
  grpc::Status s =
      testing::SendMessages(*stub_, {testing::HeaderFor(batch), testing::ChunkFor(batch, 0, 100)});
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--max-inflight-bytes"));
  // Smaller chunks of the same batch fit.
  ExpectMatchesReference(*stub_, batch, 20);
}

// The budget counts everything a chunk makes the server hold, fields this server does not know
// included: 10 rows (15 KiB held) fit in 64 KiB; the same rows padded with a 100 KiB unknown
// field do not, and the refusal counts the padding.
TEST_F(ServiceAdmissionTest, UnknownFieldsCountAgainstMaxInflightBytes) {
  ASSERT_TRUE(Start(SmallInflightBudget()));
  const Batch batch = testing::RandomBatch(10, 128, 27);
  ExpectMatchesReference(*stub_, batch, 10);
  v1::BackwardRequest padded = testing::ChunkFor(batch, 0, 10);
  padded.GetReflection()->MutableUnknownFields(&padded)->AddLengthDelimited(
      1000, std::string(100 << 10, 'u'));
  grpc::Status s = testing::SendMessages(*stub_, {testing::HeaderFor(batch), padded});
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--max-inflight-bytes"));
  EXPECT_THAT(s.error_message(), ::testing::ContainsRegex("needs 1[0-9]{5} bytes"));
}

// ---------------------------------------------------------------------------------------------
// Shutdown

class ServiceShutdownTest : public testing::InProcessServerTest {};

TEST_F(ServiceShutdownTest, DrainLetsInFlightStreamsFinishAndRefusesNewOnes) {
  ASSERT_TRUE(Start(testing::TestServerOptions()));
  const int port = server_->port();
  EXPECT_EQ(testing::HealthStatus(testing::ChannelFor(port), ""), 1);
  EXPECT_EQ(testing::HealthStatus(testing::ChannelFor(port), "normgrad.v1.NormGrad"), 1);
  const Batch batch = testing::RandomBatch(40, 32, 27);
  grpc::ClientContext context;
  auto stream = stub_->RmsNormBackward(&context);
  v1::BackwardResponse response;
  ASSERT_TRUE(testing::WriteHeaderAndRowsThenRead(*stream, batch, 15, response));

  std::thread shutdown([&] { server_->Shutdown(absl::Seconds(60)); });
  EXPECT_TRUE(WaitFor([&] { return testing::HealthStatus(testing::ChannelFor(port), "") != 1; }));
  EXPECT_EQ(testing::HealthStatus(testing::ChannelFor(port), "normgrad.v1.NormGrad"), 2);
  grpc::Status refused = testing::SendMessages(*stub_, {testing::HeaderFor(batch)});
  EXPECT_EQ(refused.error_code(), grpc::UNAVAILABLE) << refused.error_message();

  ASSERT_TRUE(stream->Write(testing::ChunkFor(batch, 15, 15)));
  ASSERT_TRUE(stream->Write(testing::ChunkFor(batch, 30, 10)));
  stream->WritesDone();
  int more = 0;
  std::vector<float> dgamma;
  while (stream->Read(&response)) {
    ++more;
    if (response.has_summary()) {
      dgamma.resize(response.grad_gamma().size() / 4);
      if (!dgamma.empty()) {
        std::memcpy(dgamma.data(), response.grad_gamma().data(), dgamma.size() * 4);
      }
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(more, 3);
  std::vector<float> want_dx, want_dgamma;
  testing::ReferenceFor(batch, want_dx, want_dgamma);
  EXPECT_LE(testing::MaxScaledError(dgamma, want_dgamma), Tolerance());
  shutdown.join();
}

TEST_F(ServiceShutdownTest, StreamsStillRunningAfterTheGraceAreCancelled) {
  ASSERT_TRUE(Start(testing::TestServerOptions()));
  const Batch batch = testing::RandomBatch(40, 32, 28);
  grpc::ClientContext context;
  auto stream = stub_->RmsNormBackward(&context);
  ASSERT_TRUE(stream->Write(testing::HeaderFor(batch)));
  ASSERT_TRUE(WaitFor([&] { return server_->live_streams() == 1; }));
  server_->Shutdown(absl::Milliseconds(200));  // the client never sends its rows
  EXPECT_EQ(server_->live_streams(), 0u);
  v1::BackwardResponse response;
  while (stream->Read(&response)) {
  }
  grpc::Status s = stream->Finish();
  EXPECT_FALSE(s.ok());
}

// ---------------------------------------------------------------------------------------------
// EmitPtx and GetServerInfo

v1::GetServerInfoResponse Info(v1::NormGrad::Stub& stub) {
  grpc::ClientContext context;
  v1::GetServerInfoResponse info;
  grpc::Status s = stub.GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return info;
}

grpc::Status Emit(v1::NormGrad::Stub& stub, const v1::EmitPtxRequest& request,
                  v1::EmitPtxResponse* response) {
  grpc::ClientContext context;
  return stub.EmitPtx(&context, request, response);
}

v1::EmitPtxRequest PtxRequest(uint32_t hidden, const std::string& target, bool cubin = false) {
  v1::EmitPtxRequest r;
  r.set_kernel("batched_rms_norm_backward");
  r.set_hidden_dim(hidden);
  r.set_target(target);
  r.set_cubin(cubin);
  return r;
}

TEST_F(ServiceTest, EmitPtxIsContentAddressedAndDeterministic) {
  v1::EmitPtxResponse a, b;
  ASSERT_TRUE(Emit(*stub_, PtxRequest(896, "sm_90"), &a).ok());
  ASSERT_TRUE(Emit(*stub_, PtxRequest(896, "sm_90"), &b).ok());
  EXPECT_EQ(a.digest().sha256(), base::Sha256Hex(a.ptx()));
  EXPECT_EQ(a.digest().size_bytes(), a.ptx().size());
  EXPECT_EQ(a.digest().sha256(), b.digest().sha256());
  EXPECT_EQ(a.entry(), "batched_rms_norm_backward");
  EXPECT_EQ(a.target(), "sm_90");
  EXPECT_FALSE(a.ptx_version().empty());
  EXPECT_THAT(a.ptx(), HasSubstr(".target sm_90"));
  EXPECT_FALSE(a.params().empty());
  EXPECT_FALSE(a.config_key().empty());
  EXPECT_TRUE(a.cubin().empty());
}

TEST_F(ServiceTest, EmitPtxBadRequestsAreInvalidArgument) {
  v1::EmitPtxResponse r;
  v1::EmitPtxRequest unknown = PtxRequest(896, "sm_90");
  unknown.set_kernel("nope");
  grpc::Status s = Emit(*stub_, unknown, &r);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("kernel \"nope\" is unknown"));
  EXPECT_EQ(Emit(*stub_, PtxRequest(896, "sm_ninety"), &r).error_code(), grpc::INVALID_ARGUMENT);
  v1::EmitPtxRequest warp = PtxRequest(64, "sm_90");
  warp.set_kernel("rms_norm_backward");
  EXPECT_EQ(Emit(*stub_, warp, &r).error_code(), grpc::INVALID_ARGUMENT);
}

// A client string of 100 KB in an error would pass gRPC's default 8 KiB metadata limit on the
// way back (the client then sees a transport error instead of the server's answer).
TEST_F(ServiceTest, LongClientStringsAreNotEchoedWhole) {
  const std::string long_text(100000, 'z');
  auto expect_bounded = [](const grpc::Status& s, const std::string& field) {
    SCOPED_TRACE(field);
    const std::string head = s.error_message().substr(0, 512);
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << head;
    EXPECT_THAT(head, HasSubstr(field + " \"zzzz"));
    EXPECT_THAT(head, HasSubstr("\"... (100000 bytes)"));
    EXPECT_LT(s.error_message().size(), 512u) << head;
  };
  v1::BackwardRequest header = testing::HeaderFor(testing::RandomBatch(2, 8, 1));
  header.mutable_header()->mutable_options()->set_kernel(long_text);
  expect_bounded(testing::SendMessages(*stub_, {header}), "header.options.kernel");

  v1::EmitPtxResponse r;
  v1::EmitPtxRequest kernel = PtxRequest(896, "sm_90");
  kernel.set_kernel(long_text);
  expect_bounded(Emit(*stub_, kernel, &r), "kernel");
  expect_bounded(Emit(*stub_, PtxRequest(896, long_text), &r), "target");
  v1::EmitPtxRequest version = PtxRequest(896, "sm_90");
  version.set_ptx_version(long_text);
  expect_bounded(Emit(*stub_, version, &r), "ptx_version");
}

TEST_F(ServiceTest, EmitPtxCubinIsAnElfImageWhenNvJitLinkIsPresent) {
  if (!Info(*stub_).nvjitlink_available()) GTEST_SKIP() << "no nvJitLink on this machine";
  v1::EmitPtxResponse r;
  grpc::Status s = Emit(*stub_, PtxRequest(896, "sm_90", /*cubin=*/true), &r);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_GE(r.cubin().size(), 4u);
  EXPECT_EQ(r.cubin().substr(0, 4), "\x7f" "ELF");
  EXPECT_EQ(r.cubin_digest().sha256(), base::Sha256Hex(r.cubin()));
  EXPECT_EQ(r.cubin_digest().size_bytes(), r.cubin().size());
  EXPECT_FALSE(r.ptx().empty());
}

class ServiceEmitPtxTest : public testing::InProcessServerTest {};

TEST_F(ServiceEmitPtxTest, CubinWithoutNvJitLinkIsFailedPreconditionSayingSo) {
  ServerOptions options = testing::TestServerOptions();
  options.nvjitlink_path = "/nonexistent/libnvJitLink.so.13";
  ASSERT_TRUE(Start(options));
  EXPECT_FALSE(Info(*stub_).nvjitlink_available());
  v1::EmitPtxResponse r;
  grpc::Status s = Emit(*stub_, PtxRequest(896, "sm_90", /*cubin=*/true), &r);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("nvJitLink is not available"));
  // PTX alone still works.
  EXPECT_TRUE(Emit(*stub_, PtxRequest(896, "sm_90"), &r).ok());
}

TEST_F(ServiceEmitPtxTest, ConcurrentIdenticalRequestsCompileOnce) {
  ASSERT_TRUE(Start(testing::TestServerOptions()));
  const bool cubin = Info(*stub_).nvjitlink_available();  // slower compiles overlap surely
  constexpr int kRequests = 8;
  std::promise<void> start;  // all threads send at once
  std::shared_future<void> go = start.get_future().share();
  std::vector<std::string> digests(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      auto own = testing::StubFor(server_->port());
      v1::EmitPtxResponse r;
      go.wait();
      grpc::Status s = Emit(*own, PtxRequest(4096, "sm_80", cubin), &r);
      EXPECT_TRUE(s.ok()) << s.error_message();
      digests[i] = r.digest().sha256();
    });
  }
  start.set_value();
  for (std::thread& t : threads) t.join();
  for (const std::string& d : digests) EXPECT_EQ(d, digests[0]);
  const v1::CacheStats stats = Info(*stub_).ptx_cache();
  EXPECT_EQ(stats.compiles(), cubin ? 2u : 1u);  // the PTX, and the cubin when asked
  EXPECT_EQ(stats.compile_failures(), 0u);
}

class ServiceInfoTest : public testing::InProcessServerTest {};

// A client can only keep to its shares if it can read them: the per-client stream share and the
// per-user region shares are in GetServerInfo.
TEST_F(ServiceInfoTest, ServerInfoReportsThePerClientAndPerUserShares) {
  const std::string dir = absl::StrCat("/tmp/normgrad-svc-shares-", getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  ServerOptions options = testing::TestServerOptions();
  options.admission.max_streams = 8;
  options.admission.max_streams_per_client = 3;
  options.listen.push_back("unix:" + dir + "/grpc.sock");
  options.shared_memory = true;
  options.regions.max_regions = 10;
  options.regions.max_regions_per_user = 4;
  options.regions.max_bytes = 1 << 30;
  options.regions.max_bytes_per_user = 1 << 28;
  ASSERT_TRUE(Start(options));
  const v1::GetServerInfoResponse info = Info(*stub_);
  EXPECT_EQ(info.limits().max_concurrent_streams(), 8u);
  EXPECT_EQ(info.limits().max_streams_per_client(), 3u);
  EXPECT_TRUE(info.shared_memory().enabled());
  EXPECT_EQ(info.shared_memory().max_regions_per_user(), 4u);
  EXPECT_EQ(info.shared_memory().max_region_bytes_per_user(), uint64_t{1} << 28);
  server_.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(ServiceTest, ServerInfoDescribesBackendLimitsKernelsAndCaches) {
  const v1::GetServerInfoResponse info = Info(*stub_);
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), testing::TestBackendName());
  EXPECT_FALSE(info.device().name().empty());
  EXPECT_EQ(info.limits().max_message_bytes(), 4u << 20);
  EXPECT_EQ(info.limits().max_concurrent_streams(), 64u);
  EXPECT_GT(info.limits().max_inflight_bytes(), 0u);
  EXPECT_DOUBLE_EQ(info.limits().stream_idle_timeout_seconds(), 60);
  EXPECT_THAT(std::vector<std::string>(info.kernels().begin(), info.kernels().end()),
              ::testing::IsSupersetOf({"rms_norm_backward", "batched_rms_norm_backward"}));
  EXPECT_GE(info.ptx_cache().entries(), 1u);  // --preload compiled one before SERVING
}

// ---------------------------------------------------------------------------------------------
// Metrics

TEST_F(ServiceTest, MetricsEndpointServesParseablePrometheusText) {
  ExpectMatchesReference(*stub_, testing::RandomBatch(10, 8, 31), 4);
  // The server records an RPC when gRPC calls OnDone, which may come just after the client has
  // its status: scrape until the call shows up (bounded).
  const std::string ok_key = "normgrad_requests_total{method=\"RmsNormBackward\",code=\"OK\"}";
  int code = 0;
  std::string error;
  std::map<std::string, double> m;
  WaitFor([&] {
    m = testing::ParsePrometheusText(
        testing::HttpGet(server_->metrics_port(), "/metrics", &code), &error);
    return code == 200 && m[ok_key] >= 1;
  });
  ASSERT_EQ(code, 200);
  ASSERT_FALSE(m.empty()) << error;
  EXPECT_GE(m[ok_key], 1);
  EXPECT_GE(m["normgrad_request_duration_seconds_count{method=\"RmsNormBackward\"}"], 1);
  EXPECT_GE(m["normgrad_request_duration_seconds_bucket{method=\"RmsNormBackward\",le=\"+Inf\"}"],
            1);
  EXPECT_GT(m["normgrad_received_bytes_total{method=\"RmsNormBackward\"}"], 0);
  EXPECT_GT(m["normgrad_sent_bytes_total{method=\"RmsNormBackward\"}"], 0);
  EXPECT_GE(m["normgrad_rows_total"], 10);
  EXPECT_EQ(m["normgrad_serving"], 1);
  EXPECT_GT(m["normgrad_process_resident_bytes"], 0);
  EXPECT_EQ(m.count("normgrad_process_heap_in_use_bytes"), 1u);
  EXPECT_EQ(m.count("normgrad_cache_compiles_total{cache=\"ptx\"}"), 1u);
  EXPECT_EQ(m.count("normgrad_cache_hits_total{cache=\"module\"}"), 1u);
  bool backend_info = false;
  for (const auto& [key, value] : m) {
    if (key.rfind("normgrad_backend_info{", 0) == 0) {
      backend_info = value == 1 &&
                     key.find(absl::StrCat("backend=\"", testing::TestBackendName(), "\"")) !=
                         std::string::npos;
    }
  }
  EXPECT_TRUE(backend_info);
  int missing = 0;
  testing::HttpGet(server_->metrics_port(), "/nothing", &missing);
  EXPECT_EQ(missing, 404);
}

}  // namespace
}  // namespace normgrad::server

namespace normgrad::server {
namespace {

class ServiceSharedMemoryTest : public testing::InProcessServerTest {};

// Shared-memory chunks on the backend under test (sim.cuda.service_integration_test runs this on
// the CUDA backend over the emulated driver): the region is computed in place, and on CUDA the
// backend registered the region with the driver and copied straight from and to it (the
// emulator counts async copies whose host side is registered memory).
TEST_F(ServiceSharedMemoryTest, ChunksInARegionAreComputedInPlaceStraightFromTheRegion) {
  const std::string dir = absl::StrCat("/tmp/normgrad-svc-shm-", getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  ServerOptions options = testing::TestServerOptions();
  options.listen.push_back("unix:" + dir + "/grpc.sock");
  options.shared_memory = true;
  ASSERT_TRUE(Start(options));
  const testing::Batch b = testing::RandomBatch(96, 256, 9);
  const uint64_t n = b.rows * b.hidden, bytes = n * 4;
  const int fd = memfd_create("test-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(3 * bytes)), 0);
  // The server refuses a region whose pages are not all allocated (it would be charged for them).
  ASSERT_EQ(posix_fallocate(fd, 0, static_cast<off_t>(3 * bytes)), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  auto* base = static_cast<uint8_t*>(mmap(nullptr, 3 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(base, MAP_FAILED);
  std::memcpy(base, b.x.data(), bytes);
  std::memcpy(base + bytes, b.dy.data(), bytes);
  absl::StatusOr<RegionGrant> grant = server_->regions()->Register(OwnedFd(fd), {.connection = 1});
  ASSERT_TRUE(grant.ok()) << grant.status();

  using CopyCount = uint64_t (*)();
  CopyCount registered_copies = nullptr;
  if (testing::TestBackendIsCuda()) {
    const char* driver = std::getenv("NORMGRAD_CUDA_DRIVER");
    void* lib = driver != nullptr ? dlopen(driver, RTLD_NOW | RTLD_NOLOAD) : nullptr;
    if (lib != nullptr) {
      registered_copies =
          reinterpret_cast<CopyCount>(dlsym(lib, "normgrad_emulated_registered_copies"));
    }
  }
  const uint64_t copies_before = registered_copies != nullptr ? registered_copies() : 0;

  std::vector<v1::BackwardRequest> messages = {testing::HeaderFor(b)};
  const uint64_t rows_per_chunk = 40;  // 40, 40, 16
  for (uint64_t first = 0; first < b.rows; first += rows_per_chunk) {
    const uint64_t rows = std::min(rows_per_chunk, b.rows - first);
    v1::BackwardRequest m;
    v1::SharedMemoryChunk* shm = m.mutable_shm();
    shm->set_region_id(grant->id);
    shm->set_region_key(grant->key.data(), grant->key.size());
    shm->set_num_rows(rows);
    shm->set_x_offset(first * b.hidden * 4);
    shm->set_dy_offset(bytes + first * b.hidden * 4);
    shm->set_grad_input_offset(2 * bytes + first * b.hidden * 4);
    messages.push_back(std::move(m));
  }
  int responses = 0;
  const grpc::Status status = testing::SendMessages(*stub_, messages, &responses);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(responses, 4);
  std::vector<float> want_dx, want_dgamma, dx(n);
  testing::ReferenceFor(b, want_dx, want_dgamma);
  std::memcpy(dx.data(), base + 2 * bytes, bytes);
  EXPECT_LT(testing::MaxScaledError(dx, want_dx), 1e-4);
  if (registered_copies != nullptr) {
    // x, dy in and dx out for each of the 3 chunks, none through the pinned staging buffers.
    EXPECT_EQ(registered_copies() - copies_before, 9u);
  } else {
    EXPECT_FALSE(testing::TestBackendIsCuda()) << "the emulated driver's copy counter is missing";
  }
  server_->Shutdown(absl::ZeroDuration());
  server_.reset();
  munmap(base, 3 * bytes);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace normgrad::server
