// The service on a unix-domain socket (--listen=unix:/PATH, next to a TCP port): the client
// library, the CLI and the load generator through it; the socket file's mode, a stale socket
// left by a dead server, a socket a live server holds, a path that is not a socket, removal at
// shutdown; and the repeated --listen flag.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/tools/cli.h"
#include "client/tools/load_flags.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "server/process/server_flags.h"
#include "tests/client/test_server.h"

namespace normgrad {
namespace {

using ::normgrad::testing::Batch;
using ::normgrad::testing::StartTestServer;
using ::testing::HasSubstr;

// A fresh directory for the socket files, removed with what is in it (under /tmp: socket paths
// must stay under 108 bytes, which a test's TempDir may not).
class SocketDir {
 public:
  SocketDir() { EXPECT_NE(mkdtemp(path_.data()), nullptr) << std::strerror(errno); }
  ~SocketDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_ = "/tmp/normgrad-unix-XXXXXX";
};

mode_t ModeOf(const std::string& path) {
  struct stat st{};
  if (lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode;
}

// A socket file nobody listens on, as a server killed with SIGKILL leaves behind.
void MakeStaleSocket(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  close(fd);
  ASSERT_TRUE(S_ISSOCK(ModeOf(path)));
}

std::unique_ptr<server::NormGradServer> ServerOn(const std::vector<std::string>& listen,
                                                 uint32_t mode = 0660) {
  return StartTestServer([&](server::ServerOptions& o) {
    o.listen = listen;
    o.unix_socket_mode = mode;
  });
}

TEST(UnixSocketTest, ClientCliAndLoadGeneratorWorkThroughTheSocketBesideTcp) {
  const SocketDir dir;
  const std::string path = dir.path() + "/grpc.sock";
  auto server = ServerOn({"127.0.0.1:0", "unix:" + path});
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  EXPECT_THAT(server->ReadyLine(), HasSubstr(" unix=" + path));
  EXPECT_THAT(server->unix_socket_paths(), ::testing::ElementsAre(path));

  ClientOptions options;
  options.target = "unix:" + path;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
  ASSERT_TRUE(c.ok()) << c.status();
  const Batch b(700, 256, /*seed=*/5);
  absl::StatusOr<Gradients> g = (*c)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  testing::ExpectGradientsClose(g->dx, g->dgamma, b);

  std::ostringstream out, err;
  tools::CliEnvironment env;
  ASSERT_EQ(tools::RunCli({"health", "--target=unix:" + path}, env, out, err), tools::kExitOk)
      << err.str();
  EXPECT_EQ(out.str(), "SERVING\n");

  std::ostringstream lout, lerr;
  ASSERT_EQ(tools::RunLoad({"--target=unix:" + path, "--total=20", "--concurrency=4",
                            "--shapes=4x64", "--format=csv"},
                           "", false, lout, lerr),
            0)
      << lerr.str();
  EXPECT_THAT(lout.str(), HasSubstr(",20,20,0,"));
}

TEST(UnixSocketTest, TheSocketFileGetsTheConfiguredModeAndIsRemovedAtShutdown) {
  const SocketDir socket_dir;
  const std::string& dir = socket_dir.path();
  {
    auto server = ServerOn({"unix:" + dir + "/a.sock"}, 0600);
    ASSERT_NE(server, nullptr);
    EXPECT_EQ(ModeOf(dir + "/a.sock") & 0777, 0600u);
    EXPECT_EQ(server->port(), 0);
    EXPECT_THAT(server->ReadyLine(), HasSubstr("grpc=off"));
    server->Shutdown(absl::ZeroDuration());
    EXPECT_EQ(ModeOf(dir + "/a.sock"), 0u) << "socket file left after shutdown";
  }
  auto server = ServerOn({"unix:" + dir + "/b.sock"}, 0666);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ModeOf(dir + "/b.sock") & 0777, 0666u);
}

TEST(UnixSocketTest, AStaleSocketIsReplacedButALiveOneOrAFileIsNeverTaken) {
  const SocketDir socket_dir;
  const std::string& dir = socket_dir.path();
  MakeStaleSocket(dir + "/stale.sock");
  auto first = ServerOn({"unix:" + dir + "/stale.sock"});
  ASSERT_NE(first, nullptr) << "a stale socket blocked the start";

  server::ServerOptions o;
  o.listen = {"unix:" + dir + "/stale.sock"};
  o.metrics_listen = "";
  o.backend.kind = server::BackendKind::kCpu;
  absl::StatusOr<std::unique_ptr<server::NormGradServer>> second = server::NormGradServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("another server is listening"));
  // The first server still serves there.
  ClientOptions options;
  options.target = "unix:" + dir + "/stale.sock";
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
  ASSERT_TRUE(c.ok());
  absl::StatusOr<HealthStatus> health = (*c)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);

  const std::string file = dir + "/notes.txt";
  std::ofstream(file) << "someone's file";
  o.listen = {"unix:" + file};
  absl::StatusOr<std::unique_ptr<server::NormGradServer>> third = server::NormGradServer::Start(o);
  ASSERT_FALSE(third.ok());
  EXPECT_THAT(third.status().message(), HasSubstr("not a socket"));
  std::ifstream in(file);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "someone's file");
}

