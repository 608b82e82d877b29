// normgrad-server: flags -> NormGradServer; prints one ready line; drains on SIGTERM/SIGINT;
// exits 3 shortly after its GPU failed (docs/operations.md, "When the GPU fails").
#include <pthread.h>
#include <signal.h>

#include <grpc/support/log.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/process/normgrad_server.h"
#include "server/process/server_flags.h"

namespace {

// gRPC's own log lines are held back until the server is up, so that a start-up failure is
// the one line normgrad-server prints; afterwards its errors go to stderr as usual.
std::atomic<bool> started{false};

// The exit code after a device failure (0: drained, 1: start-up failure, 2: bad flag value), and
// how long the process lingers first: the calls failed UNAVAILABLE and NOT_SERVING reach their
// clients and probes. Bounded: a worker blocked in the driver can never be joined, so the
// process ends with _Exit, not by tearing the server down.
constexpr int kExitDeviceFailed = 3;
constexpr absl::Duration kDeviceFailureGrace = absl::Seconds(2);

void ExitAfterDeviceFailure(const absl::Status& reason) {
  std::fprintf(stderr, "normgrad-server: %s; NOT_SERVING, exiting with code %d in %s\n",
               reason.ToString().c_str(), kExitDeviceFailed,
               absl::FormatDuration(kDeviceFailureGrace).c_str());
  std::thread([] {
    absl::SleepFor(kDeviceFailureGrace);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(kExitDeviceFailed);
  }).detach();
}

void GrpcLog(gpr_log_func_args* args) {
  if (!started.load() || args->severity < GPR_LOG_SEVERITY_ERROR) return;
  std::fprintf(stderr, "grpc: %s:%d: %s\n", args->file, args->line, args->message);
}

}  // namespace

int main(int argc, char** argv) {
  gpr_set_log_function(&GrpcLog);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = &normgrad::server::IsServerFlagsFile;
  usage.contains_helpshort_flags = &normgrad::server::IsServerFlagsFile;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "RMSNorm-backward gradients and PTX over gRPC.\n"
      "  normgrad-server [--listen=0.0.0.0:50051] [--backend=auto|cuda|cpu] ...\n"
      "Flag names take dashes or underscores (--max-streams = --max_streams).");
  std::vector<std::string> args = normgrad::server::NormalizeFlagSpelling(argc, argv);
  std::vector<char*> arg_pointers;
  for (std::string& a : args) arg_pointers.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(arg_pointers.size()), arg_pointers.data());

  absl::StatusOr<normgrad::server::ServerOptions> options =
      normgrad::server::ServerOptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "normgrad-server: %s\n", options.status().ToString().c_str());
    return 2;
  }
  // Every thread started from here on inherits the blocked signals; main waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  options->on_device_failure = &ExitAfterDeviceFailure;
  auto server = normgrad::server::NormGradServer::Start(*options);
  if (!server.ok()) {
    std::fprintf(stderr, "normgrad-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  started.store(true);
  std::printf("%s\n", (*server)->ReadyLine().c_str());
  std::fflush(stdout);
  if (absl::Status health = (*server)->device_health(); !health.ok()) {
    std::fprintf(stderr, "normgrad-server: NOT_SERVING: %s\n", health.ToString().c_str());
  }

  int signal = 0;
  sigwait(&signals, &signal);
  const absl::Duration grace = normgrad::server::ShutdownGraceFromFlags();
  std::fprintf(stderr, "normgrad-server: %s received; draining for up to %s\n",
               signal == SIGTERM ? "SIGTERM" : "SIGINT", absl::FormatDuration(grace).c_str());
  (*server)->Shutdown(grace);
  std::fprintf(stderr, "normgrad-server: stopped\n");
  return 0;
}
