// normgrad-server's transport security, in-process on 127.0.0.1:0: TLS, mutual TLS, bearer
// tokens, the plaintext health-only port, HTTPS metrics, start-up refusals, and that no request
// can make the server load PTX it did not emit itself. Certificates are made at run time with
// the openssl command-line tool (a CA, a server certificate for 127.0.0.1/localhost, a client
// certificate, and a second CA with its own client certificate).
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/tools/cli.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "server/process/normgrad_server.h"
#include "server/process/transport_security.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "s3cret-token-0123456789";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// Certificates and the token file in a temporary directory, made once for the suite.
class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char pattern[] = "/tmp/normgrad_security_XXXXXX";
    if (mkdtemp(pattern) == nullptr) return;
    dir_ = new std::string(pattern);
    // P-256 keys: as good as RSA for these checks and much faster to make.
    const std::string req = "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ";
    const std::string sign = "openssl x509 -req -CAcreateserial -days 2 ";
    const std::string script = absl::StrCat(
        "set -e; cd '", *dir_, "';",                                                  //
        req, "-x509 -days 2 -keyout ca.key -out ca.pem -subj /CN=normgrad-test-ca;",  //
        req, "-x509 -days 2 -keyout other_ca.key -out other_ca.pem -subj /CN=other-ca;",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext;",  //
        req, "-keyout server.key -out server.csr -subj /CN=localhost;",         //
        sign, "-in server.csr -CA ca.pem -CAkey ca.key -out server.pem -extfile server.ext;", req,
        "-keyout client.key -out client.csr -subj /CN=client;",             //
        sign, "-in client.csr -CA ca.pem -CAkey ca.key -out client.pem;",   //
        req, "-keyout stranger.key -out stranger.csr -subj /CN=stranger;",  //
        sign, "-in stranger.csr -CA other_ca.pem -CAkey other_ca.key -out stranger.pem");
    const std::string command = absl::StrCat("sh -c \"", script, "\" > /dev/null 2>&1");
    made_ = std::system(command.c_str()) == 0;
    WriteFile(Path("token"), absl::StrCat("  ", kToken, "\n"));
    WriteFile(Path("empty_token"), " \n");
  }
  static void TearDownTestSuite() {
    if (dir_ != nullptr) {
      const std::string command = absl::StrCat("rm -rf '", *dir_, "'");
      (void)std::system(command.c_str());
      delete dir_;
      dir_ = nullptr;
    }
  }
  void SetUp() override {
    if (!made_) GTEST_SKIP() << "openssl could not make test certificates";
  }

  static std::string Path(const std::string& name) { return absl::StrCat(*dir_, "/", name); }

  static ServerOptions TlsOptions(bool mutual, bool token) {
    ServerOptions o = testing::TestServerOptions();
    o.security.cert_file = Path("server.pem");
    o.security.key_file = Path("server.key");
    if (mutual) o.security.client_ca_file = Path("ca.pem");
    if (token) o.security.token_file = Path("token");
    return o;
  }

  static std::unique_ptr<NormGradServer> StartOrDie(const ServerOptions& o) {
    absl::StatusOr<std::unique_ptr<NormGradServer>> s = NormGradServer::Start(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // A client of 127.0.0.1:`port`; `tls` picks the trust roots and client certificate by name
  // ("" for plaintext). One attempt, short deadline: failures come back at once.
  static std::unique_ptr<Client> ClientFor(int port, const std::string& ca,
                                           const std::string& cert = "",
                                           const std::string& token = "") {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", port);
    o.max_attempts = 1;
    o.default_deadline = absl::Seconds(20);
    o.bearer_token = token;
    if (!ca.empty()) {
      o.use_tls = true;
      o.tls.root_certs_pem = ReadFile(Path(ca));
      if (!cert.empty()) {
        o.tls.client_cert_pem = ReadFile(Path(cert + ".pem"));
        o.tls.client_key_pem = ReadFile(Path(cert + ".key"));
      }
    }
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // The status of one GetServerInfo call to 127.0.0.1:`port` by ClientFor(port, ca, cert, token).
  static absl::Status InfoStatus(int port, const std::string& ca, const std::string& cert = "",
                                 const std::string& token = "") {
    std::unique_ptr<Client> client = ClientFor(port, ca, cert, token);
    if (client == nullptr) return absl::InternalError("no client (see above)");
    return client->ServerInfo({absl::Seconds(10)}).status();
  }

  static inline std::string* dir_ = nullptr;
  static inline bool made_ = false;
};

TEST_F(SecurityTest, TlsServesInfoAndBackwardToAClientTrustingItsCa) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(false, false));
  ASSERT_NE(server, nullptr);
  EXPECT_THAT(server->ReadyLine(), HasSubstr(" tls=on"));
  std::unique_ptr<Client> client = ClientFor(server->port(), "ca.pem");
  ASSERT_NE(client, nullptr);
  absl::StatusOr<v1::GetServerInfoResponse> info = client->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const testing::Batch batch = testing::RandomBatch(8, 64, 1);
  absl::StatusOr<Gradients> g = client->Backward(batch.x, batch.dy, batch.gamma, batch.eps);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<float> dx, dgamma;
  testing::ReferenceFor(batch, dx, dgamma);
  EXPECT_LT(testing::MaxDxError(batch, g->dx, dx), 1e-4);
}

