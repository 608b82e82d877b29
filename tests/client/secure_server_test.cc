// The client library, the CLI and the load generator against normgrad-server with TLS, mutual
// TLS and a bearer token (run-time certificates from openssl): the right credentials work end to
// end, and the server's UNAUTHENTICATED comes back with its message untouched.
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "client/tools/cli.h"
#include "client/tools/load_flags.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "tests/client/test_certificates.h"
#include "tests/client/test_server.h"

namespace normgrad {
namespace {

using ::normgrad::testing::Batch;
using ::normgrad::testing::ExpectGradientsClose;
using ::normgrad::testing::TestCertificates;

class SecureServerTest : public testing::TestServerFixture {
 protected:
  static void SetUpTestSuite() { certificates_ = new TestCertificates(::testing::TempDir()); }
  static void TearDownTestSuite() { delete certificates_; }

  void SetUp() override {
    if (!certificates_->ok()) GTEST_SKIP() << "openssl could not make test certificates";
    std::ofstream(certificates_->Path("token")) << "t0ken-for-tests\n";
    TestServerFixture::SetUp();
  }
  void AdjustServer(server::ServerOptions& o) override {
    o.security.cert_file = certificates_->Path("server.pem");
    o.security.key_file = certificates_->Path("server.key");
    o.security.client_ca_file = certificates_->Path("ca.pem");
    o.security.token_file = certificates_->Path("token");
  }

  ClientOptions Secure() const {
    ClientOptions options;
    options.target = testing::Address(*server_);
    options.use_tls = true;
    options.tls.root_certs_pem = certificates_->Pem("ca.pem");
    options.tls.client_cert_pem = certificates_->Pem("client.pem");
    options.tls.client_key_pem = certificates_->Pem("client.key");
    options.tls.server_name_override = "normgrad.test";
    options.bearer_token = "t0ken-for-tests";
    options.max_attempts = 1;
    return options;
  }
  std::vector<std::string> SecureFlags() const {
    return {"--target=" + testing::Address(*server_),
            "--tls-ca=" + certificates_->Path("ca.pem"),
            "--tls-cert=" + certificates_->Path("client.pem"),
            "--tls-key=" + certificates_->Path("client.key"),
            "--tls-server-name=normgrad.test",
            "--token=t0ken-for-tests"};
  }

  static TestCertificates* certificates_;
};
TestCertificates* SecureServerTest::certificates_ = nullptr;

TEST_F(SecureServerTest, BackwardOverMutualTlsWithTokenMatchesReference) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(Secure());
  ASSERT_TRUE(client.ok()) << client.status();
  const Batch b(300, 256, /*seed=*/31);
  absl::StatusOr<Gradients> g = (*client)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, b);
}

TEST_F(SecureServerTest, WrongOrMissingTokenIsUnauthenticated) {
  for (const char* token : {"wrong-token", ""}) {
    ClientOptions options = Secure();
    options.bearer_token = token;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    ASSERT_TRUE(client.ok());
    absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->ServerInfo();
    ASSERT_FALSE(info.ok()) << "token \"" << token << "\"";
    EXPECT_EQ(info.status().code(), absl::StatusCode::kUnauthenticated) << info.status();
    EXPECT_FALSE(info.status().message().empty());
  }
}

TEST_F(SecureServerTest, CliAndLoadGeneratorCarryTheCredentials) {
  std::vector<std::string> info = SecureFlags();
  info.push_back("info");
  std::ostringstream out, err;
  EXPECT_EQ(tools::RunCli(info, {}, out, err), tools::kExitOk) << err.str();
  EXPECT_NE(out.str().find("\"backend\": \"cpu\""), std::string::npos);

  std::vector<std::string> bad = SecureFlags();
  bad.back() = "--token=wrong";
  bad.push_back("info");
  std::ostringstream bad_out, bad_err;
  EXPECT_EQ(tools::RunCli(bad, {}, bad_out, bad_err), tools::kExitServerError);
  EXPECT_EQ(bad_err.str().rfind("error: UNAUTHENTICATED: ", 0), 0u) << bad_err.str();

  std::vector<std::string> load = SecureFlags();
  for (const char* f : {"--total=16", "--concurrency=4", "--shapes=8x128", "--format=csv"}) {
    load.push_back(f);
  }
  std::ostringstream load_out, load_err;
  ASSERT_EQ(tools::RunLoad(load, "", false, load_out, load_err), 0) << load_err.str();
  EXPECT_NE(load_out.str().find("\n4,16,16,0,"), std::string::npos) << load_out.str();
}

}  // namespace
}  // namespace normgrad
