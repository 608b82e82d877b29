// normgrad-load: load generator for normgrad-server (see client/tools/load_flags.h, docs/load.md).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/tools/load_flags.h"

int main(int argc, char** argv) {
  const char* target = std::getenv("NORMGRAD_TARGET");
  return normgrad::tools::RunLoad(std::vector<std::string>(argv + 1, argv + argc),
                                  target == nullptr ? "" : target, isatty(STDERR_FILENO) == 1,
                                  std::cout, std::cerr);
}
