// normgrad-load's command line: flags -> LoadConfig and output choices, and the whole program
// as a function (tests run it in-process).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/tools/load_runner.h"

namespace normgrad::tools {

struct LoadOutput {
  std::string format = "summary";  // summary | json | csv
  std::string output_path;         // -o: the report goes here instead of stdout
  std::string html_path;           // --html: also write the HTML report here
};

struct LoadCommand {
  LoadConfig config;
  LoadOutput output;
  std::string target_text;  // for the report
  std::string shapes_text;
  bool help = false;
};

// "64x4096,128x896" -> shapes; INVALID_ARGUMENT naming the bad element.
absl::StatusOr<std::vector<Shape>> ParseShapes(absl::string_view text);

// Flags (see docs/load.md). `env_target` is $NORMGRAD_TARGET (empty when unset).
absl::StatusOr<LoadCommand> ParseLoadCommand(const std::vector<std::string>& args,
                                             const std::string& env_target);

extern const char kLoadUsage[];

// The program: 0 when the run completed (whatever the error count), 2 for bad flags, 1 when the
// report could not be written. `progress_terminal`: draw a live progress line on `err`.
int RunLoad(const std::vector<std::string>& args, const std::string& env_target,
            bool progress_terminal, std::ostream& out, std::ostream& err);

}  // namespace normgrad::tools