TEST_F(SecurityTest, PlaintextClientCannotTalkToTlsServer) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(false, false));
  ASSERT_NE(server, nullptr);
  const absl::Status s = InfoStatus(server->port(), "");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(SecurityTest, TlsClientRejectsServerFromAnotherCa) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(false, false));
  ASSERT_NE(server, nullptr);
  const absl::Status s = InfoStatus(server->port(), "other_ca.pem");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(SecurityTest, MutualTlsAcceptsOnlyClientCertificatesOfItsCa) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(true, false));
  ASSERT_NE(server, nullptr);
  EXPECT_THAT(server->ReadyLine(), HasSubstr(" tls=mtls"));
  const absl::Status with_certificate = InfoStatus(server->port(), "ca.pem", "client");
  EXPECT_TRUE(with_certificate.ok()) << with_certificate;
  const absl::Status without = InfoStatus(server->port(), "ca.pem");
  EXPECT_EQ(without.code(), absl::StatusCode::kUnavailable) << "no client certificate: " << without;
  const absl::Status stranger = InfoStatus(server->port(), "ca.pem", "stranger");
  EXPECT_EQ(stranger.code(), absl::StatusCode::kUnavailable)
      << "certificate of another CA: " << stranger;
}

TEST_F(SecurityTest, BearerTokenMissingOrWrongIsUnauthenticatedWithoutEchoingIt) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(false, true));
  ASSERT_NE(server, nullptr);
  const absl::Status missing = InfoStatus(server->port(), "ca.pem");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("missing bearer token"));

  const std::string wrong = "wrong-token-guess";
  const absl::Status bad = InfoStatus(server->port(), "ca.pem", "", wrong);
  EXPECT_EQ(bad.code(), absl::StatusCode::kUnauthenticated) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("wrong bearer token"));
  EXPECT_THAT(bad.message(), Not(HasSubstr(wrong)));
  EXPECT_THAT(bad.message(), Not(HasSubstr(kToken)));

  // A prefix of the right token is still wrong (the comparison covers the whole value).
  const absl::Status prefix =
      InfoStatus(server->port(), "ca.pem", "", std::string(kToken).substr(0, 10));
  EXPECT_EQ(prefix.code(), absl::StatusCode::kUnauthenticated) << prefix;

  const absl::Status info = InfoStatus(server->port(), "ca.pem", "", kToken);
  EXPECT_TRUE(info.ok()) << info;
  std::unique_ptr<Client> good = ClientFor(server->port(), "ca.pem", "", kToken);
  const testing::Batch batch = testing::RandomBatch(4, 32, 2);
  absl::StatusOr<Gradients> g = good->Backward(batch.x, batch.dy, batch.gamma, batch.eps);
  EXPECT_TRUE(g.ok()) << g.status();

  // Backward streams are checked the same way.
  absl::StatusOr<Gradients> anonymous =
      ClientFor(server->port(), "ca.pem")->Backward(batch.x, batch.dy, batch.gamma, batch.eps);
  EXPECT_EQ(anonymous.status().code(), absl::StatusCode::kUnauthenticated) << anonymous.status();
}

