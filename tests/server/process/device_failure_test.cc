// A GPU that fails must not keep taking traffic: normgrad-server as a subprocess on the CUDA
// backend over the emulated driver, with a fault injected through NORMGRAD_EMULATED_CUDA_FAULT
// (tests/ptxsim/sim/emulated_driver.cc; counted in kernel launches, and the start-up self-test makes
// the first). A sticky device error or a hung device turns health NOT_SERVING on both gRPC
// ports, fails streams UNAVAILABLE and ends the process with exit code 3; a self-test whose
// results differ from the CPU reference keeps the server up but NOT_SERVING, saying why in
// GetServerInfo. Skipped when the build has no emulated driver (no cuda.h).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>

#include <future>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/child_process.h"
#include "tests/server/process/emulated_server.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::normgrad::testing::ChildProcess;
using ::normgrad::testing::ReadyLine;
using ::testing::HasSubstr;

constexpr int kExitDeviceFailed = 3;  // docs/operations.md, "Exit codes"
constexpr int kServing = 1;
constexpr int kNotServing = 2;

// The server with the emulated driver and `fault` (empty: none) in its environment only.
absl::StatusOr<ChildProcess> StartServer(const std::string& fault,
                                         std::vector<std::string> flags = {}) {
  flags.insert(flags.begin(), {"--health-listen=127.0.0.1:0", "--backend=cuda"});
  return ::normgrad::testing::StartOnEmulatedDriver(
      {absl::StrCat("NORMGRAD_EMULATED_CUDA_FAULT=", fault)}, std::move(flags));
}

int ExitCode(const std::optional<int>& status) {
  return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

int HealthStatus(int port) {
  return testing::HealthStatus(testing::OwnConnectionFor(port));
}

v1::GetServerInfoResponse Info(int port) {
  auto stub = testing::StubFor(port);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::GetServerInfoResponse info;
  EXPECT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  return info;
}

double DeviceHealthyGauge(int metrics_port) {
  int code = 0;
  auto m = testing::ParsePrometheusText(testing::HttpGet(metrics_port, "/metrics", &code), nullptr);
  auto it = m.find("normgrad_device_healthy");
  return it == m.end() ? -1 : it->second;
}

// One small stream, sent whole; its final status.
grpc::Status RunStream(int port) {
  auto stub = testing::StubFor(port);
  const testing::Batch batch = testing::RandomBatch(8, 64, 7);
  return testing::RunBackward(*stub, batch, 8, absl::Seconds(120)).status;
}

class DeviceFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(NORMGRAD_EMULATED_CUDA).empty()) {
      GTEST_SKIP() << "built without the emulated CUDA driver (no cuda.h)";
    }
  }
};

TEST_F(DeviceFailureTest, StickyErrorMeansNotServingUnavailableAndExitThree) {
  absl::StatusOr<ChildProcess> server = StartServer("sticky:2");
  ASSERT_TRUE(server.ok()) << server.status();
  const ReadyLine ready = server->AwaitReady(absl::Seconds(120));
  ASSERT_GT(ready.grpc_port, 0) << server->Stderr();
  ASSERT_GT(ready.health_port, 0);
  // The self-test (launch 1) passed: serving on both ports.
  EXPECT_EQ(HealthStatus(ready.grpc_port), kServing) << server->Stderr();
  EXPECT_EQ(HealthStatus(ready.health_port), kServing);
  EXPECT_TRUE(Info(ready.grpc_port).health().serving());
  EXPECT_EQ(DeviceHealthyGauge(ready.metrics_port), 1);

  // Launch 2 fails with CUDA_ERROR_ILLEGAL_ADDRESS, as on a lost device: the stream that met it
  // gets UNAVAILABLE (which clients retry elsewhere), and by then health is NOT_SERVING.
  const grpc::Status failed = RunStream(ready.grpc_port);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::UNAVAILABLE) << failed.error_message();
  EXPECT_THAT(failed.error_message(), HasSubstr("the GPU failed"));
  EXPECT_THAT(failed.error_message(), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_EQ(HealthStatus(ready.grpc_port), kNotServing);
  EXPECT_EQ(HealthStatus(ready.health_port), kNotServing);
  EXPECT_EQ(DeviceHealthyGauge(ready.metrics_port), 0);
  // A new stream is refused at once, saying why.
  const grpc::Status refused = RunStream(ready.grpc_port);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("takes no streams"));
  EXPECT_THAT(Info(ready.grpc_port).health().reason(), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));

  EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(60))), kExitDeviceFailed) << server->Stderr();
  EXPECT_THAT(server->Stderr(), HasSubstr("exiting with code 3"));
}

