// The `normgrad` command-line tool as a function, so tests run every path in-process.
//
//   normgrad [global flags] <backward|emit-ptx|info|health> [flags]
//
// Exit status: 0 success; 1 the server (or the connection) returned an error, printed as
// "error: <CODE>: <message>"; 2 bad usage or a bad input file, printed as one line; 3 health
// check answered but not SERVING.
#ifndef NORMGRAD_CLIENT_TOOLS_CLI_H_
#define NORMGRAD_CLIENT_TOOLS_CLI_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/tools/flag_parser.h"
#include "normgrad/client.h"

namespace normgrad::tools {

struct CliEnvironment {
  std::string normgrad_target;  // $NORMGRAD_TARGET, empty when unset
  bool stderr_is_terminal = false;
};

inline constexpr int kExitOk = 0;
inline constexpr int kExitServerError = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitNotServing = 3;

// Flags every tool shares to build a ClientOptions (the server address flag is separate):
// --token-file FILE (contents, trimmed) or --token T, else $NORMGRAD_TOKEN; --deadline (an
// absl duration: "30s", "500ms"), --max-attempts, --chunk-bytes, --tls, --tls-ca FILE,
// --tls-cert FILE, --tls-key FILE, --tls-server-name NAME.
void AddClientFlags(FlagSpec& spec);
// INVALID_ARGUMENT naming the flag for a bad value; NOT_FOUND for an unreadable TLS file.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags(const ParsedArgs& args, std::string target);

// args excludes the program name.
int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err);

}  // namespace normgrad::tools

#endif  // NORMGRAD_CLIENT_TOOLS_CLI_H_
