// normgrad-server as a subprocess: the ready line, SIGTERM drains and exits 0, bad flag values
// exit 2 and start-up failures exit 1, each with one clear line; --help lists the flags.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/child_process.h"
#include "tests/common/unix_socket_util.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::normgrad::testing::ChildOptions;
using ::normgrad::testing::ChildProcess;
using ::normgrad::testing::ParseReadyLine;
using ::testing::HasSubstr;

// stdout and stderr on pipes; SIGKILL if still running at the end.
absl::StatusOr<ChildProcess> StartChild(std::vector<std::string> args) {
  ChildOptions options;
  options.capture_stderr = true;
  return ChildProcess::Start(std::move(args), options);
}

// The exit code, -1 on timeout or when a signal ended it.
int ExitCode(const std::optional<int>& status) {
  return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

std::vector<std::string> ServerArgs(std::vector<std::string> extra) {
  std::vector<std::string> args = {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                                   "--metrics-listen=127.0.0.1:0", "--backend=cpu",
                                   "--cpu-threads=2"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::string LastLine(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  return lines.empty() ? "" : lines.back();
}

// A stream to the server on `port` that has sent the header and the first 10 rows of `batch`
// and read their response: in flight on the server until the test sends the rest.
class StreamInFlight {
 public:
  StreamInFlight(int port, const testing::Batch& batch)
      : stub_(testing::StubFor(port)),
        stream_(stub_->RmsNormBackward(&context_)),
        started_(testing::WriteHeaderAndRowsThenRead(*stream_, batch, 10, first_response_)) {}

  bool started() const { return started_; }
  testing::ClientBackwardStream* operator->() { return stream_.get(); }

 private:
  std::unique_ptr<v1::NormGrad::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<testing::ClientBackwardStream> stream_;
  v1::BackwardResponse first_response_;
  bool started_;
};

TEST(ServerBinaryTest, PrintsReadyLineServesAndExitsZeroOnSigterm) {
  absl::StatusOr<ChildProcess> server = StartChild(ServerArgs({"--shutdown-grace=20s"}));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ready = server->ReadLine(absl::Seconds(60));
  ASSERT_THAT(ready, HasSubstr("normgrad-server ready grpc=127.0.0.1:")) << server->Stderr();
  EXPECT_THAT(ready, HasSubstr("backend=cpu"));
  const int port = ParseReadyLine(ready).grpc_port;
  ASSERT_GT(port, 0);

  // A stream in flight when SIGTERM arrives finishes; then the process exits 0.
  const testing::Batch batch = testing::RandomBatch(30, 64, 41);
  StreamInFlight stream(port, batch);
  ASSERT_TRUE(stream.started());
  server->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(100));  // let the drain begin; correctness does not depend on it
  ASSERT_TRUE(stream->Write(testing::ChunkFor(batch, 10, 20)));
  stream->WritesDone();
  int more = 0;
  v1::BackwardResponse response;
  while (stream->Read(&response)) ++more;
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(more, 2);
  EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(60))), 0) << server->Stderr();
  EXPECT_THAT(server->Stderr(), HasSubstr("SIGTERM received"));
}

// Started with extra flags; the gRPC port from its ready line (0 when it never got ready).
int StartServer(std::optional<ChildProcess>& server, std::vector<std::string> extra) {
  absl::StatusOr<ChildProcess> child = StartChild(ServerArgs(std::move(extra)));
  if (!child.ok()) return 0;
  server.emplace(std::move(*child));
  return server->AwaitReady(absl::Seconds(60)).grpc_port;
}

// When --shutdown-grace runs out, a stream that is still open (here: its client stalls after
// the first chunk) is cancelled by gRPC: its client sees UNAVAILABLE, which it retries on
// another replica (docs/api.md), and the process exits 0 at once.
TEST(ServerBinaryTest, StreamStillOpenWhenTheGraceRunsOutEndsUnavailable) {
  std::optional<ChildProcess> server;
  const int port = StartServer(server, {"--shutdown-grace=1s", "--stream-idle-timeout=60s"});
  ASSERT_GT(port, 0) << (server ? server->Stderr() : "");
  StreamInFlight stream(port, testing::RandomBatch(30, 64, 43));
  ASSERT_TRUE(stream.started());
  const absl::Time sigterm = absl::Now();
  server->Signal(SIGTERM);
  v1::BackwardResponse response;
  while (stream->Read(&response)) {
  }
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(30))), 0) << server->Stderr();
  const absl::Duration took = absl::Now() - sigterm;
  EXPECT_LT(took, absl::Seconds(5)) << "grace 1s; " << server->Stderr();
}

