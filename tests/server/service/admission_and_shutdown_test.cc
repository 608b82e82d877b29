// Admission limits (streams, bytes in flight, unknown fields counted) and shutdown (drain lets
// streams in flight finish and refuses new ones; the grace period's end cancels the rest).
#include "tests/server/service/service_suite.h"

namespace normgrad::server::service_test {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

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

// EmitPtx and GetServerInfo

}  // namespace
}  // namespace normgrad::server::service_test
