// What a kernel is emitted and launched for, shared by every normgrad kernel: the element types,
// the casting modes and variants, the configuration (KernelConfig: what ConfigKey() bakes into
// the PTX, plus the device's SM count), the launch geometry and the emitted module. The kernel
// interface itself, emission and launch: kernels/backward_kernel.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/ptx/targets.h"

namespace normgrad::kernels {

// Element type of x, dy, gamma and the outputs. Accumulation is always fp32 (or wider).
enum class DType { kF32, kBF16, kF16 };
absl::string_view DTypeName(DType dtype);  // "f32", "bf16", "f16"
absl::StatusOr<DType> ParseDType(absl::string_view name);
int DTypeBytes(DType dtype);

// Where the forward pass rounds to the element type (bf16, f16; for f32 every mode is the same
// math): Liger-Kernel's casting modes, docs/kernels.md "Variants".
//   kLlama: m = round(dy * scale), grad_gamma adds dy * round(x / rms)
//   kGemma: all float32 (no rounding before dx)
//   kNone:  m = round(dy * scale), grad_gamma adds dy * x / rms in float32
enum class CastingMode { kLlama, kGemma, kNone };
absl::string_view CastingModeName(CastingMode mode);  // "llama", "gemma", "none"
absl::StatusOr<CastingMode> ParseCastingMode(absl::string_view name);

// Which RMSNorm the backward is of: scale = gamma_offset + gamma (float32), or 1 without gamma
// (then no grad_gamma), and the casting mode. The default is the plain RMSNorm with a weight,
// all in float32.
struct NormVariant {
  float gamma_offset = 0.0f;
  bool has_gamma = true;
  CastingMode casting = CastingMode::kGemma;
  bool is_default() const {
    return gamma_offset == 0.0f && has_gamma && casting == CastingMode::kGemma;
  }
  // An offset as a variant holds it: -0 is 0 (the same scale, so one ConfigKey() and one PTX).
  static float CanonicalOffset(float offset) { return offset == 0.0f ? 0.0f : offset; }
  // "" for the default; else e.g. "_off1_llama", "_nogamma" (for ConfigKey()).
  std::string KeySuffix() const;
  // For messages: "gamma_offset 1, a gamma, casting mode llama".
  std::string Describe() const;
};

struct KernelConfig {
  uint32_t hidden_dim = 0;
  DType dtype = DType::kF32;
  int target_sm = 75;                     // sm_75 is the lowest CUDA 13's ptxas accepts
  std::optional<PtxVersion> ptx_version;  // empty: lowest that supports target + instructions
  // Streaming multiprocessors of the device the launch is for (0: unknown). Only Geometry() of
  // persistent-grid kernels reads it (rms_norm_backward_row_resident sizes its grid from it); it
  // never changes the emitted PTX, so it is NOT part of ConfigKey().
  uint32_t sm_count = 0;
  // Baked into the PTX (part of ConfigKey() when not the default).
  NormVariant variant;
};

struct LaunchGeometry {
  uint32_t grid[3] = {1, 1, 1};
  uint32_t block[3] = {1, 1, 1};
  uint32_t shared_bytes = 0;
};
// Largest grid.x a launch may have (any CUDA device of sm_30 or newer).
inline constexpr uint32_t kMaxGridX = 0x7fffffffu;

// Parameter of a kernel entry, in declaration order (the order cuLaunchKernel expects).
struct KernelParam {
  std::string name;
  std::string ptx_type;  // "u64", "u32", "f32"
};

struct EmittedPtx {
  std::string text;   // the whole module, ending in a newline
  std::string entry;  // .entry name
  std::vector<KernelParam> params;
  PtxVersion version;      // the .version the text declares
  int target_sm = 0;       // the .target the text declares
  std::string config_key;  // == BackwardKernel::ConfigKey(config)
};




}  // namespace normgrad::kernels
