#include "kernels/kernel_config.h"

#include <cstdint>
#include <iterator>

#include "absl/base/casts.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/bounded_quote.h"

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


}  // namespace normgrad::kernels
