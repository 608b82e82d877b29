// RMSNorm backward over rows held in host memory, and the f32 <-> bf16/f16 conversions (Google
// Highway, dynamic dispatch to the best SIMD target the machine supports). Shared by both
// backends: the CPU backend runs every chunk through it; the CUDA backend uses it for what it
// computes on the host (cuda_backend.h says when) and to convert gamma and grad_gamma.
//
//   host_rows::RowBlock block;  // pointers to num_rows rows of f32 x, dy, dx; gamma; dgamma
//   host_rows::BackwardRowsF32(block);
//
// Accuracy: f32 rows (and the casting modes that round, on rows staged as f32): the per-row sums
// (sum x^2, sum x*dy*gamma), dx and the grad_gamma partials are computed in double from f32
// inputs, and dx is rounded to f32 once, as ReferenceBackward does; only the summation order
// differs (SIMD lanes), so dx agrees with the reference to within an ulp or two of f32.
// bf16/f16 rows (casting mode gemma) are computed in float32 arithmetic, held to one unit of
// their dtype plus float32's rounding of the terms (half_rows.h; docs/kernels.md).
//
// Rows go two or four at a time (pass 2 of a group loads gamma and the grad_gamma partial once;
// FourRowsMaxElements below), each row computed exactly as alone, and the next group is
// prefetched meanwhile (docs/backends.md, "CPU backend").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernel.h"

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

void BackwardRowsF32(const RowBlock& block);

// Rows go four at a time when they have at most FourRowsMaxElements() elements, else two at a
// time. Four rows keep the per-group costs (reductions, the grad_gamma load and store) small and
// prefetch further ahead, but four rows whose stride is near a multiple of 4 KiB put a dozen
// streams (x, dy and dx of each row) on the same L1 sets. On an earlier machine four wide rows
// measured slower in cache (4096 elements: 27 -> 20 GB/s); on a 12-way L1 they did not (34-37
// GB/s either way) and were faster in memory (4096 x 4096: 5.2 -> 4.3 ms). So: every width where
// the L1 data cache has at least kWaysForFourWideRows ways (a dozen streams fit a set), else up
// to kFourRowsMaxElementsFewWays, also where the ways are unknown (docs/backends.md).
inline constexpr int kWaysForFourWideRows = 12;
inline constexpr size_t kFourRowsMaxElementsFewWays = 2048;
size_t FourRowsMaxElementsFor(int l1_ways);
size_t FourRowsMaxElements();  // for this machine's L1DataCacheWays(), computed once

// Rows that alias. When two rows of a group start within kAliasBytes of each other modulo 4 KiB
// (f32 rows of 1000, 1016, 1024, 1536, 2048, 3072, 4096 ... elements), pass 2 loads their x and dy
// and stores their dx at the same low 12 address bits, on the same L1 sets. On a CPU with an 8-way
// L1 (Zen 3, AVX2) streamed dx then ran at 1.8 - 5.7 GB/s (9.7 at 1000) against 9.4 - 16.4 GB/s
// with ordinary stores, and four such rows at a time were slower than two (of copy: 1024 0.55
// against 0.69, 2048 0.58 against 0.76); on one with a 12-way L1 (Zen 5) those widths streamed
// faster than they stored (4096 x 4096: 4.3 against 5.7 ms), four rows at a time included.
// Rows that do not alias streamed well on both.
// So where the L1 data cache has fewer than kWaysForFourWideRows ways, or unknown ways, a group
// whose rows alias writes dx with ordinary stores, and goes two rows at a time, not four
// (docs/backends.md; figures in docs/benchmarks.md).
inline constexpr size_t kAliasBytes = 128;
// Whether `group_rows` consecutive rows of `row_bytes` each put two rows' starts within
// kAliasBytes of each other modulo 4 KiB.
bool GroupRowsAlias(size_t row_bytes, size_t group_rows);
bool ToleratesAliasedRowsFor(int l1_ways);
bool ToleratesAliasedRows();  // for this machine's L1DataCacheWays(), computed once

// The L1 data cache's associativity: sysconf, else the kernel's cache description in sysfs; 0
// when neither says.
int L1DataCacheWays();

// Element conversions for the non-f32 dtypes (f32 <-> bf16/f16, round to nearest even).
// `src`/`dst` hold n elements of `dtype` as little-endian bytes.
void ConvertToF32(kernels::DType dtype, const uint8_t* src, float* dst, size_t n);
void ConvertFromF32(kernels::DType dtype, const float* src, uint8_t* dst, size_t n);

// Name of the SIMD target the dispatcher picked on this machine ("AVX3", "AVX2", ...).
std::string SimdTargetName();

// For benchmarks and tests: from now on the dispatcher picks no target better than `name` (a
// SimdTargetName() of a target this build has and the CPU supports; "AVX2" on an AVX-512
// machine runs the code path of CPUs without AVX-512); "" lifts the limit. False, and nothing
// changed, otherwise. Not thread-safe with calls running on other threads.
bool LimitSimdTarget(const std::string& name);

// The targets this build has and this CPU runs, best first (what LimitSimdTarget takes).
std::vector<std::string> SupportedSimdTargets();

}  // namespace normgrad::server::host_rows
