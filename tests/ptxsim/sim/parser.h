// PTX text -> decoded Module. Accepts the conventional PTX subset normgrad's builder emits
// (docs/ptxsim.md lists it) and refuses everything else with the line and the reason.
//
//   absl::StatusOr<Module> module = ParsePtx(text);
//   if (!module.ok()) std::cerr << module.status().message();  // "line 12: unsupported ..."
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tests/ptxsim/sim/module.h"

namespace normgrad::ptxsim {

// INVALID_ARGUMENT "line N: <reason>" for text outside the supported subset, undeclared
// registers, unknown labels, operand counts or kinds that do not fit the instruction.
absl::StatusOr<Module> ParsePtx(absl::string_view text);

}  // namespace normgrad::ptxsim
