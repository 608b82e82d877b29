// GPU targets and PTX ISA versions normgrad emits for, as CUDA 13's ptxas accepts them.
//
//   absl::StatusOr<PtxVersion> v = ResolvePtxVersion(90, std::nullopt, PtxVersion{6, 0});  // 7.8
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::kernels {

// PTX ISA version, e.g. {8, 0} for ".version 8.0".
struct PtxVersion {
  int major = 0;
  int minor = 0;
  friend bool operator==(PtxVersion a, PtxVersion b) {
    return a.major == b.major && a.minor == b.minor;
  }
  friend bool operator<(PtxVersion a, PtxVersion b) {
    return a.major != b.major ? a.major < b.major : a.minor < b.minor;
  }
  std::string ToString() const;  // "8.0"
};
absl::StatusOr<PtxVersion> ParsePtxVersion(absl::string_view text);  // "8.0"
absl::StatusOr<int> ParseTarget(absl::string_view text);             // "sm_90" -> 90

// Newest `.version` this generator writes (CUDA 13.0's ptxas: "current version is '9.0'").
inline constexpr PtxVersion kMaxPtxVersion{9, 0};

// sm_75 ... sm_121, ascending. sm_70 and older are refused: CUDA 13's ptxas cannot assemble them.
std::vector<int> SupportedTargets();

// The first PTX ISA version that knows `.target sm_<target_sm>`; INVALID_ARGUMENT naming the
// supported targets for any other value.
absl::StatusOr<PtxVersion> MinPtxVersionForTarget(int target_sm);

// The `.version` to emit: `requested` if given and high enough, else the lowest version that
// supports both the target and `instructions_min`. INVALID_ARGUMENT says which requirement a too
// low (or too new) request misses.
absl::StatusOr<PtxVersion> ResolvePtxVersion(int target_sm, std::optional<PtxVersion> requested,
                                             PtxVersion instructions_min);

// The lowest CUDA release ("12.0") whose driver loads (JIT-compiles) PTX of ISA `version`, from
// the PTX ISA manual's release history (7.0 -> 11.0, 7.8 -> 11.8, 8.0 -> 12.0, 8.5 -> 12.5,
// 8.6 -> 12.7, 8.7 -> 12.8, 8.8 -> 12.9, 9.0 -> 13.0). INVALID_ARGUMENT for a version outside
// 6.0 ... kMaxPtxVersion, which this generator never writes.
absl::StatusOr<std::string> MinCudaDriverForPtx(PtxVersion version);

}  // namespace normgrad::kernels
