// Fuzzes the PTX interpreter's text parser (tests/ptxsim/parser.*) with arbitrary text.
// Any outcome but a Module or INVALID_ARGUMENT with a message is a failure.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "tests/ptxsim/sim/parser.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<normgrad::ptxsim::Module> module = normgrad::ptxsim::ParsePtx(text);
  if (!module.ok() && (module.status().code() != absl::StatusCode::kInvalidArgument ||
                       module.status().message().empty())) {
    std::abort();
  }
  return 0;
}
