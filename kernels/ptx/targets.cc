#include "kernels/ptx/targets.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bounded_quote.h"

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

// PTX ISA version -> the CUDA release that introduced it (the PTX ISA manual's "PTX ISA
// release history"). 8.6 came with CUDA 12.7: 12.6 still wrote 8.5.
struct IsaRelease {
  PtxVersion ptx;
  const char* cuda;
};
constexpr IsaRelease kIsaReleases[] = {
    {{6, 0}, "9.0"},   {{6, 1}, "9.1"},   {{6, 2}, "9.2"},   {{6, 3}, "10.0"}, {{6, 4}, "10.1"},
    {{6, 5}, "10.2"},  {{7, 0}, "11.0"},  {{7, 1}, "11.1"},  {{7, 2}, "11.2"}, {{7, 3}, "11.3"},
    {{7, 4}, "11.4"},  {{7, 5}, "11.5"},  {{7, 6}, "11.6"},  {{7, 7}, "11.7"}, {{7, 8}, "11.8"},
    {{8, 0}, "12.0"},  {{8, 1}, "12.1"},  {{8, 2}, "12.2"},  {{8, 3}, "12.3"}, {{8, 4}, "12.4"},
    {{8, 5}, "12.5"},  {{8, 6}, "12.7"},  {{8, 7}, "12.8"},  {{8, 8}, "12.9"}, {{9, 0}, "13.0"},
};

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
  // Within the range but never released (8.9, 7.9, ...): ptxas refuses such a .version, and
  // no driver is known to load it.
  if (absl::Status released = MinCudaDriverForPtx(*requested).status(); !released.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ptx_version ", requested->ToString(),
                     " is not a released PTX ISA version (6.0-6.5, 7.0-7.8, 8.0-8.8, 9.0)"));
  }
  return *requested;
}

absl::StatusOr<std::string> MinCudaDriverForPtx(PtxVersion version) {
  for (const IsaRelease& r : kIsaReleases) {
    if (r.ptx == version) return std::string(r.cuda);
  }
  return absl::InvalidArgumentError(absl::StrCat("ptx_version ", version.ToString(),
                                                 " has no known CUDA release (known: 6.0 ... ",
                                                 kMaxPtxVersion.ToString(), ")"));
}

std::string PtxVersion::ToString() const { return absl::StrCat(major, ".", minor); }

absl::StatusOr<PtxVersion> ParsePtxVersion(absl::string_view text) {
  // MAJOR.MINOR with a one- or two-digit major and a one-digit minor, as PTX ISA versions are.
  const size_t dot = text.find('.');
  bool ok = dot != absl::string_view::npos && (dot == 1 || dot == 2) && text.size() == dot + 2;
  for (size_t i = 0; ok && i < text.size(); ++i) {
    ok = i == dot || (text[i] >= '0' && text[i] <= '9');
  }
  int major = 0;
  int minor = 0;
  ok = ok && absl::SimpleAtoi(text.substr(0, dot), &major) &&
       absl::SimpleAtoi(text.substr(dot + 1), &minor) && major >= 1;
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("ptx_version ", base::BoundedQuote(text), " is not MAJOR.MINOR (e.g. \"8.0\")"));
  }
  return PtxVersion{major, minor};
}

absl::StatusOr<int> ParseTarget(absl::string_view text) {
  int sm = 0;
  bool ok = text.size() >= 4 && text.size() <= 6 && text.substr(0, 3) == "sm_";
  for (size_t i = 3; ok && i < text.size(); ++i) ok = text[i] >= '0' && text[i] <= '9';
  if (!ok || !absl::SimpleAtoi(text.substr(3), &sm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target ", base::BoundedQuote(text), " is not sm_NN (e.g. \"sm_90\")"));
  }
  if (!MinPtxVersionForTarget(sm).ok()) {
    return MinPtxVersionForTarget(sm).status();
  }
  return sm;
}

}  // namespace normgrad::kernels
