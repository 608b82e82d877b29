#include "kernels/kernel.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/rms_norm_backward.h"
#include "kernels/rms_norm_backward_row_resident.h"
#include "kernels/targets.h"

namespace normgrad::kernels {

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not one of f32, bf16, f16"));
}

int DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

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
        absl::StrCat("ptx_version \"", text, "\" is not MAJOR.MINOR (e.g. \"8.0\")"));
  }
  return PtxVersion{major, minor};
}

absl::StatusOr<int> ParseTarget(absl::string_view text) {
  int sm = 0;
  bool ok = text.size() >= 4 && text.size() <= 6 && text.substr(0, 3) == "sm_";
  for (size_t i = 3; ok && i < text.size(); ++i) ok = text[i] >= '0' && text[i] <= '9';
  if (!ok || !absl::SimpleAtoi(text.substr(3), &sm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target \"", text, "\" is not sm_NN (e.g. \"sm_90\")"));
  }
  if (!MinPtxVersionForTarget(sm).ok()) {
    return MinPtxVersionForTarget(sm).status();
  }
  return sm;
}

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

const Kernel* FindKernel(absl::string_view entry_name) {
  for (const Kernel* k : AllKernels()) {
    if (k->EntryName() == entry_name) return k;
  }
  return nullptr;
}

std::vector<const Kernel*> AllKernels() {
  static const RmsNormBackwardKernel* const kSmall = new RmsNormBackwardKernel();
  static const BatchedRmsNormBackwardKernel* const kBatched = new BatchedRmsNormBackwardKernel();
  static const RowResidentRmsNormBackwardKernel* const kRowResident =
      new RowResidentRmsNormBackwardKernel();
  static const RmsNormBackwardDgammaReduceKernel* const kDgammaReduce =
      new RmsNormBackwardDgammaReduceKernel();
  return {kSmall, kBatched, kRowResident, kDgammaReduce};
}

}  // namespace normgrad::kernels
