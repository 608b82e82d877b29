// bf16 and f16 rows in float32 arithmetic (host_rows.h's RowBlock with `storage` kBF16 or kF16
// and the casting mode kGemma): the elements are converted to f32 in registers, and everything
// a row needs is computed in f32 vectors of twice the lanes of double, except what must not
// round more than float32 does once per term (docs/kernels.md, "The CPU's bound for bf16 and
// f16"):
//   - the two row sums (x^2 and x*dy*gamma) are added in f32 for eight terms per lane, then in
//     double, so their error is eight f32 roundings of their terms, whatever hidden_dim is;
//   - 1/rms and its correction are formed in double and rounded to f32 once;
//   - grad_gamma's terms dy*x (exact in f32: 8 x 8 or 11 x 11 significant bits) are multiplied
//     by 1/rms and added in double, row after row, as the double path adds them, so grad_gamma
//     does not depend on how rows are grouped or how many threads run.
// A row whose values could overflow f32 on the way (sums that are not finite, |dy|, |gamma| or
// 1/rms so large or 1/rms so small that a product leaves f32's range) is computed in double
// by host_rows' own path instead: never an infinity where double gives a number.
#pragma once

#include "server/host_rows/host_rows.h"

namespace normgrad::server::host_rows::internal {

// `block`: storage kBF16 or kF16, casting kGemma (BackwardRows sends only those here).
void BackwardHalfRows(const RowBlock& block);

// host_rows' double path (every storage), for the rows BackwardHalfRows does not take.
void BackwardRowsInDouble(const RowBlock& block);

// The SIMD target host_rows' dispatch runs on now (simd_target.h's SimdTargetName).
const char* DispatchedTargetName();

}  // namespace normgrad::server::host_rows::internal
