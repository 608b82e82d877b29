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
  if (const char* cache = std::getenv("NORMGRAD_PTX_CACHE")) env.ptx_cache_dir = cache;
  env.stderr_is_terminal = isatty(STDERR_FILENO) == 1;
  return normgrad::tools::RunCli(std::vector<std::string>(argv + 1, argv + argc), env, std::cout,
                                 std::cerr);
}