// The process exits as soon as its last stream has ended, also while other clients keep opening
// new streams (each refused UNAVAILABLE, and retried): the drain waits for neither the refused
// ones nor the grace (20 s). Repeated, as the linger it guards against came and went. (Fails
// when the drain waits out the grace.)
TEST(ServerBinaryTest, DrainExitsPromptlyAfterTheLastStreamEvenWhileClientsRetry) {
  constexpr int kRepeats = 5;
  absl::Duration slowest;
  for (int r = 0; r < kRepeats; ++r) {
    std::optional<ChildProcess> server;
    const int port = StartServer(server, {"--shutdown-grace=20s"});
    ASSERT_GT(port, 0) << (server ? server->Stderr() : "");
    const testing::Batch batch = testing::RandomBatch(30, 64, 44 + r);
    StreamInFlight stream(port, batch);
    ASSERT_TRUE(stream.started());

    std::atomic<bool> stop{false};
    std::atomic<int> refused{0};
    // Four callers, each opening its next stream as soon as the last one was refused: there is
    // always one of theirs open on the server.
    std::vector<std::thread> retriers;
    for (int t = 0; t < 4; ++t) {
      retriers.emplace_back([&] {
        auto retry_stub = testing::StubFor(port);
        while (!stop.load()) {
          grpc::ClientContext c;
          c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
          auto s = retry_stub->RmsNormBackward(&c);
          s->Write(testing::HeaderFor(batch));  // whole calls: one admitted before the drain ends
          s->Write(testing::ChunkFor(batch, 0, 30));
          s->WritesDone();
          v1::BackwardResponse ignored;
          while (s->Read(&ignored)) {
          }
          if (s->Finish().error_code() == grpc::StatusCode::UNAVAILABLE) ++refused;
        }
      });
    }
    server->Signal(SIGTERM);
    absl::SleepFor(absl::Milliseconds(200));  // the retrier meets the draining server
    ASSERT_TRUE(stream->Write(testing::ChunkFor(batch, 10, 20)));
    stream->WritesDone();
    v1::BackwardResponse response;
    while (stream->Read(&response)) {
    }
    const grpc::Status s = stream->Finish();
    const absl::Time last_stream_ended = absl::Now();
    const int code = ExitCode(server->WaitExit(absl::Seconds(60)));
    const absl::Duration exit_after = absl::Now() - last_stream_ended;
    stop.store(true);
    for (std::thread& t : retriers) t.join();
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(code, 0) << server->Stderr();
    EXPECT_GT(refused.load(), 0) << "the retrier never met the draining server";
    EXPECT_LT(exit_after, absl::Seconds(2)) << "repeat " << r << ": exit "
                                            << absl::FormatDuration(exit_after)
                                            << " after the last stream ended";
    slowest = std::max(slowest, exit_after);
  }
  std::printf("drain: slowest exit after the last stream of %d: %s\n", kRepeats,
              absl::FormatDuration(slowest).c_str());
}

// grpc.health.v1.Health/Check for the whole server at `target`, with `timeout`: true when the
// answer is SERVING (HealthCheckResponse.status, field 1, SERVING = 1).
bool HealthServing(const std::string& target, absl::Duration timeout) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::Slice empty(std::string(""));  // HealthCheckRequest{service: ""}
  grpc::ByteBuffer in(&empty, 1), out;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &in, &out,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  if (!done.get_future().get().ok()) return false;
  std::vector<grpc::Slice> slices;
  if (!out.Dump(&slices).ok()) return false;
  std::string reply;
  for (const grpc::Slice& p : slices) reply.append(reinterpret_cast<const char*>(p.begin()), p.size());
  return reply == std::string("\x08\x01", 2);
}

// A connection to 127.0.0.1:`port` that says nothing (-1 on failure).
int ConnectTcp(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) return fd;
  if (fd >= 0) close(fd);
  return -1;
}