// The server accepts unix-socket connections itself and reads each peer's credentials: a user
// --unix-allowed-uids does not list is refused PERMISSION_DENIED naming its uid and pid, on
// every method; a listed one is served; TCP callers are not concerned.
TEST(UnixSocketTest, PeerCredentialsDecideWhoMayCallAndAreNamed) {
  const SocketDir dir;
  const std::string path = dir.path() + "/grpc.sock";
  const uint32_t me = getuid();
  auto refusing = StartTestServer([&](server::ServerOptions& o) {
    o.listen = {"127.0.0.1:0", "unix:" + path};
    o.unix_allowed_uids = {me + 1};  // anyone but this process's user
  });
  ASSERT_NE(refusing, nullptr);
  ClientOptions options;
  options.target = "unix:" + path;
  options.max_attempts = 1;
  std::unique_ptr<Client> c = *Client::Create(options);
  const Batch b(8, 64, /*seed=*/6);
  // Closed at accept: no method answers, health and reflection included (the connection never
  // reaches gRPC), and the server counts the refusals.
  absl::StatusOr<Gradients> g = c->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_EQ(g.status().code(), absl::StatusCode::kUnavailable) << g.status();
  EXPECT_EQ(c->ServerInfo().status().code(), absl::StatusCode::kUnavailable);
  v1::EmitPtxRequest emit;
  emit.set_kernel("batched_rms_norm_backward");
  emit.set_hidden_dim(896);
  EXPECT_EQ(c->EmitPtx(emit).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c->Health().status().code(), absl::StatusCode::kUnavailable);
  // Counted by the accepting thread after it closed the connection: wait for it.
  const std::string series =
      "normgrad_unix_refused_connections_total{reason=\"uid\",socket=\"grpc\"} ";
  std::string metrics;
  double refused = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    metrics = refusing->metrics().RenderText();
    const size_t at = metrics.find(series);
    refused = at == std::string::npos ? 0 : std::stod(metrics.substr(at + series.size()));
    if (refused >= 1) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(refused, 1.0) << metrics;
  // Over TCP the same server serves.
  ClientOptions tcp;
  tcp.target = absl::StrCat("127.0.0.1:", refusing->port());
  absl::StatusOr<Gradients> over_tcp = (*Client::Create(tcp))->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(over_tcp.ok()) << over_tcp.status();
  refusing.reset();

  auto allowing = StartTestServer([&](server::ServerOptions& o) {
    o.listen = {"unix:" + path};
    o.unix_allowed_uids = {me + 1, me};
  });
  ASSERT_NE(allowing, nullptr);
  std::unique_ptr<Client> c2 = *Client::Create(options);
  g = c2->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  testing::ExpectGradientsClose(g->dx, g->dgamma, b);
}

TEST(UnixSocketTest, BadListenValuesAreInvalidArgumentNamingThem) {
  server::ServerOptions o;
  o.metrics_listen = "";
  o.listen = {"127.0.0.1:0", "127.0.0.1:0"};
  EXPECT_THAT(server::CheckServerOptions(o).message(), HasSubstr("at most one HOST:PORT"));
  o.listen = {"unix:"};
  EXPECT_THAT(server::CheckServerOptions(o).message(), HasSubstr("needs a socket path"));
  o.listen = {"unix:/" + std::string(200, 'a')};
  EXPECT_THAT(server::CheckServerOptions(o).message(), HasSubstr("at most 107"));
  o.listen = {};
  EXPECT_EQ(server::CheckServerOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.listen = {"unix:/tmp/x.sock"};
  o.unix_socket_mode = 01777;
  EXPECT_THAT(server::CheckServerOptions(o).message(), HasSubstr("--unix-socket-mode"));
  o.unix_socket_mode = 0660;
  o.unix_allowed_uids = {1000};
  o.listen = {"127.0.0.1:0"};
  EXPECT_THAT(server::CheckServerOptions(o).message(),
              HasSubstr("--unix-allowed-uids needs a --listen=unix:/PATH"));
  o.listen = {"unix:/tmp/x.sock"};
  o.security.cert_file = "server.pem";
  EXPECT_THAT(server::CheckServerOptions(o).message(),
              HasSubstr("--unix-allowed-uids needs plaintext unix sockets"));
}

TEST(UnixSocketTest, RepeatedListenFlagsAreJoinedInOrder) {
  std::vector<std::string> argv_storage = {"normgrad-server", "--listen=127.0.0.1:0",
                                           "--max-streams=3", "--listen", "unix:/tmp/a.sock",
                                           "--", "--listen=x"};
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  EXPECT_THAT(server::NormalizeFlagSpelling(static_cast<int>(argv.size()), argv.data()),
              ::testing::ElementsAre("normgrad-server", "--listen=127.0.0.1:0,unix:/tmp/a.sock",
                                     "--max_streams=3", "--", "--listen=x"));
}

}  // namespace
}  // namespace normgrad
