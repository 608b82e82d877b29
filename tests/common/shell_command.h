// A shell command line run to its end, for the tests that check what a program printed and how
// it exited. Header-only, standard C++ and POSIX only.
//
//   const CommandOutput o = RunShellCommand("ptxas -arch=sm_90 -v k.ptx -o k.cubin 2>&1");
//   EXPECT_EQ(o.exit_code, 0) << o.output;
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace normgrad::testing {

struct CommandOutput {
  int exit_code = -1;  // -1 when it could not be started or a signal ended it
  std::string output;  // its stdout; stderr too when the command says 2>&1
};

// Runs `command` with /bin/sh (popen) and waits for it to end.
inline CommandOutput RunShellCommand(const std::string& command) {
  CommandOutput out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.output.append(buffer, n);
  const int status = pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

}  // namespace normgrad::testing
