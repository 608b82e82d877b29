// normgrad-server as a child process over the emulated CUDA driver (tests/ptxsim), for the tests
// of the server's GPU paths on a machine without one. For test targets that define
// NORMGRAD_SERVER_BINARY and NORMGRAD_EMULATED_CUDA (tests/server/process/CMakeLists.txt).
//
//   absl::StatusOr<ChildProcess> server = StartOnEmulatedDriver({}, {"--backend=cuda"});
//   const ReadyLine ready = server->AwaitReady(absl::Seconds(120));
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tests/common/child_process.h"

namespace normgrad::testing {

// The server with NORMGRAD_CUDA_DRIVER naming the emulated driver and `environment` ("NAME=VALUE")
// in its environment only, gRPC and metrics on loopback port 0, 2 workers, then `flags`; stderr
// captured (ChildProcess::Stderr).
inline absl::StatusOr<ChildProcess> StartOnEmulatedDriver(std::vector<std::string> environment,
                                                          std::vector<std::string> flags) {
  std::vector<std::string> args = {"/usr/bin/env",
                                   absl::StrCat("NORMGRAD_CUDA_DRIVER=", NORMGRAD_EMULATED_CUDA)};
  args.insert(args.end(), environment.begin(), environment.end());
  args.insert(args.end(), {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                           "--metrics-listen=127.0.0.1:0", "--worker-threads=2"});
  args.insert(args.end(), flags.begin(), flags.end());
  ChildOptions options;
  options.capture_stderr = true;
  return ChildProcess::Start(std::move(args), options);
}

}  // namespace normgrad::testing
