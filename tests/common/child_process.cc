#include "tests/common/child_process.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace normgrad::testing {

ReadyLine ParseReadyLine(absl::string_view line) {
  ReadyLine ready;
  ready.text = std::string(line);
  for (absl::string_view field : absl::StrSplit(line, ' ')) {
    int* port = nullptr;
    if (absl::ConsumePrefix(&field, "grpc=")) {
      port = &ready.grpc_port;
    } else if (absl::ConsumePrefix(&field, "metrics=")) {
      port = &ready.metrics_port;
    } else if (absl::ConsumePrefix(&field, "health=")) {
      port = &ready.health_port;
    }
    if (port == nullptr || *port != 0) continue;  // the first of each field counts
    const size_t colon = field.rfind(':');        // HOST may be [::1]
    if (colon == absl::string_view::npos || !absl::SimpleAtoi(field.substr(colon + 1), port)) {
      *port = 0;
    }
  }
  return ready;
}

absl::StatusOr<ChildProcess> ChildProcess::Start(std::vector<std::string> argv,
                                                 ChildOptions options) {
  if (argv.empty()) return absl::InvalidArgumentError("ChildProcess::Start: empty argv");
  // Built before fork(): between fork and exec the child of a multi-threaded process may only
  // make async-signal-safe calls (no allocation).
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  // Close-on-exec, so that no other child inherits these pipes; dup2 clears it on 1 and 2.
  int out[2] = {-1, -1}, err[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe2 (stdout)");
  if (options.capture_stderr && pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    close(out[0]);
    close(out[1]);
    return absl::ErrnoToStatus(e, "pipe2 (stderr)");
  }
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    if (err[1] >= 0) dup2(err[1], STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  const int fork_errno = errno;
  close(out[1]);
  if (err[1] >= 0) close(err[1]);
  if (pid < 0) {
    close(out[0]);
    if (err[0] >= 0) close(err[0]);
    return absl::ErrnoToStatus(fork_errno, absl::StrCat("fork for ", argv[0]));
  }
  ChildProcess child(options);
  child.pid_ = pid;
  child.out_ = out[0];
  child.err_ = err[0];
  return child;
}

// Takes `other`'s child through the assignment (Stop on this empty object does nothing).
ChildProcess::ChildProcess(ChildProcess&& other) noexcept : options_(other.options_) {
  *this = std::move(other);
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    Stop();
    options_ = other.options_;
    pid_ = std::exchange(other.pid_, -1);
    out_ = std::exchange(other.out_, -1);
    err_ = std::exchange(other.err_, -1);
    exit_status_ = std::exchange(other.exit_status_, std::nullopt);
    out_buffer_ = std::move(other.out_buffer_);
    err_buffer_ = std::move(other.err_buffer_);
  }
  return *this;
}

ChildProcess::~ChildProcess() { Stop(); }

void ChildProcess::Stop() {
  if (pid_ > 0 && !exit_status_) {
    kill(pid_, options_.stop_signal);
    if (options_.stop_signal != SIGKILL) (void)WaitExit(options_.stop_grace);
    if (!exit_status_) {
      kill(pid_, SIGKILL);
      int status = 0;
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }
  if (out_ >= 0) close(out_);
  if (err_ >= 0) close(err_);
  pid_ = out_ = err_ = -1;
  exit_status_.reset();
  out_buffer_.clear();
  err_buffer_.clear();
}

void ChildProcess::ReadAvailable(int& fd, std::string& buffer) {
  // Bounded (256 KiB a call), so that a child writing without pause cannot hold the caller.
  for (int reads = 0; fd >= 0 && reads < 64; ++reads) {
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, 0);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return;
    char chunk[4096];
    const ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // end of file (or a broken pipe)
      close(fd);
      fd = -1;
      return;
    }
    buffer.append(chunk, static_cast<size_t>(n));
  }
}

void ChildProcess::Collect() {
  ReadAvailable(out_, out_buffer_);
  ReadAvailable(err_, err_buffer_);
}

bool ChildProcess::ReadMore(absl::Time end) {
  while (out_ >= 0) {
    const int64_t ms = absl::ToInt64Milliseconds(end - absl::Now());
    if (ms <= 0) return false;
    pollfd fds[2] = {{out_, POLLIN, 0}, {err_, POLLIN, 0}};  // poll skips a negative fd
    const int ready = poll(fds, 2, static_cast<int>(std::min<int64_t>(ms, 1000)));
    if (ready < 0 && errno != EINTR) return false;
    if (ready <= 0) continue;
    if (fds[1].revents != 0) ReadAvailable(err_, err_buffer_);
    if (fds[0].revents != 0) {
      const size_t before = out_buffer_.size();
      ReadAvailable(out_, out_buffer_);
      if (out_buffer_.size() > before) return true;
    }
  }
  return false;
}

std::string ChildProcess::ReadLine(absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (true) {
    const size_t newline = out_buffer_.find('\n');
    if (newline != std::string::npos) {
      std::string line = out_buffer_.substr(0, newline);
      out_buffer_.erase(0, newline + 1);
      return line;
    }
    if (!ReadMore(end)) return "";
  }
}

ReadyLine ChildProcess::AwaitReady(absl::Duration limit) { return ParseReadyLine(ReadLine(limit)); }

std::string ChildProcess::ReadRest(absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (ReadMore(end)) {
  }
  return std::exchange(out_buffer_, std::string());
}

std::string ChildProcess::Stderr() {
  ReadAvailable(err_, err_buffer_);
  return err_buffer_;
}

void ChildProcess::Signal(int signal) {
  if (pid_ > 0 && !exit_status_) kill(pid_, signal);
}

std::optional<int> ChildProcess::WaitExit(absl::Duration limit) {
  if (exit_status_ || pid_ <= 0) return exit_status_;
  const absl::Time end = absl::Now() + limit;
  while (true) {
    int status = 0;
    const pid_t reaped = waitpid(pid_, &status, WNOHANG);
    if (reaped == pid_) {
      exit_status_ = status;
      Collect();  // what it wrote last
      return exit_status_;
    }
    if (reaped < 0 && errno != EINTR) return std::nullopt;  // not our child (ECHILD)
    Collect();
    if (absl::Now() >= end) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

uint64_t ChildProcess::StatusBytes(absl::string_view key) const {
  return ProcStatusBytes(pid_, key);
}

uint64_t ProcStatusBytes(pid_t pid, absl::string_view key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, key)) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    uint64_t kib = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) return kib * 1024;
  }
  return 0;
}

}  // namespace normgrad::testing
