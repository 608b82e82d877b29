// The `normgrad` command-line tool as a function, so tests run every path in-process.
//
//   normgrad [global flags] <backward|emit-ptx|info|health> [flags]
//
// Exit status: 0 success; 1 the server (or the connection) returned an error, printed as
// "error: <CODE>: <message>"; 2 bad usage or a bad input file, printed as one line; 3 health
// check answered but not SERVING.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace normgrad::tools {

struct CliEnvironment {
  std::string normgrad_target;  // $NORMGRAD_TARGET, empty when unset
  std::string ptx_cache_dir;    // $NORMGRAD_PTX_CACHE (emit-ptx's --cache-dir), empty when unset
  bool stderr_is_terminal = false;
};

inline constexpr int kExitOk = 0;
inline constexpr int kExitServerError = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitNotServing = 3;

// args excludes the program name.
int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err);

}  // namespace normgrad::tools
