// A small command-line parser for subcommand tools: "--name=value", "--name value", "-o value",
// boolean "--name", and positional words. Re-entrant (no globals), so tests run tools in-process.
//
//   FlagSpec spec = {{"target", true}, {"json", false}};
//   absl::StatusOr<ParsedArgs> args = ParseArgs({"info", "--target=h:1"}, spec);
//   args->Get("target", "localhost:50051");
#ifndef NORMGRAD_CLIENT_TOOLS_FLAG_PARSER_H_
#define NORMGRAD_CLIENT_TOOLS_FLAG_PARSER_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::tools {

// Flag name (without dashes) -> whether it takes a value.
using FlagSpec = std::map<std::string, bool>;

struct ParsedArgs {
  std::map<std::string, std::string> values;  // booleans hold "true"
  std::vector<std::string> positional;
  std::vector<std::string> order;  // flag names in the order given

  bool Has(const std::string& name) const { return values.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
};

// INVALID_ARGUMENT "unknown flag --x", "flag --x needs a value", "flag --x takes no value".
// "--" ends flags. A single-dash "-o" is the flag named "o".
absl::StatusOr<ParsedArgs> ParseArgs(const std::vector<std::string>& args, const FlagSpec& spec);

}  // namespace normgrad::tools

#endif  // NORMGRAD_CLIENT_TOOLS_FLAG_PARSER_H_
