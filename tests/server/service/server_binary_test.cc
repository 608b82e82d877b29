// normgrad-server as a subprocess: the ready line, SIGTERM drains and exits 0, start-up failures
// exit non-zero with one clear line, --help lists the flags.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

// A child process with its stdout and stderr on pipes.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      dup2(err[1], 2);
      close(out[0]);
      close(err[0]);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    out_ = out[0];
    err_ = err[0];
  }
  ~Child() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait(absl::Seconds(10));
    }
    if (out_ >= 0) close(out_);
    if (err_ >= 0) close(err_);
  }

  // The next stdout line, or "" after `limit`.
  std::string ReadLine(absl::Duration limit) {
    const absl::Time end = absl::Now() + limit;
    while (true) {
      const size_t nl = out_buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = out_buffer_.substr(0, nl);
        out_buffer_.erase(0, nl + 1);
        return line;
      }
      const int ms = static_cast<int>(absl::ToInt64Milliseconds(end - absl::Now()));
      if (ms <= 0) return "";
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, ms) <= 0) return "";
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return "";
      out_buffer_.append(buf, n);
    }
  }

  // Everything left on stdout until EOF (or `limit`).
  std::string ReadRest(absl::Duration limit) {
    const absl::Time end = absl::Now() + limit;
    std::string out = std::move(out_buffer_);
    out_buffer_.clear();
    while (true) {
      const int ms = static_cast<int>(absl::ToInt64Milliseconds(end - absl::Now()));
      if (ms <= 0) return out;
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, ms) <= 0) return out;
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return out;
      out.append(buf, n);
    }
  }

  // Exit status (-1 on timeout or signal).
  int Wait(absl::Duration limit) {
    const absl::Time end = absl::Now() + limit;
    while (absl::Now() < end) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      DrainStderr();
      absl::SleepFor(absl::Milliseconds(10));
    }
    return -1;
  }

  std::string Stderr() {
    DrainStderr();
    return err_buffer_;
  }
  void Signal(int sig) { kill(pid_, sig); }
  bool started() const { return pid_ > 0; }

 private:
  void DrainStderr() {
    while (true) {
      pollfd p{err_, POLLIN, 0};
      if (poll(&p, 1, 0) <= 0) return;
      char buf[4096];
      const ssize_t n = read(err_, buf, sizeof(buf));
      if (n <= 0) return;
      err_buffer_.append(buf, n);
    }
  }

  pid_t pid_ = -1;
  int out_ = -1, err_ = -1;
  bool exited_ = false;
  std::string out_buffer_, err_buffer_;
};

std::vector<std::string> ServerArgs(std::vector<std::string> extra) {
  std::vector<std::string> args = {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                                   "--metrics-listen=127.0.0.1:0", "--backend=cpu",
                                   "--cpu-threads=2"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// "... grpc=127.0.0.1:PORT ..." -> PORT, or 0.
int GrpcPortFromReadyLine(const std::string& line) {
  for (absl::string_view field : absl::StrSplit(line, ' ')) {
    if (absl::ConsumePrefix(&field, "grpc=")) {
      const size_t colon = field.rfind(':');
      int port = 0;
      if (colon != absl::string_view::npos && absl::SimpleAtoi(field.substr(colon + 1), &port)) {
        return port;
      }
    }
  }
  return 0;
}

std::string LastLine(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  return lines.empty() ? "" : lines.back();
}

TEST(ServerBinaryTest, PrintsReadyLineServesAndExitsZeroOnSigterm) {
  Child server(ServerArgs({"--shutdown-grace=20s"}));
  ASSERT_TRUE(server.started());
  const std::string ready = server.ReadLine(absl::Seconds(60));
  ASSERT_THAT(ready, HasSubstr("normgrad-server ready grpc=127.0.0.1:")) << server.Stderr();
  EXPECT_THAT(ready, HasSubstr("backend=cpu"));
  const int port = GrpcPortFromReadyLine(ready);
  ASSERT_GT(port, 0);
  auto stub = testing::StubFor(port);

  // A stream in flight when SIGTERM arrives finishes; then the process exits 0.
  const testing::Batch batch = testing::RandomBatch(30, 64, 41);
  grpc::ClientContext context;
  auto stream = stub->RmsNormBackward(&context);
  ASSERT_TRUE(stream->Write(testing::HeaderFor(batch)));
  ASSERT_TRUE(stream->Write(testing::ChunkFor(batch, 0, 10)));
  v1::BackwardResponse response;
  ASSERT_TRUE(stream->Read(&response));
  server.Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(100));  // let the drain begin; correctness does not depend on it
  ASSERT_TRUE(stream->Write(testing::ChunkFor(batch, 10, 20)));
  stream->WritesDone();
  int more = 0;
  while (stream->Read(&response)) ++more;
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(more, 2);
  EXPECT_EQ(server.Wait(absl::Seconds(60)), 0) << server.Stderr();
  EXPECT_THAT(server.Stderr(), HasSubstr("SIGTERM received"));
}

TEST(ServerBinaryTest, PortInUseExitsNonZeroWithOneClearLine) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int taken = ntohs(addr.sin_port);
  Child server({NORMGRAD_SERVER_BINARY, absl::StrCat("--listen=127.0.0.1:", taken),
                "--metrics-listen=", "--backend=cpu"});
  const int code = server.Wait(absl::Seconds(60));
  close(fd);
  EXPECT_NE(code, 0);
  EXPECT_NE(code, -1);
  const std::string line = LastLine(server.Stderr());
  EXPECT_THAT(line, HasSubstr(absl::StrCat("--listen=127.0.0.1:", taken)));
  EXPECT_THAT(line, HasSubstr("cannot listen"));
}

TEST(ServerBinaryTest, BadFlagValuesExitNonZeroNamingTheFlag) {
  {
    Child server(ServerArgs({"--backend=gpu"}));
    EXPECT_EQ(server.Wait(absl::Seconds(30)), 2);
    EXPECT_THAT(LastLine(server.Stderr()), HasSubstr("--backend=gpu"));
  }
  {
    Child server(ServerArgs({"--max-hidden-dim=10000000"}));
    EXPECT_NE(server.Wait(absl::Seconds(30)), 0);
    EXPECT_THAT(LastLine(server.Stderr()), HasSubstr("--max-message-bytes"));
  }
  {
    Child server(ServerArgs({"--max-streams=many"}));
    EXPECT_NE(server.Wait(absl::Seconds(30)), 0);
    EXPECT_THAT(server.Stderr(), HasSubstr("max_streams"));
  }
}

TEST(ServerBinaryTest, HelpDocumentsEveryFlag) {
  Child server({NORMGRAD_SERVER_BINARY, "--help"});
  const std::string help = server.ReadRest(absl::Seconds(30)) + server.Stderr();
  server.Wait(absl::Seconds(30));
  for (const char* flag :
       {"listen", "metrics_listen", "backend", "cuda_driver", "cpu_threads", "cache_max_entries",
        "cache_max_bytes", "preload", "max_streams", "max_inflight_bytes", "max_hidden_dim",
        "max_num_rows", "max_message_bytes", "stream_idle_timeout", "shutdown_grace",
        "nvjitlink"}) {
    EXPECT_THAT(help, HasSubstr(absl::StrCat("--", flag, " ("))) << flag;
  }
}

}  // namespace
}  // namespace normgrad::server