TEST_F(DeviceFailureTest, HungDeviceIsFoundByTheDeviceTimeoutAndExitsThree) {
  // Launch 2 returns, but the synchronize after it never does.
  absl::StatusOr<ChildProcess> server = StartServer("hang:2", {"--device-timeout=1s"});
  ASSERT_TRUE(server.ok()) << server.status();
  const ReadyLine ready = server->AwaitReady(absl::Seconds(120));
  ASSERT_GT(ready.grpc_port, 0) << server->Stderr();
  EXPECT_EQ(HealthStatus(ready.health_port), kServing) << server->Stderr();

  std::future<grpc::Status> stuck =
      std::async(std::launch::async, [&] { return RunStream(ready.grpc_port); });
  // The watchdog notices the overdue synchronize: NOT_SERVING (polled: the stream cannot tell
  // when; the process lingers for its grace, then exits).
  int health = kServing;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (health == kServing && absl::Now() < give_up) health = HealthStatus(ready.health_port);
  EXPECT_EQ(health, kNotServing) << server->Stderr();
  const int exit_code = ExitCode(server->WaitExit(absl::Seconds(60)));
  EXPECT_EQ(exit_code, kExitDeviceFailed) << server->Stderr();
  EXPECT_THAT(server->Stderr(), HasSubstr("cuStreamSynchronize has not returned"));
  if (exit_code == -1) server->Signal(SIGKILL);  // failed: end the stream too
  // The blocked worker never answered: the stream ends with the connection, UNAVAILABLE.
  const grpc::Status s = stuck.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST_F(DeviceFailureTest, SelfTestMismatchKeepsTheServerNotServingSayingWhy) {
  // From launch 1 (the self-test's) on, copies back from the device arrive with a flipped sign.
  absl::StatusOr<ChildProcess> server = StartServer("corrupt:1");
  ASSERT_TRUE(server.ok()) << server.status();
  const ReadyLine ready = server->AwaitReady(absl::Seconds(120));
  ASSERT_GT(ready.grpc_port, 0) << server->Stderr();
  EXPECT_EQ(HealthStatus(ready.grpc_port), kNotServing);
  EXPECT_EQ(HealthStatus(ready.health_port), kNotServing);
  EXPECT_EQ(DeviceHealthyGauge(ready.metrics_port), 0);
  const v1::GetServerInfoResponse info = Info(ready.grpc_port);
  EXPECT_FALSE(info.health().serving());
  EXPECT_THAT(info.health().reason(), HasSubstr("self-test"));
  EXPECT_THAT(info.health().reason(), HasSubstr("differs from the CPU reference"));
  EXPECT_THAT(server->Stderr(), HasSubstr("NOT_SERVING"));
  const grpc::Status refused = RunStream(ready.grpc_port);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("self-test"));
  // Not a lost device: the server stays up until told to stop, and drains as usual.
  server->Signal(SIGTERM);
  EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(60))), 0) << server->Stderr();
}

TEST_F(DeviceFailureTest, BadDeviceTimeoutExitsTwoNamingTheFlag) {
  for (const char* value : {"-1s", "soon"}) {
    absl::StatusOr<ChildProcess> server =
        StartServer("", {absl::StrCat("--device-timeout=", value)});
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(30))), 2) << value;
    EXPECT_THAT(server->Stderr(), HasSubstr(absl::StrCat("--device-timeout=", value)));
  }
}

}  // namespace
}  // namespace normgrad::server