// The CLI reads the token from a file (never needing it on the command line) and speaks TLS.
TEST_F(SecurityTest, CliReadsTheTokenFromAFile) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(false, true));
  ASSERT_NE(server, nullptr);
  const std::string target = absl::StrCat("--target=127.0.0.1:", server->port());
  auto run = [&](std::vector<std::string> args, std::string* err_text) {
    std::ostringstream out, err;
    const int code = tools::RunCli(args, {}, out, err);
    *err_text = err.str();
    return code;
  };
  std::string err;
  EXPECT_EQ(run({target, "info", "--tls-ca", Path("ca.pem"), "--token-file", Path("token")}, &err),
            tools::kExitOk)
      << err;
  EXPECT_EQ(run({target, "info", "--tls-ca", Path("ca.pem")}, &err), tools::kExitServerError);
  EXPECT_THAT(err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_EQ(
      run({target, "info", "--tls-ca", Path("ca.pem"), "--token-file", Path("empty_token")}, &err),
      tools::kExitUsage);
  EXPECT_THAT(err, HasSubstr("--token-file"));
}

TEST_F(SecurityTest, HealthOnTheMainPortNeedsNoToken) {
  std::unique_ptr<NormGradServer> server = StartOrDie(TlsOptions(false, true));
  ASSERT_NE(server, nullptr);
  absl::StatusOr<HealthStatus> health =
      ClientFor(server->port(), "ca.pem")->Health("", {absl::Seconds(10)});
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);
}

TEST_F(SecurityTest, HealthPortIsPlaintextTokenFreeAndHealthOnly) {
  ServerOptions o = TlsOptions(true, true);
  o.health_listen = "127.0.0.1:0";
  std::unique_ptr<NormGradServer> server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->health_port(), 0);
  EXPECT_THAT(server->ReadyLine(),
              HasSubstr(absl::StrCat(" health=127.0.0.1:", server->health_port())));
  std::unique_ptr<Client> probe = ClientFor(server->health_port(), "");
  for (const std::string service : {"", "normgrad.v1.NormGrad"}) {
    absl::StatusOr<HealthStatus> health = probe->Health(service, {absl::Seconds(10)});
    ASSERT_TRUE(health.ok()) << service << ": " << health.status();
    EXPECT_EQ(*health, HealthStatus::kServing) << service;
  }
  absl::StatusOr<v1::GetServerInfoResponse> info = probe->ServerInfo({absl::Seconds(10)});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnimplemented) << info.status();
  const testing::Batch batch = testing::RandomBatch(2, 16, 3);
  absl::StatusOr<Gradients> g = probe->Backward(batch.x, batch.dy, batch.gamma, batch.eps);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented) << g.status();
}

