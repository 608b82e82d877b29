// A program run as a child process, for the tests that need a real binary (normgrad-server
// above all): fork/exec with stdout (and, as an option, stderr) on pipes, normgrad-server's
// ready line parsed, signals, waits bounded in time, figures from /proc/PID/status.
//
//   absl::StatusOr<ChildProcess> server = ChildProcess::Start(
//       {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0"});
//   ASSERT_TRUE(server.ok()) << server.status();
//   const ReadyLine ready = server->AwaitReady(absl::Seconds(60));
//   ASSERT_GT(ready.grpc_port, 0);
//   ...
//   server->Signal(SIGTERM);
//   const std::optional<int> status = server->WaitExit(absl::Seconds(30));  // waitpid's status
//
// Every wait is bounded by its argument. The destructor stops a child still running
// (ChildOptions: SIGKILL by default, or a signal and a grace period before SIGKILL) and reaps
// it, so no test leaves a process or a zombie behind. One thread uses an object, except that
// StatusBytes may run on another thread beside the other calls.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace normgrad::testing {

struct ChildOptions {
  // stderr on a pipe, read with ChildProcess::Stderr(); otherwise inherited (it shows in the
  // test's log).
  bool capture_stderr = false;
  // What the destructor does to a child still running: sends `stop_signal`, and unless that is
  // SIGKILL waits up to `stop_grace` for the child to exit before sending SIGKILL.
  int stop_signal = SIGKILL;
  absl::Duration stop_grace = absl::Seconds(30);
};

// normgrad-server's ready line, "normgrad-server ready grpc=HOST:PORT metrics=HOST:PORT
// backend=NAME device=\"...\" [health=HOST:PORT] [tls=on|mtls]" (metrics=off when disabled;
// server/process/normgrad_server.h). A port is 0 when its field is missing or not HOST:PORT.
struct ReadyLine {
  std::string text;  // the line without its '\n'; "" when none came
  int grpc_port = 0;
  int metrics_port = 0;
  int health_port = 0;
};
ReadyLine ParseReadyLine(absl::string_view line);

// A "KEY: N kB" field of /proc/PID/status (e.g. "VmRSS:") in bytes; 0 when absent.
uint64_t ProcStatusBytes(pid_t pid, absl::string_view key);

class ChildProcess {
 public:
  // Runs argv[0] (a path: no PATH search) with `argv`, in this process's environment. An error
  // when the pipes or the fork fail; a program that cannot be executed exits 127.
  static absl::StatusOr<ChildProcess> Start(std::vector<std::string> argv,
                                            ChildOptions options = {});

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  // The next stdout line without its '\n'; "" if none is complete within `limit` or stdout
  // ended (a partial line stays for the next read).
  std::string ReadLine(absl::Duration limit);
  // ReadLine parsed as normgrad-server's ready line.
  ReadyLine AwaitReady(absl::Duration limit);
  // Everything left on stdout until it ends, or what came within `limit`.
  std::string ReadRest(absl::Duration limit);
  // What the child has written to stderr so far; "" without ChildOptions::capture_stderr.
  std::string Stderr();

  // kill(pid, signal); nothing once the child has been reaped (its pid may be reused).
  void Signal(int signal);
  // waitpid's status once the child has exited (the same status on every later call), nullopt
  // if it is still running after `limit`. Collects what is on its pipes meanwhile, so that a
  // child writing more than a pipe holds is not blocked.
  std::optional<int> WaitExit(absl::Duration limit);

  // A "VmHWM:" / "VmRSS:" figure of /proc/PID/status in bytes, 0 if unreadable.
  uint64_t StatusBytes(absl::string_view key) const;

  pid_t pid() const { return pid_; }

 private:
  explicit ChildProcess(ChildOptions options) : options_(options) {}

  // Waits until stdout has more bytes (appended to out_buffer_), collecting stderr meanwhile;
  // false when stdout has ended or `end` passed.
  bool ReadMore(absl::Time end);
  // Appends what can be read now, without waiting, from both pipes.
  void Collect();
  // Reads what `fd` has now into `buffer`; closes it (fd = -1) at end of file.
  static void ReadAvailable(int& fd, std::string& buffer);
  // Stops (ChildOptions), reaps and closes; leaves *this empty.
  void Stop();

  ChildOptions options_;
  pid_t pid_ = -1;
  int out_ = -1;                    // stdout's read end; -1 once it ended
  int err_ = -1;                    // stderr's read end; -1 without capture or once it ended
  std::optional<int> exit_status_;  // set once reaped
  std::string out_buffer_, err_buffer_;
};

}  // namespace normgrad::testing
