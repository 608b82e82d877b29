#include "kernels/targets.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace normgrad::kernels {

namespace {

struct TargetVersion {
  int sm;
  PtxVersion first;
};

// First PTX ISA version per target, each checked against CUDA 13.0's ptxas (a version one step
// lower is refused). sm_88 is left out: ptxas's acceptance there does not match the ISA manual.
constexpr TargetVersion kTargets[] = {
    {75, {6, 3}},  {80, {7, 0}},  {86, {7, 1}},  {87, {7, 4}},  {89, {7, 8}},  {90, {7, 8}},
    {100, {8, 6}}, {103, {8, 8}}, {110, {9, 0}}, {120, {8, 7}}, {121, {8, 8}},
};

std::string TargetList() {
  std::vector<std::string> names;
  for (const TargetVersion& t : kTargets) names.push_back(absl::StrCat("sm_", t.sm));
  return absl::StrJoin(names, ", ");
}

}  // namespace

std::vector<int> SupportedTargets() {
  std::vector<int> out;
  for (const TargetVersion& t : kTargets) out.push_back(t.sm);
  return out;
}

absl::StatusOr<PtxVersion> MinPtxVersionForTarget(int target_sm) {
  for (const TargetVersion& t : kTargets) {
    if (t.sm == target_sm) return t.first;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "target sm_", target_sm, " is not supported; supported targets: ", TargetList()));
}

absl::StatusOr<PtxVersion> ResolvePtxVersion(int target_sm, std::optional<PtxVersion> requested,
                                             PtxVersion instructions_min) {
  absl::StatusOr<PtxVersion> target_min = MinPtxVersionForTarget(target_sm);
  if (!target_min.ok()) return target_min.status();
  const PtxVersion need = std::max(*target_min, instructions_min);
  if (!requested.has_value()) return need;
  if (kMaxPtxVersion < *requested) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ptx_version ", requested->ToString(), " is newer than ", kMaxPtxVersion.ToString(),
        ", the newest this generator (and CUDA 13's ptxas) "
        "supports"));
  }
  if (*requested < *target_min) {
    return absl::InvalidArgumentError(
        absl::StrCat("ptx_version ", requested->ToString(), " is below ", target_min->ToString(),
                     ", the lowest PTX ISA version that supports target sm_", target_sm));
  }
  if (*requested < instructions_min) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ptx_version ", requested->ToString(), " is below ", instructions_min.ToString(),
        ", the lowest PTX ISA version that has the kernel's instructions (shfl.sync)"));
  }
  return *requested;
}

}  // namespace normgrad::kernels
