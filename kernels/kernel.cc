#include "kernels/kernel.h"

#include <cstdint>
#include <iterator>

#include "absl/base/casts.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/bounded_quote.h"
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
      absl::StrCat("dtype ", base::BoundedQuote(name), " is not one of f32, bf16, f16"));
}

int DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

namespace {
// In CastingMode's order.
constexpr absl::string_view kCastingModeNames[] = {"llama", "gemma", "none"};
}  // namespace

absl::string_view CastingModeName(CastingMode mode) {
  return kCastingModeNames[static_cast<int>(mode)];
}

absl::StatusOr<CastingMode> ParseCastingMode(absl::string_view name) {
  for (size_t i = 0; i < std::size(kCastingModeNames); ++i) {
    if (name == kCastingModeNames[i]) return static_cast<CastingMode>(i);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "casting mode ", base::BoundedQuote(name), " is not one of llama, gemma, none"));
}

std::string NormVariant::KeySuffix() const {
  std::string key;
  if (gamma_offset != 0.0f) {
    // The bits, so that every offset has one key (and -0.0 is 0).
    absl::StrAppend(&key, "_off", absl::Hex(absl::bit_cast<uint32_t>(gamma_offset)));
  }
  if (!has_gamma) absl::StrAppend(&key, "_nogamma");
  if (casting != CastingMode::kGemma) absl::StrAppend(&key, "_", CastingModeName(casting));
  return key;
}

std::string NormVariant::Describe() const {
  return absl::StrCat("gamma_offset ", gamma_offset, ", ", has_gamma ? "a gamma" : "no gamma",
                      ", casting mode ", CastingModeName(casting));
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
