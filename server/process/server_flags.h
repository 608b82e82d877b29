// The command-line flags of normgrad-server (absl flags, documented by --help) and their
// translation to ServerOptions. Kept out of main.cc so that tests and other binaries can reuse
// the parsing and its error messages.
//
//   absl::ParseCommandLine(argc, argv);
//   absl::StatusOr<ServerOptions> options = ServerOptionsFromFlags();
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/process/server_options.h"

namespace normgrad::server {

// The flags' values, checked as far as that needs neither a device nor a port (CheckServerOptions
// included): INVALID_ARGUMENT naming the flag and its value, on which normgrad-server exits 2.
absl::StatusOr<ServerOptions> ServerOptionsFromFlags();
absl::Duration ShutdownGraceFromFlags();  // valid after ServerOptionsFromFlags() succeeded

// Flags are documented and accepted with dashes (--max-streams) as well as absl's underscores
// (--max_streams): returns argv with the dashes of every flag name (before any '=') turned
// into underscores, and repeated --listen flags joined into one comma-separated --listen.
// Arguments after a bare "--" are left alone.
std::vector<std::string> NormalizeFlagSpelling(int argc, char** argv);

// True for the source files whose flags --help lists (this component's).
bool IsServerFlagsFile(absl::string_view path);

}  // namespace normgrad::server