// A brief descriptor exhaustion must not kill a listener. The process gets 192 descriptors;
// idle unix-socket connections take them all, so that accepting on the TCP ports fails with
// EMFILE meanwhile. (gRPC 1.51's own TCP accept loop stops for good at that failure: the main
// port and the health port stayed dead after the descriptors were released.) Once they are
// released, every listener serves again.
TEST(ServerBinaryTest, EveryListenerServesAgainAfterTheDescriptorsRanOut) {
  ::normgrad::testing::TempDir dir("normgrad-emfile");
  const std::string path = dir.path() + "/s.sock";
  absl::StatusOr<ChildProcess> server = StartChild(
      {"/bin/sh", "-c", "ulimit -n 192 && exec \"$0\" \"$@\"", NORMGRAD_SERVER_BINARY,
       "--listen=127.0.0.1:0", "--listen=unix:" + path, "--health-listen=127.0.0.1:0",
       "--backend=cpu", "--cpu-threads=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  const ::normgrad::testing::ReadyLine ready = server->AwaitReady(absl::Seconds(60));
  ASSERT_GT(ready.grpc_port, 0) << server->Stderr();
  ASSERT_GT(ready.health_port, 0) << ready.text;
  const std::string main_port = absl::StrCat("127.0.0.1:", ready.grpc_port);
  const std::string health_port = absl::StrCat("127.0.0.1:", ready.health_port);
  ASSERT_TRUE(HealthServing(main_port, absl::Seconds(10)));
  ASSERT_TRUE(HealthServing(health_port, absl::Seconds(10)));

  std::vector<int> held;
  for (int i = 0; i < 400; ++i) {
    const int fd = ::normgrad::testing::ConnectUnix(path, SOCK_STREAM);
    if (fd >= 0) held.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(500));  // the server accepts until it runs out
  // Connections that reach the TCP ports meanwhile: accepting them fails with EMFILE.
  for (int i = 0; i < 4; ++i) {
    for (int port : {ready.grpc_port, ready.health_port}) {
      const int fd = ConnectTcp(port);
      if (fd >= 0) held.push_back(fd);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  // Out of descriptors, the server cannot take a new connection.
  EXPECT_FALSE(HealthServing(main_port, absl::Seconds(1)));
  for (int fd : held) close(fd);

  // Released: each listener serves again (the first calls may still meet the pause).
  bool main_back = false, health_back = false, unix_back = false;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until && !(main_back && health_back && unix_back)) {
    main_back = main_back || HealthServing(main_port, absl::Seconds(2));
    health_back = health_back || HealthServing(health_port, absl::Seconds(2));
    unix_back = unix_back || HealthServing("unix:" + path, absl::Seconds(2));
  }
  EXPECT_TRUE(main_back) << server->Stderr();
  EXPECT_TRUE(health_back);
  EXPECT_TRUE(unix_back);
  EXPECT_THAT(server->Stderr(), HasSubstr("Too many open files"));
}

TEST(ServerBinaryTest, PortInUseExitsOneWithOneClearLine) {
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
  absl::StatusOr<ChildProcess> server =
      StartChild({NORMGRAD_SERVER_BINARY, absl::StrCat("--listen=127.0.0.1:", taken),
                  "--metrics-listen=", "--backend=cpu"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int code = ExitCode(server->WaitExit(absl::Seconds(60)));
  close(fd);
  EXPECT_EQ(code, 1);
  const std::string line = LastLine(server->Stderr());
  EXPECT_THAT(line, HasSubstr(absl::StrCat("--listen=127.0.0.1:", taken)));
  EXPECT_THAT(line, HasSubstr("cannot listen"));
}

// docs/operations.md: a bad flag value exits 2 with one line naming the flag (and the value);
// a start-up failure with good flags (a taken port, no usable GPU) exits 1.
TEST(ServerBinaryTest, BadFlagValuesExitTwoNamingTheFlagAndValue) {
  const struct {
    std::vector<std::string> flags;
    const char* named;  // in the last line of stderr
  } cases[] = {
      {{"--backend=gpu"}, "--backend=gpu"},
      {{"--max-streams=0"}, "--max-streams=0"},
      {{"--max-message-bytes=10"}, "--max-message-bytes=10"},
      {{"--max-hidden-dim=10000000"}, "--max-message-bytes=4194304"},
      {{"--max-num-rows=18446744073709551615"}, "--max-num-rows=18446744073709551615"},
      {{"--max-inflight-bytes=1"}, "--max-inflight-bytes=1"},
      {{"--max-streams-per-connection=0"}, "--max-streams-per-connection=0"},
      {{"--stream-idle-timeout=-1s"}, "--stream-idle-timeout=-1s"},
      {{"--min-client-ping-interval=-1s"}, "--min-client-ping-interval=-1s"},
      {{"--max-emit-ptx-queue=0"}, "--max-emit-ptx-queue=0"},
      {{"--max-emit-ptx-queue-per-connection=65"}, "--max-emit-ptx-queue-per-connection=65"},
      {{"--max-emit-ptx-queue-bytes=0"}, "--max-emit-ptx-queue-bytes=0"},
      {{"--max-emit-ptx-queue-bytes-per-connection=0"},
       "--max-emit-ptx-queue-bytes-per-connection=0"},
      {{"--emit-ptx-threads=0"}, "--emit-ptx-threads=0"},
      {{"--min-stream-rate-window=soon"}, "--min-stream-rate-window=soon"},
      {{"--min-stream-rate-window=0s"}, "--min-stream-rate-window=0"},
      {{"--listen=bogus"}, "--listen=bogus"},
      {{"--listen=127.0.0.1:99999"}, "--listen=127.0.0.1:99999"},
      {{"--metrics-listen=bogus"}, "--metrics-listen=bogus"},
      {{"--health-listen=bogus"}, "--health-listen=bogus"},
      {{"--unix-socket-mode=999"}, "--unix-socket-mode=999"},
      {{"--listen=unix:"}, "--listen=unix:"},
      {{"--preload=no_such_kernel:sm_90"}, "--preload entry \"no_such_kernel:sm_90\""},
      {{"--tls-cert=/nonexistent/tls.crt", "--tls-key=/nonexistent/tls.key"},
       "--tls-cert=/nonexistent/tls.crt"},
      {{"--auth-token-file=/nonexistent/token"}, "--auth-token-file"},
      {{"--metrics-tls-cert=/nonexistent/m.crt"}, "--metrics-tls-cert"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<ChildProcess> server = StartChild(ServerArgs(c.flags));
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(30))), 2) << c.flags[0] << server->Stderr();
    EXPECT_THAT(LastLine(server->Stderr()), HasSubstr(c.named)) << c.flags[0];
  }
  {  // absl's own parse error
    absl::StatusOr<ChildProcess> server = StartChild(ServerArgs({"--max-streams=many"}));
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_NE(ExitCode(server->WaitExit(absl::Seconds(30))), 0);
    EXPECT_THAT(server->Stderr(), HasSubstr("max_streams"));
  }
  {  // good flags, but no GPU to be had: a start-up failure, 1
    absl::StatusOr<ChildProcess> server = StartChild(
        {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--metrics-listen=", "--backend=cuda",
         "--cuda-driver=/nonexistent/libcuda.so.1"});
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(ExitCode(server->WaitExit(absl::Seconds(30))), 1) << server->Stderr();
    EXPECT_THAT(LastLine(server->Stderr()), HasSubstr("FAILED_PRECONDITION"));
  }
}

TEST(ServerBinaryTest, HelpDocumentsEveryFlag) {
  absl::StatusOr<ChildProcess> server = StartChild({NORMGRAD_SERVER_BINARY, "--help"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string help = server->ReadRest(absl::Seconds(30)) + server->Stderr();
  (void)server->WaitExit(absl::Seconds(30));
  for (const char* flag :
       {"listen", "metrics_listen", "backend", "cuda_driver", "cpu_threads", "cache_max_entries",
        "cache_max_bytes", "preload", "max_streams", "max_inflight_bytes", "max_hidden_dim",
        "max_num_rows", "max_message_bytes", "stream_idle_timeout", "shutdown_grace",
        "nvjitlink", "max_streams_per_client", "min_stream_bytes_per_second",
        "min_stream_rate_window", "emit_ptx_threads", "max_emit_ptx_queue",
        "max_emit_ptx_queue_per_connection", "max_emit_ptx_queue_bytes",
        "max_emit_ptx_queue_bytes_per_connection"}) {
    EXPECT_THAT(help, HasSubstr(absl::StrCat("--", flag, " ("))) << flag;
  }
}

}  // namespace
}  // namespace normgrad::server