TEST_F(SecurityTest, HealthPortReportsNotServingWhileTheServerDrains) {
  ServerOptions o = testing::TestServerOptions();
  o.health_listen = "127.0.0.1:0";
  std::unique_ptr<NormGradServer> server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  // An open RmsNormBackward stream (header sent, no rows yet) keeps the drain waiting.
  std::unique_ptr<v1::NormGrad::Stub> stub = testing::StubFor(server->port());
  grpc::ClientContext context;
  auto stream = stub->RmsNormBackward(&context);
  const testing::Batch batch = testing::RandomBatch(4, 16, 4);
  ASSERT_TRUE(stream->Write(testing::HeaderFor(batch)));
  for (int i = 0; i < 500 && server->live_streams() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(server->live_streams(), 1u);
  std::thread drain([&] { server->Shutdown(absl::Seconds(20)); });
  std::unique_ptr<Client> probe = ClientFor(server->health_port(), "");
  HealthStatus seen = HealthStatus::kServing;
  for (int i = 0; i < 200 && seen == HealthStatus::kServing; ++i) {
    absl::StatusOr<HealthStatus> health = probe->Health("", {absl::Seconds(5)});
    ASSERT_TRUE(health.ok()) << health.status();
    seen = *health;
    if (seen == HealthStatus::kServing) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(seen, HealthStatus::kNotServing);
  context.TryCancel();
  drain.join();
}

TEST_F(SecurityTest, MetricsOverHttpsWithTheServerCertificate) {
  ServerOptions o = testing::TestServerOptions();
  o.metrics_tls_cert_file = Path("server.pem");
  o.metrics_tls_key_file = Path("server.key");
  std::unique_ptr<NormGradServer> server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  httplib::SSLClient https("127.0.0.1", server->metrics_port());
  https.set_ca_cert_path(Path("ca.pem").c_str());
  https.enable_server_certificate_verification(true);
  https.set_connection_timeout(5, 0);
  https.set_read_timeout(10, 0);
  httplib::Result res = https.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_THAT(res->body, HasSubstr("normgrad_serving 1"));

  int status = 0;
  (void)testing::HttpGet(server->metrics_port(), "/metrics", &status);
  EXPECT_NE(status, 200) << "plain HTTP must not be answered on the HTTPS port";
}

grpc::Status InfoWithin(grpc::Channel* channel, absl::Duration deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  v1::GetServerInfoRequest request;
  v1::GetServerInfoResponse response;
  return v1::NormGrad::NewStub(std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}))
      ->GetServerInfo(&context, request, &response);
}

