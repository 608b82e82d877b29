// The installed shape of the tools: the real `normgrad` and `normgrad-load` executables run as
// processes (exit statuses and output streams), against a `normgrad-server` process started on
// 127.0.0.1:0 whose port is read from its ready line.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace normgrad {
namespace {

struct Output {
  int status = -1;
  std::string text;  // stdout and stderr together
};

// Runs a shell command line; bounded by `timeout` (coreutils) so a hang fails instead of waiting.
Output RunCommand(const std::string& command) {
  Output out;
  FILE* pipe = popen(absl::StrCat("timeout 120 ", command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.text.append(buffer, n);
  const int status = pclose(pipe);
  out.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// normgrad-server as a child process; the destructor sends SIGTERM and reaps it.
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> flags) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      std::vector<std::string> args = {NORMGRAD_SERVER_PATH, "--listen=127.0.0.1:0",
                                       "--metrics_listen=", "--backend=cpu"};
      args.insert(args.end(), flags.begin(), flags.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    // The ready line: "normgrad-server ready grpc=127.0.0.1:PORT ...", within 60 s.
    std::string line;
    pollfd p{fds[0], POLLIN, 0};
    while (line.find('\n') == std::string::npos && poll(&p, 1, 60000) == 1) {
      char c[256];
      const ssize_t n = read(fds[0], c, sizeof(c));
      if (n <= 0) break;
      line.append(c, n);
    }
    close(fds[0]);
    const size_t at = line.find("grpc=");
    if (at != std::string::npos) {
      const size_t colon = line.find(':', at);
      port_ = std::atoi(line.c_str() + colon + 1);
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status;
      waitpid(pid_, &status, 0);
    }
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

const std::string kCli = NORMGRAD_CLI_PATH;
const std::string kLoad = NORMGRAD_LOAD_PATH;

TEST(BinariesTest, CliWithoutACommandExits2) {
  const Output o = RunCommand(kCli);
  EXPECT_EQ(o.status, 2);
  EXPECT_NE(o.text.find("usage: normgrad"), std::string::npos);
}

TEST(BinariesTest, CliMissingInputFileExits2WithOneLine) {
  const Output o = RunCommand(kCli + " backward --x /nonexistent/x.npy --dy a --gamma b");
  EXPECT_EQ(o.status, 2);
  EXPECT_EQ(o.text, "normgrad: /nonexistent/x.npy: cannot open (No such file or directory)\n");
}

TEST(BinariesTest, CliUnreachableServerExits1) {
  const Output o =
      RunCommand("env NORMGRAD_TARGET=127.0.0.1:1 " + kCli + " health --max-attempts=1");
  EXPECT_EQ(o.status, 1);
  EXPECT_EQ(o.text.rfind("error: UNAVAILABLE: ", 0), 0u) << o.text;
}

TEST(BinariesTest, LoadHelpAndBadFlags) {
  EXPECT_EQ(RunCommand(kLoad + " --help").status, 0);
  const Output bad = RunCommand(kLoad + " --concurrency=lots");
  EXPECT_EQ(bad.status, 2);
  EXPECT_EQ(bad.text, "normgrad-load: --concurrency: \"lots\" is not an integer\n");
}

#ifdef NORMGRAD_SERVER_PATH
TEST(BinariesTest, CliHealthAndInfoAgainstAServerProcess) {
  ServerProcess server({});
  ASSERT_GT(server.port(), 0);
  const Output health = RunCommand(kCli + " --target=" + server.target() + " health");
  EXPECT_EQ(health.status, 0) << health.text;
  EXPECT_EQ(health.text, "SERVING\n");
  const Output info = RunCommand("env NORMGRAD_TARGET=" + server.target() + " " + kCli + " info");
  EXPECT_EQ(info.status, 0) << info.text;
  EXPECT_NE(info.text.find("\"backend\": \"cpu\""), std::string::npos);
}

TEST(BinariesTest, LoadCountsAgainstAServerWithMaxStreams1) {
  ServerProcess server({"--max-streams=1"});
  ASSERT_GT(server.port(), 0);
  const Output o = RunCommand(kLoad + " --target=" + server.target() +
                              " --total=40 --concurrency=8 --shapes=256x1024 --format=csv");
  ASSERT_EQ(o.status, 0) << o.text;
  // concurrency,requests,successes,errors,...
  const size_t row = o.text.find("\n8,40,");
  ASSERT_NE(row, std::string::npos) << o.text;
  int successes = 0, errors = 0;
  ASSERT_EQ(std::sscanf(o.text.c_str() + row, "\n8,40,%d,%d,", &successes, &errors), 2);
  EXPECT_EQ(successes + errors, 40);
  EXPECT_GT(errors, 0) << o.text;
  const Output summary = RunCommand(kLoad + " --target=" + server.target() +
                                    " --total=24 --concurrency=8 --shapes=256x1024");
  EXPECT_NE(summary.text.find("RESOURCE_EXHAUSTED"), std::string::npos) << summary.text;
}
#endif

}  // namespace
}  // namespace normgrad
