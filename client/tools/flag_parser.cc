#include "client/tools/flag_parser.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace normgrad::tools {

std::string ParsedArgs::Get(const std::string& name, const std::string& fallback) const {
  auto it = values.find(name);
  return it == values.end() ? fallback : it->second;
}

absl::StatusOr<ParsedArgs> ParseArgs(const std::vector<std::string>& args, const FlagSpec& spec) {
  ParsedArgs parsed;
  bool flags_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (flags_done || arg.size() < 2 || arg[0] != '-') {
      parsed.positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    arg.remove_prefix(absl::StartsWith(arg, "--") ? 2 : 1);
    std::string name(arg);
    std::string value;
    bool has_inline_value = false;
    if (const size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
      has_inline_value = true;
    }
    const auto it = spec.find(name);
    if (it == spec.end()) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (it->second) {
      if (!has_inline_value) {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
        }
        value = args[++i];
      }
    } else {
      if (has_inline_value && value != "true" && value != "false") {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " takes no value"));
      }
      if (!has_inline_value) value = "true";
      if (value == "false") {
        parsed.values.erase(name);
        continue;
      }
    }
    parsed.values[name] = value;
    parsed.order.push_back(name);
  }
  return parsed;
}

}  // namespace normgrad::tools
