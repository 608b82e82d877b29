// normgrad: command-line client of normgrad-server (see client/tools/cli.h).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/tools/cli.h"

int main(int argc, char** argv) {
  normgrad::tools::CliEnvironment env;
  if (const char* target = std::getenv("NORMGRAD_TARGET")) env.normgrad_target = target;
  env.stderr_is_terminal = isatty(STDERR_FILENO) == 1;
  return normgrad::tools::RunCli(std::vector<std::string>(argv + 1, argv + argc), env, std::cout,
                                 std::cerr);
}
