// For the gtest suites that run the real server in-process with options of their own: starting
// it (a test failure saying why when it does not start), and a fixture holding a server and a
// stub to it, one per test.
//
//   class ServiceAdmissionTest : public testing::InProcessServerTest {};
//   TEST_F(ServiceAdmissionTest, ...) {
//     ServerOptions options = testing::TestServerOptions();
//     options.admission.max_streams = 2;
//     ASSERT_TRUE(Start(options));
//     ... server_->live_streams(), stub_->RmsNormBackward(&context) ...
//   }
#pragma once

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "server/process/normgrad_server.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server::testing {

// The server started with `options`; null, with a test failure giving the status, when it did
// not start.
inline std::unique_ptr<NormGradServer> StartServer(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<NormGradServer>> server = NormGradServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

class InProcessServerTest : public ::testing::Test {
 protected:
  // Starts server_ with `options` and stub_ to it; a failure carrying the status when the server
  // does not start (ASSERT_TRUE(Start(options))).
  ::testing::AssertionResult Start(const ServerOptions& options) {
    absl::StatusOr<std::unique_ptr<NormGradServer>> server = NormGradServer::Start(options);
    if (!server.ok()) return ::testing::AssertionFailure() << server.status();
    server_ = *std::move(server);
    stub_ = StubFor(server_->port());
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<NormGradServer> server_;
  std::unique_ptr<v1::NormGrad::Stub> stub_;
};

}  // namespace normgrad::server::testing
