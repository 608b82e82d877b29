// RMSNorm backward over rows held in host memory (Google Highway, dynamic dispatch to the best
// SIMD target the machine supports). The CPU backend runs every chunk through it, the CUDA
// backend's host rows included. Beside it in this room: half_rows.h (bf16/f16 rows in f32
// arithmetic), element_conversion.h (f32 <-> bf16/f16 buffers), row_grouping.h (rows two or four
// at a time, from the L1's ways), simd_target.h (which SIMD target runs, and limiting it).
//
//   host_rows::RowBlock block;  // pointers to num_rows rows of f32 x, dy, dx; gamma; dgamma
//   host_rows::BackwardRows(block);
//
// Accuracy: f32 rows (and the casting modes that round, on rows staged as f32): the per-row sums
// (sum x^2, sum x*dy*gamma), dx and the grad_gamma partials are computed in double from f32
// inputs, and dx is rounded to f32 once, as ReferenceBackward does; only the summation order
// differs (SIMD lanes), so dx agrees with the reference to within an ulp or two of f32.
// bf16/f16 rows (casting mode gemma) are computed in float32 arithmetic, held to one unit of
// their dtype plus float32's rounding of the terms (half_rows.h; docs/kernels.md).
//
// Rows go two or four at a time (pass 2 of a group loads gamma and the grad_gamma partial once;
// row_grouping.h), each row computed exactly as alone, and the next group is prefetched
// meanwhile (docs/backends.md, "CPU backend").
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernel_config.h"

namespace normgrad::server::host_rows {

// Rows [0, num_rows) of one partition, all pointers already offset to its first row.
//
// Variants (kernels::NormVariant): `gamma` is the scale, which the caller forms (gamma_offset +
// gamma in f32, or 1 without gamma); `dgamma` is nullptr when the batch has no gamma. The
// casting modes kLlama and kNone round to `element` (bf16, f16) where the forward did:
// m = R(dy * scale), and for kLlama grad_gamma adds dy * R(x / rms); R rounds the double value
// once, to nearest even. With kGemma, or element kF32, the math is the plain one above.
//
// In place: dx may be dy (the same rows at the same address); each dy element is read before
// that dx element is written. dx must not overlap x, rms, or another row of dy.
//
// Storage: x, dy and dx are `storage` elements (f32, or bf16/f16 converted in registers, every
// element rounded to nearest even). bf16/f16 storage takes the casting mode kGemma only (the
// rounding modes run on f32 rows staged by the caller, `element` naming their dtype), and is
// computed in f32 arithmetic (half_rows.h).
struct RowBlock {
  const void* x = nullptr;            // num_rows * hidden_dim of `storage`
  const void* dy = nullptr;           // num_rows * hidden_dim of `storage`
  const float* gamma = nullptr;       // hidden_dim: the scale (or nullptr when gamma_f64 is given)
  const double* gamma_f64 = nullptr;  // the scale as double, or nullptr: promoted on each call
  double gamma_max_abs = -1;          // max |scale| (inf if one is not finite); < 0: found per call
  const float* rms = nullptr;         // num_rows, or nullptr to recompute from x and eps
  void* dx = nullptr;                 // num_rows * hidden_dim of `storage` (written)
  double* dgamma = nullptr;  // hidden_dim, or nullptr; each row's dy*x/rms is added in row order
  size_t num_rows = 0;
  size_t hidden_dim = 0;
  float eps = 0;
  // Write dx with non-temporal stores (for chunks much larger than the caches: saves the
  // read-for-ownership of dx and keeps x/dy in cache).
  bool stream_dx = false;
  kernels::CastingMode casting = kernels::CastingMode::kGemma;
  kernels::DType element = kernels::DType::kF32;  // what x and dy were before promotion to f32
  kernels::DType storage = kernels::DType::kF32;  // what x, dy and dx are in memory
};

void BackwardRows(const RowBlock& block);

// The largest |scale[i]| of n, infinite when one is not finite: RowBlock::gamma_max_abs.
double MaxAbsScale(const float* scale, size_t n);

}  // namespace normgrad::server::host_rows
