// The client's TLS, mutual TLS and bearer-token options against a small TLS gRPC server in the
// test (secure_server_test.cc does the same against normgrad-server). Certificates are made at
// run time with the openssl command-line tool.
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "tests/client/test_certificates.h"

namespace normgrad {
namespace {

// GetServerInfo only; remembers the authorization metadata it saw.
class InfoService final : public v1::NormGrad::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest*,
                                          v1::GetServerInfoResponse* response) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto& metadata = context->client_metadata();
      auto it = metadata.find("authorization");
      authorization_ =
          it == metadata.end() ? "" : std::string(it->second.data(), it->second.size());
    }
    response->set_version("tls-test");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  std::string authorization() {
    std::lock_guard<std::mutex> lock(mu_);
    return authorization_;
  }

 private:
  std::mutex mu_;
  std::string authorization_;
};

class ClientTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certificates_ = new testing::TestCertificates(::testing::TempDir());
  }
  static void TearDownTestSuite() { delete certificates_; }

  void StartServer(bool require_client_cert) {
    if (!certificates_->ok()) GTEST_SKIP() << "openssl could not make test certificates";
    grpc::SslServerCredentialsOptions ssl(
        require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                            : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    ssl.pem_root_certs = Pem("ca.pem");
    ssl.pem_key_cert_pairs.push_back({Pem("server.key"), Pem("server.pem")});
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(ssl), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  static std::string Pem(const std::string& name) { return certificates_->Pem(name); }

  ClientOptions TlsOptions() {
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", port_);
    options.use_tls = true;
    options.tls.root_certs_pem = Pem("ca.pem");
    options.tls.server_name_override = "normgrad.test";
    options.max_attempts = 1;
    options.default_deadline = absl::Seconds(10);
    return options;
  }
  absl::StatusOr<v1::GetServerInfoResponse> Info(const ClientOptions& options) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    if (!client.ok()) return client.status();
    return (*client)->ServerInfo();
  }

  static testing::TestCertificates* certificates_;
  InfoService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};
testing::TestCertificates* ClientTlsTest::certificates_ = nullptr;

TEST_F(ClientTlsTest, TlsWithTheRightRootCertificateConnects) {
  StartServer(/*require_client_cert=*/false);
  absl::StatusOr<v1::GetServerInfoResponse> info = Info(TlsOptions());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), "tls-test");
}

TEST_F(ClientTlsTest, UntrustedServerCertificateIsUnavailable) {
  StartServer(false);
  ClientOptions options = TlsOptions();
  options.tls.root_certs_pem = Pem("other_ca.pem");
  absl::StatusOr<v1::GetServerInfoResponse> info = Info(options);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
}

TEST_F(ClientTlsTest, PlaintextClientCannotTalkToATlsServer) {
  StartServer(false);
  ClientOptions options = TlsOptions();
  options.use_tls = false;
  EXPECT_FALSE(Info(options).ok());
}

TEST_F(ClientTlsTest, MutualTlsNeedsTheClientCertificate) {
  StartServer(/*require_client_cert=*/true);
  EXPECT_FALSE(Info(TlsOptions()).ok());
  ClientOptions options = TlsOptions();
  options.tls.client_cert_pem = Pem("client.pem");
  options.tls.client_key_pem = Pem("client.key");
  absl::StatusOr<v1::GetServerInfoResponse> info = Info(options);
  ASSERT_TRUE(info.ok()) << info.status();
}

TEST_F(ClientTlsTest, CertificateWithoutKeyIsRejectedAtCreate) {
  ClientOptions options;
  options.use_tls = true;
  options.tls.client_cert_pem = "cert";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTlsTest, BearerTokenArrivesAsAuthorizationMetadata) {
  StartServer(false);
  ClientOptions options = TlsOptions();
  options.bearer_token = "s3cret";
  ASSERT_TRUE(Info(options).ok());
  EXPECT_EQ(service_.authorization(), "Bearer s3cret");
}

}  // namespace
}  // namespace normgrad
