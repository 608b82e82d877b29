// RmsNormBackwardUnary, in-process over gRPC through the generated stub (protobuf's own encoding,
// as any client written against normgrad.proto sends it): the batch in one message each way,
// with the stream's results, checks and limits.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/process/normgrad_server.h"
#include "tests/server/service/in_process_server_test.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;
using testing::Batch;

double Tolerance() { return testing::TestBackendIsCuda() ? 1e-3 : 1e-5; }

// The whole batch as one request.
v1::BackwardRequest OneMessage(const Batch& b) {
  v1::BackwardRequest r = testing::HeaderFor(b);
  const v1::BackwardRequest rows = testing::ChunkFor(b, 0, b.rows);
  r.set_x(rows.x());
  r.set_dy(rows.dy());
  r.set_rms(rows.rms());
  return r;
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

class UnaryBackwardTest : public testing::SharedServerTest<UnaryBackwardTest> {
 public:
  static ServerOptions Options() {
    ServerOptions options = testing::TestServerOptions();
    options.admission.max_streams = 4;
    return options;
  }

 protected:
  grpc::Status Call(const v1::BackwardRequest& request, v1::BackwardResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub_->RmsNormBackwardUnary(&context, request, response);
  }
};

// Small batches compute on gRPC's thread, large ones on the pool; both give the stream's bits.
TEST_F(UnaryBackwardTest, OneMessageGivesTheStreamsResultsBitForBit) {
  struct Case {
    uint64_t rows;
    uint32_t hidden;
    bool with_rms;
  };
  for (const Case& c : {Case{1, 896, false}, Case{7, 96, true}, Case{3, 5, false},
                        Case{testing::ShapeScale(120, 6), 4096, false}}) {
    SCOPED_TRACE(absl::StrCat(c.rows, " x ", c.hidden, c.with_rms ? " with rms" : ""));
    const Batch b = testing::RandomBatch(c.rows, c.hidden, 31, c.with_rms);
    v1::BackwardResponse r;
    const grpc::Status s = Call(OneMessage(b), &r);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    EXPECT_EQ(r.first_row(), 0u);
    EXPECT_EQ(r.num_rows(), b.rows);
    EXPECT_EQ(r.summary().rows(), b.rows);
    EXPECT_EQ(r.summary().chunks(), 1u);
    EXPECT_EQ(r.summary().backend(), testing::TestBackendName());
    std::vector<float> dx, dgamma;
    testing::ReferenceFor(b, dx, dgamma);
    EXPECT_LE(testing::MaxDxError(b, Floats(r.grad_input()), dx), Tolerance());
    EXPECT_LE(testing::MaxScaledError(Floats(r.grad_gamma()), dgamma), Tolerance());

    const testing::BackwardResult stream = testing::RunBackward(*stub_, b, b.rows);
    ASSERT_TRUE(stream.status.ok()) << stream.status.error_message();
    if (testing::TestBackendIsCuda()) continue;  // the batched kernel sums with atomics
    EXPECT_EQ(Floats(r.grad_input()), stream.dx);
    EXPECT_EQ(Floats(r.grad_gamma()), stream.dgamma);
  }
}

TEST_F(UnaryBackwardTest, BadRequestsAreInvalidArgumentNamingTheFieldAndTheNumbers) {
  const Batch b = testing::RandomBatch(6, 8, 5);
  struct Bad {
    std::string name;
    v1::BackwardRequest request;
    std::string message;
  };
  std::vector<Bad> cases;
  v1::BackwardRequest r = OneMessage(b);
  r.clear_header();
  cases.push_back({"no header", r, "must carry `header`"});
  r = OneMessage(b);
  r.set_x(r.x().substr(0, 4 * 8 * 4));
  r.set_dy(r.dy().substr(0, 4 * 8 * 4));
  cases.push_back({"rows missing", r, "carries 4 of header.num_rows = 6 rows"});
  r = OneMessage(b);
  r.set_dy(r.dy().substr(0, 5 * 8 * 4));
  cases.push_back({"dy short", r, "x has 192 bytes but dy has 160"});
  r = OneMessage(b);
  r.clear_x();
  r.clear_dy();
  cases.push_back({"no rows", r, "x and dy are empty"});
  r = OneMessage(b);
  r.mutable_shm()->set_num_rows(6);
  cases.push_back({"shm", r, "shm is for the RmsNormBackward stream"});
  r = OneMessage(b);
  r.mutable_header()->set_hidden_dim(0);
  cases.push_back({"hidden_dim 0", r, "header.hidden_dim is 0"});
  for (const Bad& c : cases) {
    v1::BackwardResponse response;
    const grpc::Status s = Call(c.request, &response);
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
  }
  // The server keeps serving.
  v1::BackwardResponse response;
  EXPECT_TRUE(Call(OneMessage(b), &response).ok());
}

TEST_F(UnaryBackwardTest, AMessageThatDoesNotParseIsInvalidArgument) {
  grpc::GenericStub generic(testing::ChannelFor(server_->port()));
  grpc::ClientContext context;
  const std::string junk = "\x0b\x0c";  // a group: not a BackwardRequest
  grpc::Slice slice(junk);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&context, "/normgrad.v1.NormGrad/RmsNormBackwardUnary", grpc::StubOptions(),
                    &request, &response, [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      status = std::move(s);
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("does not parse as a normgrad.v1.BackwardRequest"));
}

// Each call takes one of --max-streams' slots while it runs and gives it back: more calls than
// slots, one after the other, all succeed, and the metrics count them under their own method.
TEST_F(UnaryBackwardTest, CallsGiveTheirSlotBackAndAreCountedUnderTheirMethod) {
  const Batch b = testing::RandomBatch(2, 64, 9);
  const std::string metric =
      "normgrad_requests_total{code=\"OK\",method=\"RmsNormBackwardUnary\"}";
  std::string error;
  const double before = testing::ParsePrometheusText(server_->metrics().RenderText(), &error)[metric];
  for (int i = 0; i < 10; ++i) {
    v1::BackwardResponse response;
    ASSERT_TRUE(Call(OneMessage(b), &response).ok()) << "call " << i;
  }
  const double after = testing::ParsePrometheusText(server_->metrics().RenderText(), &error)[metric];
  EXPECT_EQ(after - before, 10) << error;
  const std::map<std::string, double> m =
      testing::ParsePrometheusText(server_->metrics().RenderText(), &error);
  EXPECT_EQ(m.at("normgrad_inflight_streams"), 0) << "a slot was kept";
  EXPECT_EQ(server_->live_streams(), 0u);
}

}  // namespace
}  // namespace normgrad::server
