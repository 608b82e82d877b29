// For the gtest suites that run the real server in-process with options of their own: starting
// it (a test failure saying why when it does not start), a fixture holding a server and a stub
// to it, one per test (InProcessServerTest), and one whose tests share a server started once
// per suite (SharedServerTest).
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

// A suite whose tests share one server, started once with Suite::Options() before its first
// test and stopped after its last; each test gets a stub of its own.
//
//   class UnaryBackwardTest : public testing::SharedServerTest<UnaryBackwardTest> {
//    public:
//     static ServerOptions Options() { ... }
//   };
template <typename Suite>
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartServer(Suite::Options()).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = StubFor(server_->port());
  }

  static inline NormGradServer* server_ = nullptr;
  std::unique_ptr<v1::NormGrad::Stub> stub_;
};

}  // namespace normgrad::server::testing
