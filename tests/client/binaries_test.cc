// The installed shape of the tools: the real `normgrad` and `normgrad-load` executables run as
// processes (exit statuses and output streams), against a `normgrad-server` process started on
// 127.0.0.1:0 whose port is read from its ready line.
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/common/child_process.h"
#include "tests/common/shell_command.h"

namespace normgrad {
namespace {

using ::normgrad::testing::CommandOutput;

// Runs a shell command line, stderr with stdout; bounded by `timeout` (coreutils) so a hang fails
// instead of waiting.
CommandOutput RunCommand(const std::string& command) {
  return testing::RunShellCommand(absl::StrCat("timeout 120 ", command, " 2>&1"));
}

#ifdef NORMGRAD_SERVER_PATH
// normgrad-server as a child process, its port read from the ready line within 60 s; the
// destructor sends SIGTERM and reaps it (SIGKILL if it has not exited after 60 s).
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> flags) {
    std::vector<std::string> args = {NORMGRAD_SERVER_PATH, "--listen=127.0.0.1:0",
                                     "--metrics_listen=", "--backend=cpu"};
    args.insert(args.end(), flags.begin(), flags.end());
    testing::ChildOptions options;
    options.stop_signal = SIGTERM;
    options.stop_grace = absl::Seconds(60);
    absl::StatusOr<testing::ChildProcess> process =
        testing::ChildProcess::Start(std::move(args), options);
    if (!process.ok()) {
      ADD_FAILURE() << process.status();  // and port() stays 0
      return;
    }
    process_ = *std::move(process);
    port_ = process_->AwaitReady(absl::Seconds(60)).grpc_port;
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }

 private:
  std::optional<testing::ChildProcess> process_;
  int port_ = 0;
};
#endif

const std::string kCli = NORMGRAD_CLI_PATH;
const std::string kLoad = NORMGRAD_LOAD_PATH;

TEST(BinariesTest, CliWithoutACommandExits2) {
  const CommandOutput o = RunCommand(kCli);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.output.find("usage: normgrad"), std::string::npos);
}

TEST(BinariesTest, CliMissingInputFileExits2WithOneLine) {
  const CommandOutput o = RunCommand(kCli + " backward --x /nonexistent/x.npy --dy a --gamma b");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_EQ(o.output, "normgrad: /nonexistent/x.npy: cannot open (No such file or directory)\n");
}

TEST(BinariesTest, CliUnreachableServerExits1) {
  const CommandOutput o =
      RunCommand("env NORMGRAD_TARGET=127.0.0.1:1 " + kCli + " health --max-attempts=1");
  EXPECT_EQ(o.exit_code, 1);
  EXPECT_EQ(o.output.rfind("error: UNAVAILABLE: ", 0), 0u) << o.output;
}

TEST(BinariesTest, LoadHelpAndBadFlags) {
  EXPECT_EQ(RunCommand(kLoad + " --help").exit_code, 0);
  const CommandOutput bad = RunCommand(kLoad + " --concurrency=lots");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(bad.output, "normgrad-load: --concurrency: \"lots\" is not an integer\n");
}

#ifdef NORMGRAD_SERVER_PATH
TEST(BinariesTest, CliHealthAndInfoAgainstAServerProcess) {
  ServerProcess server({});
  ASSERT_GT(server.port(), 0);
  const CommandOutput health = RunCommand(kCli + " --target=" + server.target() + " health");
  EXPECT_EQ(health.exit_code, 0) << health.output;
  EXPECT_EQ(health.output, "SERVING\n");
  const CommandOutput info =
      RunCommand("env NORMGRAD_TARGET=" + server.target() + " " + kCli + " info");
  EXPECT_EQ(info.exit_code, 0) << info.output;
  EXPECT_NE(info.output.find("\"backend\": \"cpu\""), std::string::npos);
}

TEST(BinariesTest, LoadCountsAgainstAServerWithMaxStreams1) {
  ServerProcess server({"--max-streams=1"});
  ASSERT_GT(server.port(), 0);
  // 512 x 1024 f32 (2 MiB of x) is a stream, which holds its slot from its start through its
  // upload; a batch that fits one message (RmsNormBackwardUnary) holds it only while computed,
  // and eight of them could all be served one after another.
  const CommandOutput o = RunCommand(kLoad + " --target=" + server.target() +
                                     " --total=40 --concurrency=8 --shapes=512x1024 --format=csv");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  // concurrency,requests,successes,errors,...
  const size_t row = o.output.find("\n8,40,");
  ASSERT_NE(row, std::string::npos) << o.output;
  int successes = 0, errors = 0;
  ASSERT_EQ(std::sscanf(o.output.c_str() + row, "\n8,40,%d,%d,", &successes, &errors), 2);
  EXPECT_EQ(successes + errors, 40);
  EXPECT_GT(errors, 0) << o.output;
  const CommandOutput summary = RunCommand(kLoad + " --target=" + server.target() +
                                           " --total=24 --concurrency=8 --shapes=512x1024");
  EXPECT_NE(summary.output.find("RESOURCE_EXHAUSTED"), std::string::npos) << summary.output;
}
#endif

}  // namespace
}  // namespace normgrad