// --max-streams-per-connection is the HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: with 1, a
// connection holding an open stream cannot start a second call (it waits in the client's
// transport until its deadline), while another connection can.
TEST(ConnectionLimitsTest, MaxStreamsPerConnectionHoldsFurtherCallsOfThatConnection) {
  ServerOptions o = testing::TestServerOptions();
  o.max_streams_per_connection = 1;
  absl::StatusOr<std::unique_ptr<NormGradServer>> server = NormGradServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::shared_ptr<grpc::Channel> busy = testing::OwnConnectionFor((*server)->port());
  std::unique_ptr<v1::NormGrad::Stub> stub = v1::NormGrad::NewStub(busy);
  grpc::ClientContext context;
  auto stream = stub->RmsNormBackward(&context);
  const testing::Batch batch = testing::RandomBatch(4, 16, 6);
  ASSERT_TRUE(stream->Write(testing::HeaderFor(batch)));
  for (int i = 0; i < 500 && (*server)->live_streams() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ((*server)->live_streams(), 1u);

  EXPECT_EQ(InfoWithin(busy.get(), absl::Seconds(1)).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  std::shared_ptr<grpc::Channel> other = testing::OwnConnectionFor((*server)->port());
  grpc::Status s = InfoWithin(other.get(), absl::Seconds(20));
  EXPECT_TRUE(s.ok()) << s.error_message();

  context.TryCancel();
  (void)stream->Finish();
  s = InfoWithin(busy.get(), absl::Seconds(20));
  EXPECT_TRUE(s.ok()) << "the slot is free again: " << s.error_message();
}

TEST_F(SecurityTest, StartRefusesUnsafeOrBrokenSecurityOptions) {
  {
    ServerOptions o = testing::TestServerOptions();
    o.security.token_file = Path("token");
    absl::Status s = NormGradServer::Start(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("--auth-token-file needs --tls-cert"));
  }
  {
    ServerOptions o = testing::TestServerOptions();
    o.security.cert_file = Path("server.pem");
    absl::Status s = NormGradServer::Start(o).status();
    EXPECT_THAT(s.message(), HasSubstr("--tls-cert and --tls-key go together"));
  }
  {
    ServerOptions o = testing::TestServerOptions();
    o.security.client_ca_file = Path("ca.pem");
    absl::Status s = NormGradServer::Start(o).status();
    EXPECT_THAT(s.message(), HasSubstr("--tls-client-ca needs --tls-cert"));
  }
  {
    ServerOptions o = TlsOptions(false, false);
    o.security.token_file = Path("empty_token");
    absl::Status s = NormGradServer::Start(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("empty"));
  }
  {
    ServerOptions o = TlsOptions(false, false);
    o.security.key_file = Path("token");  // not PEM; the message names the flag, not the bytes
    absl::Status s = NormGradServer::Start(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("--tls-key="));
    EXPECT_THAT(s.message(), Not(HasSubstr(kToken)));
  }
  {
    ServerOptions o = TlsOptions(false, false);
    o.security.key_file = Path("client.key");  // a real key, but not the certificate's
    absl::Status s = NormGradServer::Start(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("is not the key of --tls-cert="));
  }
  {
    ServerOptions o = testing::TestServerOptions();
    o.max_streams_per_connection = 0;
    EXPECT_THAT(NormGradServer::Start(o).status().message(),
                HasSubstr("--max-streams-per-connection"));
  }
}

TEST(BearerMatchesTest, ComparesTheWholeValueIncludingScheme) {
  EXPECT_TRUE(BearerMatches("Bearer abc", "abc"));
  EXPECT_FALSE(BearerMatches("Bearer abcd", "abc"));
  EXPECT_FALSE(BearerMatches("Bearer ab", "abc"));
  EXPECT_FALSE(BearerMatches("abc", "abc"));
  EXPECT_FALSE(BearerMatches("Basic abc", "abc"));
  EXPECT_FALSE(BearerMatches("", "abc"));
}

// The API names kernels and configurations only; the server emits every PTX it compiles or
// returns. A request cannot name a file, pass text, or smuggle PTX through the kernel name.
TEST(ForeignPtxTest, UnknownOrInjectedKernelNamesAreRefused) {
  absl::StatusOr<std::unique_ptr<NormGradServer>> server =
      NormGradServer::Start(testing::TestServerOptions());
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<v1::NormGrad::Stub> stub = testing::StubFor((*server)->port());
  const std::string names[] = {
      "no_such_kernel",
      "../../../tmp/evil.ptx",
      "/tmp/evil.ptx",
      "batched_rms_norm_backward\n.visible .entry evil() { trap; }",
      ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry x() { ret; }",
  };
  for (const std::string& name : names) {
    v1::EmitPtxRequest request;
    request.set_kernel(name);
    request.set_hidden_dim(64);
    request.set_target("sm_90");
    v1::EmitPtxResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::Status s = stub->EmitPtx(&context, request, &response);
    EXPECT_FALSE(s.ok()) << name;
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                s.error_code() == grpc::StatusCode::NOT_FOUND)
        << name << ": " << s.error_message();

    const testing::Batch batch = testing::RandomBatch(2, 64, 5);
    v1::BackwardRequest header = testing::HeaderFor(batch);
    header.mutable_header()->mutable_options()->set_kernel(name);
    grpc::Status b = testing::SendMessages(*stub, {header, testing::ChunkFor(batch, 0, 2)});
    EXPECT_TRUE(b.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                b.error_code() == grpc::StatusCode::NOT_FOUND)
        << name << ": " << b.error_message();
  }
}

}  // namespace
}  // namespace normgrad::server
