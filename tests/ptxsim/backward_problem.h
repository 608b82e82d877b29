// One RMSNorm-backward problem as the kernel tests and the GPU benchmark use it: deterministic
// inputs, their storage in the element type (f32 as is, f16/bf16 rounded to nearest even), the
// reference answer, and the tolerances the kernels are held to.
//
//   const BackwardProblem p = MakeBackwardProblem(DType::kBF16, /*rows=*/9, /*hidden=*/4096);
//   std::vector<uint8_t> x = EncodeElements(p.x, p.dtype);    // what goes to the device
//   ... run, read dx back ...
//   std::vector<float> got = DecodeElements(dx_bytes, p.dtype);
//   const BackwardReference want = ReferenceFor(p, /*with_rms=*/false);
//   absl::Status s = CheckClose(got, want.dx, DxTolerance(p.dtype), "dx");
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"

namespace normgrad::kernel_testing {

// n values in [lo, hi) from a fixed linear congruential sequence per seed.
std::vector<float> Fill(size_t n, uint32_t seed, float lo, float hi);

// f32 <-> the 16-bit element types (round to nearest even; exact back).
uint16_t ToBits16(float f, kernels::DType dtype);
float FromBits16(uint16_t bits, kernels::DType dtype);
// f rounded to what the element type can hold (f32: unchanged).
float RoundToElement(float f, kernels::DType dtype);

// Values as stored in memory in `dtype`, and back.
std::vector<uint8_t> EncodeElements(absl::Span<const float> values, kernels::DType dtype);
std::vector<float> DecodeElements(absl::Span<const uint8_t> bytes, kernels::DType dtype);

// dx against the unrounded reference, relative to max(1, |ref|): half an ulp of the element
// type plus the f32 error (1e-5 f32, 5e-4 f16, 4e-3 bf16).
double DxTolerance(kernels::DType dtype);
// f32 dgamma (a sum over `rows` rows in f32) against the double reference, relative to
// max(1, |ref|): 1e-5 up to 64 rows, growing as sqrt(rows) beyond (the rounding error of a sum of
// n terms of either sign grows about as sqrt(n)).
double DgammaTolerance(uint32_t rows);

struct BackwardProblem {
  kernels::DType dtype = kernels::DType::kF32;
  uint32_t rows = 0;
  uint32_t hidden = 0;
  float eps = 1e-5f;
  // Already rounded to the element type (what a kernel reads); rms is f32 from x in double.
  std::vector<float> x, dy, gamma, rms;
};

// x, dy in [-1, 1), gamma in [0.5, 1.5), seeded by the hidden size.
BackwardProblem MakeBackwardProblem(kernels::DType dtype, uint32_t rows, uint32_t hidden,
                                    float eps = 1e-5f);

struct BackwardReference {
  std::vector<float> dx, dgamma;
};
// kernels::ReferenceBackward of the problem, with its rms given or recomputed.
BackwardReference ReferenceFor(const BackwardProblem& p, bool with_rms);

// The reference of a variant (docs/kernels.md, "Variants") in double, with the element roundings
// R() where the casting mode puts them: s = offset + gamma (one f32 add), or 1 without gamma;
// m = dy * s (R of the f32 product for llama and none); dx = r * (m - c * x) with
// c = r^2 / H * sum(m * x), unrounded; grad_gamma += dy * n with n = x * r (R(f32 x * r) for
// llama; empty without gamma). For llama, give the rms: n then uses the kernel's own f32 1/rms
// (rcp.rn of the given rms), so R() rounds the same f32 value in both.
BackwardReference VariantReferenceFor(const BackwardProblem& p, const kernels::NormVariant& v,
                                      bool with_rms);

// The largest |got - want| / max(1, |want|).
double MaxRelativeError(absl::Span<const float> got, absl::Span<const float> want);

// OK when every |got - want| <= tolerance * max(1, |want|); else INTERNAL naming the first few
// elements out of bounds (`what`[i] = got, expected want, bound).
absl::Status CheckClose(absl::Span<const float> got, absl::Span<const float> want, double tolerance,
                        const char* what);

}  // namespace normgrad::kernel_testing
