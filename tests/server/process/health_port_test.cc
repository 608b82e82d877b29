// HealthPort alone: on port 0 it answers grpc.health.v1.Health/Check with what SetHealth last
// said, every other method UNIMPLEMENTED, and a port that is taken is UNAVAILABLE naming the flag.
#include "server/process/health_port.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

// Calls `method` with `request` (serialized bytes) and returns the status and the reply's bytes.
grpc::Status Call(int port, const std::string& method, const std::string& request,
                  std::string* reply) {
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(request);
  grpc::ByteBuffer in(&slice, 1), out;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &in, &out,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status status = done.get_future().get();
  std::vector<grpc::Slice> slices;
  reply->clear();
  if (status.ok() && out.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return status;
}

// HealthCheckResponse.status: field 1, SERVING = 1, NOT_SERVING = 2.
const std::string kServing("\x08\x01", 2);
const std::string kNotServing("\x08\x02", 2);

TEST(HealthPortTest, AnswersWhatSetHealthSaidAndNothingElse) {
  ServerOptions options;
  options.health_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<HealthPort>> port = HealthPort::Start(options);
  ASSERT_TRUE(port.ok()) << port.status();
  ASSERT_GT((*port)->port(), 0);
  EXPECT_EQ((*port)->host(), "127.0.0.1");
  const std::string check = "/grpc.health.v1.Health/Check";
  std::string reply;
  SetHealth((*port)->server(), true);
  ASSERT_TRUE(Call((*port)->port(), check, "", &reply).ok());
  EXPECT_EQ(reply, kServing);
  SetHealth((*port)->server(), false);
  ASSERT_TRUE(Call((*port)->port(), check, "", &reply).ok());
  EXPECT_EQ(reply, kNotServing);
  grpc::Status other = Call((*port)->port(), "/normgrad.v1.NormGrad/GetServerInfo", "", &reply);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(other.error_message(), HasSubstr("serves grpc.health.v1.Health only"));
  (*port)->Shutdown();
  (*port)->Shutdown();  // idempotent
}

TEST(HealthPortTest, ATakenPortIsUnavailableNamingTheFlag) {
  ServerOptions options;
  options.health_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<HealthPort>> first = HealthPort::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  options.health_listen = absl::StrCat("127.0.0.1:", (*first)->port());
  absl::StatusOr<std::unique_ptr<HealthPort>> second = HealthPort::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(),
              HasSubstr(absl::StrCat("--health-listen=", options.health_listen,
                                     ": cannot listen there")));
}

}  // namespace
}  // namespace normgrad::server
