#include "server/host_rows/host_rows.h"

#include "server/host_rows/element_conversion.h"
#include "server/host_rows/half_rows.h"
#include "server/host_rows/row_grouping.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "server/host_rows/host_rows.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "server/host_rows/element_rounding-inl.h"

HWY_BEFORE_NAMESPACE();
namespace normgrad::server::host_rows {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// x, dy and dx as stored (RowBlock::storage): f32, or bf16/f16 converted in registers. A vector
// step loads Lanes(d) elements as double and stores Lanes(d) results (double -> f32 -> the
// element type, each rounding to nearest even, as staging through f32 rounds).
template <class D>
HWY_INLINE hn::Vec<D> LoadAsDouble(D d, const float* HWY_RESTRICT p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<float, D>(), p));
}
template <class D, typename T>
HWY_INLINE hn::Vec<D> LoadAsDouble(D d, const T* HWY_RESTRICT p) {
  const hn::Rebind<float, D> df;
  return hn::PromoteTo(d, hn::PromoteTo(df, hn::LoadU(hn::Rebind<T, D>(), p)));
}

// f32 lanes stored as the element type (round to nearest even).
template <class DF>
HWY_INLINE void StoreF32As(DF df, hn::Vec<DF> v, hwy::bfloat16_t* HWY_RESTRICT p) {
  hn::StoreU(rounding::ToBF16Bits(df, v), hn::Rebind<uint16_t, DF>(),
             reinterpret_cast<uint16_t*>(p));
}
template <class DF>
HWY_INLINE void StoreF32As(DF df, hn::Vec<DF> v, hwy::float16_t* HWY_RESTRICT p) {
  hn::StoreU(rounding::ToF16(df, v), hn::Rebind<hwy::float16_t, DF>(), p);
}

template <bool kStream, class D>
HWY_INLINE void StoreFromDouble(D d, hn::Vec<D> v, float* HWY_RESTRICT p) {
  const hn::Rebind<float, D> df;
  if (kStream) {
    hn::Stream(hn::DemoteTo(df, v), df, p);
  } else {
    hn::StoreU(hn::DemoteTo(df, v), df, p);
  }
}
template <bool kStream, class D, typename T>
HWY_INLINE void StoreFromDouble(D d, hn::Vec<D> v, T* HWY_RESTRICT p) {
  const hn::Rebind<float, D> df;
  StoreF32As(df, hn::DemoteTo(df, v), p);
}

// Two vector steps at once (2 * Lanes(d) elements, lo then hi). bf16 is converted a whole f32
// vector at a time: one widening and one rounding (seven integer operations) per 2 * Lanes(d)
// elements instead of two on half-width vectors. Elementwise, so the bits are those of two single
// steps. f32 and f16 (one conversion instruction either way; measured no faster in pairs), and the
// scalar target, take two single steps.
template <class D, typename T>
HWY_INLINE void LoadPairAsDouble(D d, const T* HWY_RESTRICT p, hn::Vec<D>& lo, hn::Vec<D>& hi) {
  lo = LoadAsDouble(d, p);
  hi = LoadAsDouble(d, p + hn::Lanes(d));
}
template <class D>
HWY_INLINE void LoadPairAsDouble(D d, const hwy::bfloat16_t* HWY_RESTRICT p, hn::Vec<D>& lo,
                                 hn::Vec<D>& hi) {
#if HWY_TARGET == HWY_SCALAR
  lo = LoadAsDouble(d, p);
  hi = LoadAsDouble(d, p + hn::Lanes(d));
#else
  const hn::Rebind<float, D> dfh;
  const hn::Twice<decltype(dfh)> df;
  const auto f = hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::bfloat16_t, decltype(df)>(), p));
  lo = hn::PromoteTo(d, hn::LowerHalf(dfh, f));
  hi = hn::PromoteTo(d, hn::UpperHalf(dfh, f));
#endif
}

template <bool kStream, class D, typename T>
HWY_INLINE void StorePairFromDouble(D d, hn::Vec<D> lo, hn::Vec<D> hi, T* HWY_RESTRICT p) {
  StoreFromDouble<kStream>(d, lo, p);
  StoreFromDouble<kStream>(d, hi, p + hn::Lanes(d));
}
template <bool kStream, class D>
HWY_INLINE void StorePairFromDouble(D d, hn::Vec<D> lo, hn::Vec<D> hi,
                                    hwy::bfloat16_t* HWY_RESTRICT p) {
#if HWY_TARGET == HWY_SCALAR
  StoreFromDouble<kStream>(d, lo, p);
  StoreFromDouble<kStream>(d, hi, p + hn::Lanes(d));
#else
  const hn::Rebind<float, D> dfh;
  const hn::Twice<decltype(dfh)> df;
  StoreF32As(df, hn::Combine(df, hn::DemoteTo(dfh, hi), hn::DemoteTo(dfh, lo)), p);
#endif
}

// One element the way the vector body computes it: dx = inv * fma(-x, c, g*dy) and
// dgamma = fma(dy*x, inv, dgamma), so heads and tails round exactly like the vector lanes
// on targets with FMA.
template <bool kAccumulate>
HWY_INLINE void ScalarElement(float xf, float yf, double g, double inv_rms, double correction,
                              float* dx, double* dgamma) {
  const double x = xf, y = yf;
  *dx = static_cast<float>(inv_rms * std::fma(-x, correction, g * y));
  if (kAccumulate) *dgamma = std::fma(y * x, inv_rms, *dgamma);
}

// grad_gamma's element i when the rows accumulate it; none otherwise (then dgamma may be null,
// and null + i is undefined even unused).
template <bool kAccumulate>
HWY_INLINE double* DgammaAt(double* dgamma, size_t i) {
  if constexpr (kAccumulate) {
    return dgamma + i;
  } else {
    return nullptr;
  }
}

// kSteps vector steps of a row at p: one, or (kSteps 2) a pair through LoadPairAsDouble /
// StorePairFromDouble.
template <size_t kSteps, class D, typename T>
HWY_INLINE void LoadStepsAsDouble(D d, const T* HWY_RESTRICT p, hn::Vec<D>* v) {
  if constexpr (kSteps == 2) {
    LoadPairAsDouble(d, p, v[0], v[1]);
  } else {
    static_assert(kSteps == 1, "one or two steps");
    v[0] = LoadAsDouble(d, p);
  }
}
template <size_t kSteps, bool kStream, class D, typename T>
HWY_INLINE void StoreStepsFromDouble(D d, const hn::Vec<D>* v, T* HWY_RESTRICT p) {
  if constexpr (kSteps == 2) {
    StorePairFromDouble<kStream>(d, v[0], v[1], p);
  } else {
    StoreFromDouble<kStream>(d, v[0], p);
  }
}

// Pass 2 of BackwardRowGroup over kSteps vector steps at element i of R rows: dx = inv_rms *
// (gamma*dy - x*correction), and dgamma += dy*x*inv_rms row after row. Every row's loads come
// before the first store: dx may alias x/dy for all the compiler knows, so it keeps this order,
// and a later row's load then never waits behind an earlier row's dx store whose address
// matches it in the low 12 bits (rows 16 KiB apart do).
template <size_t kSteps, size_t R, bool kStream, bool kAccumulate, class D, typename T>
HWY_INLINE void DxAndDgammaSteps(D d, size_t i, const double* HWY_RESTRICT gamma,
                           double* HWY_RESTRICT dgamma, const T* const* x, const T* const* dy,
                           T* const* dx, const T* const* next_dy, const hn::Vec<D>* inv_v,
                           const hn::Vec<D>* corr_v) {
  using V = hn::Vec<D>;
  const size_t lanes = hn::Lanes(d);
  V g[kSteps], dg[kSteps];
  for (size_t j = 0; j < kSteps; ++j) {
    g[j] = hn::LoadU(d, gamma + i + j * lanes);
    dg[j] = kAccumulate ? hn::LoadU(d, dgamma + i + j * lanes) : hn::Zero(d);
  }
  V xs[R][kSteps], ys[R][kSteps];
  HWY_UNROLL(4)
  for (size_t k = 0; k < R; ++k) {
    __builtin_prefetch(next_dy[k] + i, 0, 2);
    LoadStepsAsDouble<kSteps>(d, x[k] + i, xs[k]);
    LoadStepsAsDouble<kSteps>(d, dy[k] + i, ys[k]);
  }
  HWY_UNROLL(4)
  for (size_t k = 0; k < R; ++k) {
    V out[kSteps];
    for (size_t j = 0; j < kSteps; ++j) {
      out[j] = hn::Mul(inv_v[k], hn::NegMulAdd(xs[k][j], corr_v[k], hn::Mul(g[j], ys[k][j])));
      if (kAccumulate) dg[j] = hn::MulAdd(hn::Mul(ys[k][j], xs[k][j]), inv_v[k], dg[j]);
    }
    StoreStepsFromDouble<kSteps, kStream>(d, out, dx[k] + i);
  }
  if (kAccumulate) {
    for (size_t j = 0; j < kSteps; ++j) hn::StoreU(dg[j], d, dgamma + i + j * lanes);
  }
}

// Rows r .. r + R - 1 of `b`, whose x, dy and dx are T (RowBlock::storage): pass 1 for each of
// them, then one pass 2 over hidden_dim for all of them, so that gamma and the grad_gamma partial
// are loaded (and grad_gamma stored) once per R rows instead of once per row. Each row's
// operations are those of R = 1 in the same order, and grad_gamma receives row r's term before
// row r + 1's, so the grouping never changes a bit. bf16/f16 elements are converted in
// registers; a row's last elements (fewer than a vector) go through f32 copies converted as a
// vector is, so every element's bits are those of staging the rows as f32 first.
// With kStream (T = float only), the caller guarantees that every row's dx has the same
// misalignment (the same scalar head). Without kAccumulate grad_gamma is neither read nor
// written, and each row's 1/rms is stored to inv_rms_out[r + k] when inv_rms_out is not null.
template <typename T, size_t R, bool kStream, bool kAccumulate>
HWY_INLINE void BackwardRowGroup(const RowBlock& b, const double* HWY_RESTRICT gamma, size_t r,
                                 size_t prefetch_rows, double* inv_rms_out) {
  static_assert(!kStream || std::is_same<T, float>::value, "streaming stores are f32 only");
  const hn::ScalableTag<double> d;
  using V = hn::Vec<decltype(d)>;
  const size_t lanes = hn::Lanes(d);
  const size_t h = b.hidden_dim;
  const double h_double = static_cast<double>(h);
  double* HWY_RESTRICT dgamma = b.dgamma;
  const T* x[R];
  const T* dy[R];
  T* dx[R];
  HWY_UNROLL(4)
  for (size_t k = 0; k < R; ++k) {
    x[k] = static_cast<const T*>(b.x) + (r + k) * h;
    dy[k] = static_cast<const T*>(b.dy) + (r + k) * h;
    dx[k] = static_cast<T*>(b.dx) + (r + k) * h;
  }

  // The next group's x is prefetched during pass 1 and its dy during pass 2, one prefetch per row
  // and vector step, so that memory keeps working while this group's rows are computed from the
  // cache (without it, memory idled during pass 2 until the next rows' first misses). Into L2
  // (locality 2): the current rows, gamma and the partial already fill much of L1.
  const T* next_x[R];
  const T* next_dy[R];
  HWY_UNROLL(4)
  for (size_t k = 0; k < R; ++k) {
    // Past the block's end: prefetch this group's own (cached) rows, harmless.
    const size_t next = k < prefetch_rows ? r + R + k : r + k;
    next_x[k] = static_cast<const T*>(b.x) + next * h;
    next_dy[k] = static_cast<const T*>(b.dy) + next * h;
  }

  // Pass 1: sum x^2 (unless the forward's rms is given) and sum x*dy*gamma, two
  // accumulators each for instruction-level parallelism.
  V sq0[R], sq1[R], xg0[R], xg1[R];
  HWY_UNROLL(4)
  for (size_t k = 0; k < R; ++k) sq0[k] = sq1[k] = xg0[k] = xg1[k] = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * lanes <= h; i += 2 * lanes) {
    const V g0 = hn::LoadU(d, gamma + i);
    const V g1 = hn::LoadU(d, gamma + i + lanes);
    HWY_UNROLL(4)
    for (size_t k = 0; k < R; ++k) {
      __builtin_prefetch(next_x[k] + i, 0, 2);
      V x0, x1, y0, y1;
      LoadPairAsDouble(d, x[k] + i, x0, x1);
      LoadPairAsDouble(d, dy[k] + i, y0, y1);
      sq0[k] = hn::MulAdd(x0, x0, sq0[k]);
      sq1[k] = hn::MulAdd(x1, x1, sq1[k]);
      xg0[k] = hn::MulAdd(hn::Mul(x0, y0), g0, xg0[k]);
      xg1[k] = hn::MulAdd(hn::Mul(x1, y1), g1, xg1[k]);
    }
  }
  for (; i + lanes <= h; i += lanes) {
    const V g0 = hn::LoadU(d, gamma + i);
    HWY_UNROLL(4)
    for (size_t k = 0; k < R; ++k) {
      const V x0 = LoadAsDouble(d, x[k] + i);
      const V y0 = LoadAsDouble(d, dy[k] + i);
      sq0[k] = hn::MulAdd(x0, x0, sq0[k]);
      xg0[k] = hn::MulAdd(hn::Mul(x0, y0), g0, xg0[k]);
    }
  }
  const size_t tail = i;
  // The rows' elements [tail, h) as f32: the rows themselves for f32, else converted copies.
  constexpr bool kF32 = std::is_same<T, float>::value;
  HWY_ALIGN float tail_x[kF32 ? 1 : R][kF32 ? 1 : hn::MaxLanes(d)];
  HWY_ALIGN float tail_dy[kF32 ? 1 : R][kF32 ? 1 : hn::MaxLanes(d)];
  HWY_ALIGN float tail_dx[kF32 ? 1 : R][kF32 ? 1 : hn::MaxLanes(d)];
  const float* x_tail[R];
  const float* dy_tail[R];
  float* dx_tail[R];
  for (size_t k = 0; k < R; ++k) {
    if constexpr (kF32) {
      x_tail[k] = x[k] + tail;
      dy_tail[k] = dy[k] + tail;
      dx_tail[k] = dx[k] + tail;
    } else {
      if (tail < h) {
        rounding::PromoteToF32</*kPartial=*/true>(x[k] + tail, tail_x[k], h - tail);
        rounding::PromoteToF32</*kPartial=*/true>(dy[k] + tail, tail_dy[k], h - tail);
      }
      x_tail[k] = tail_x[k];
      dy_tail[k] = tail_dy[k];
      dx_tail[k] = tail_dx[k];
    }
  }
  V inv_v[R], corr_v[R];
  double inv_rms[R], correction[R];
  HWY_UNROLL(4)
  for (size_t k = 0; k < R; ++k) {
    double sum_sq = hn::GetLane(hn::SumOfLanes(d, hn::Add(sq0[k], sq1[k])));
    double sum_xdyg = hn::GetLane(hn::SumOfLanes(d, hn::Add(xg0[k], xg1[k])));
    for (i = tail; i < h; ++i) {
      const double xi = x_tail[k][i - tail];
      sum_sq += xi * xi;
      sum_xdyg += xi * static_cast<double>(dy_tail[k][i - tail]) * gamma[i];
    }
    const double rms = b.rms != nullptr ? static_cast<double>(b.rms[r + k])
                                        : std::sqrt(sum_sq / h_double + static_cast<double>(b.eps));
    inv_rms[k] = 1.0 / rms;
    if (!kAccumulate && inv_rms_out != nullptr) inv_rms_out[r + k] = inv_rms[k];
    correction[k] = inv_rms[k] * inv_rms[k] * (sum_xdyg / h_double);
    inv_v[k] = hn::Set(d, inv_rms[k]);
    corr_v[k] = hn::Set(d, correction[k]);
  }

  // Pass 2 (the rows are still in L1/L2): dx = inv_rms * (gamma*dy - x*correction) and
  // dgamma += dy*x*inv_rms.
  i = 0;
  if constexpr (kStream) {
    // Scalar head up to the vector alignment of dx (same operations as the vector body, fused
    // the same way, so an element's bits do not depend on its address).
    const size_t misalign = reinterpret_cast<uintptr_t>(dx[0]) % (lanes * sizeof(float));
    const size_t head = misalign == 0 ? 0 : (lanes * sizeof(float) - misalign) / sizeof(float);
    for (; i < std::min(head, h); ++i) {
      for (size_t k = 0; k < R; ++k) {
        ScalarElement<kAccumulate>(x[k][i], dy[k][i], gamma[i], inv_rms[k], correction[k],
                                   dx[k] + i, DgammaAt<kAccumulate>(dgamma, i));
      }
    }
  }
  // kSteps vector steps at a time: two for bf16 (LoadPairAsDouble), else one; then single steps.
  constexpr size_t kSteps = std::is_same<T, hwy::bfloat16_t>::value ? 2 : 1;
  for (; i + kSteps * lanes <= h; i += kSteps * lanes) {
    DxAndDgammaSteps<kSteps, R, kStream, kAccumulate>(d, i, gamma, dgamma, x, dy, dx, next_dy, inv_v,
                                                corr_v);
  }
  if constexpr (kSteps > 1) {
    for (; i + lanes <= h; i += lanes) {
      DxAndDgammaSteps<1, R, kStream, kAccumulate>(d, i, gamma, dgamma, x, dy, dx, next_dy, inv_v,
                                             corr_v);
    }
  }
  // The tail: from `tail` on when there is no head (always for bf16/f16), else for f32 where the
  // head's shift ends the vector steps, which may be before `tail`: a signed offset from the
  // tail pointers, which for f32 point into the rows themselves.
  const size_t from = i;
  for (; i < h; ++i) {
    const ptrdiff_t at = static_cast<ptrdiff_t>(i) - static_cast<ptrdiff_t>(tail);
    for (size_t k = 0; k < R; ++k) {
      ScalarElement<kAccumulate>(x_tail[k][at], dy_tail[k][at], gamma[i], inv_rms[k],
                                 correction[k], dx_tail[k] + at, DgammaAt<kAccumulate>(dgamma, i));
    }
  }
  if constexpr (!kF32) {
    if (from < h) {
      for (size_t k = 0; k < R; ++k) {
        rounding::DemoteFromF32</*kPartial=*/true>(tail_dx[k], dx[k] + from, h - from);
      }
    }
  }
}

// How many rows BackwardRows puts in a group of a block with `hidden_dim` elements of
// `element_bytes` per row: four, or two for rows wider than FourRowsMaxElements() and for four
// rows that alias where ToleratesAliasedRows() is false (their x, dy and dx are a dozen lines on
// the same L1 sets); one when streaming and a row is not a whole number of f32 vectors (every row
// of a streamed group needs the same scalar head).
size_t RowsPerGroupStreaming(size_t hidden_dim, size_t element_bytes, bool stream) {
  if (stream && hidden_dim % hn::Lanes(hn::ScalableTag<double>()) != 0) return 1;
  return RowsPerGroup(hidden_dim, element_bytes);
}

template <typename T, bool kStream, bool kAccumulate>
void BackwardRows(const RowBlock& b, const double* gamma, double* inv_rms_out) {
  size_t r = 0;
  const size_t group = RowsPerGroupStreaming(b.hidden_dim, sizeof(T), kStream);
  if (group > 1) {
    if (group == 4) {
      for (; r + 4 <= b.num_rows; r += 4) {
        BackwardRowGroup<T, 4, kStream, kAccumulate>(b, gamma, r, b.num_rows - r - 4, inv_rms_out);
      }
    }
    for (; r + 2 <= b.num_rows; r += 2) {
      BackwardRowGroup<T, 2, kStream, kAccumulate>(b, gamma, r, b.num_rows - r - 2, inv_rms_out);
    }
  }
  for (; r < b.num_rows; ++r) {
    BackwardRowGroup<T, 1, kStream, kAccumulate>(b, gamma, r, b.num_rows - r - 1, inv_rms_out);
  }
}

template <typename T, bool kStream>
void BackwardRowsWithOrWithoutGamma(const RowBlock& b, const double* gamma) {
  if (b.dgamma != nullptr) {
    BackwardRows<T, kStream, true>(b, gamma, nullptr);
  } else {
    BackwardRows<T, kStream, false>(b, gamma, nullptr);
  }
}

// The casting modes that round (kLlama, kNone) on bf16/f16 rows, one row at a time: m =
// R(dy * scale) into a row of its own, dx from the plain row math with m as dy and a scale of 1
// (1 * m is m exactly), then grad_gamma from the row's dy (copied first: dx may be dy) and 1/rms.
// Not the default path, so plain loops suffice besides the row math.
thread_local std::vector<float> rounded_rows;  // m, the row's dy, and a row for R(x / rms)
thread_local std::vector<uint8_t> rounded_bytes;
thread_local std::vector<double> unit_scale;

// `v` as the nearest f32 in the direction of rounding to odd: exact values stay, inexact ones
// get the neighbour with an odd last bit. Rounding that to a type at least two bits narrower
// (bf16, f16) to nearest even rounds `v` once, as if directly.
HWY_INLINE float RoundToOddF32(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) != v) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 1u) == 0) f = std::nextafter(f, v > f ? HUGE_VALF : -HUGE_VALF);
  }
  return f;
}

// v[i] = R(v[i]): each value rounded to `element` and back to f32.
void RoundThroughElement(kernels::DType element, float* v, size_t n) {
  rounded_bytes.resize(n * 2);
  ConvertFromF32(element, v, rounded_bytes.data(), n);
  ConvertToF32(element, rounded_bytes.data(), v, n);
}

void BackwardRowsRounded(const RowBlock& b, const double* scale) {
  const size_t h = b.hidden_dim;
  rounded_rows.resize(3 * h);
  float* m = rounded_rows.data();
  float* dy = m + h;
  float* n = dy + h;
  if (unit_scale.size() < h) unit_scale.assign(h, 1.0);
  for (size_t r = 0; r < b.num_rows; ++r) {
    const float* x = static_cast<const float*>(b.x) + r * h;
    const float* dy_row = static_cast<const float*>(b.dy) + r * h;
    std::copy(dy_row, dy_row + h, dy);
    for (size_t i = 0; i < h; ++i) m[i] = RoundToOddF32(static_cast<double>(dy[i]) * scale[i]);
    RoundThroughElement(b.element, m, h);
    RowBlock row = b;
    row.x = x;
    row.dy = m;
    row.dx = static_cast<float*>(b.dx) + r * h;
    row.rms = b.rms != nullptr ? b.rms + r : nullptr;
    row.num_rows = 1;
    double inv_rms = 0;
    BackwardRows<float, false, false>(row, unit_scale.data(), &inv_rms);
    if (b.dgamma == nullptr) continue;
    if (b.casting == kernels::CastingMode::kLlama) {
      for (size_t i = 0; i < h; ++i) n[i] = RoundToOddF32(static_cast<double>(x[i]) * inv_rms);
      RoundThroughElement(b.element, n, h);
      for (size_t i = 0; i < h; ++i) b.dgamma[i] += static_cast<double>(dy[i]) * n[i];
    } else {
      for (size_t i = 0; i < h; ++i) {
        b.dgamma[i] = std::fma(static_cast<double>(dy[i]) * x[i], inv_rms, b.dgamma[i]);
      }
    }
  }
}

// Rows shorter than this stream dx only when its rows start on a vector boundary. Otherwise each
// row's scalar head and tail are ordinary stores into lines that the neighbouring rows stream,
// which costs more than streaming saves: at hidden 64, 4 of every 64 elements' lines then mix
// the two kinds of store and the backward ran at 20 GB/s streamed against 34 GB/s not
// (docs/benchmarks.md). From 128 elements on, streaming won at any offset.
constexpr size_t kMisalignedStreamMinElements = 128;

// Whether f32 rows stream dx, when the caller asks (b.stream_dx): from
// kMisalignedStreamMinElements on at any offset, shorter rows only from a vector boundary; and
// groups whose rows alias only where ToleratesAliasedRows().
bool StreamsDx(const RowBlock& b) {
  if (!b.stream_dx) return false;
  const size_t vector_bytes = hn::Lanes(hn::ScalableTag<double>()) * sizeof(float);
  if (b.hidden_dim < kMisalignedStreamMinElements &&
      reinterpret_cast<uintptr_t>(b.dx) % vector_bytes != 0) {
    return false;
  }
  return ToleratesAliasedRows() ||
         !GroupRowsAlias(b.hidden_dim * sizeof(float),
                         RowsPerGroupStreaming(b.hidden_dim, sizeof(float), /*stream=*/true));
}

void BackwardRowsInDoubleImpl(const RowBlock& b) {
  // gamma in double: read as is by every row instead of promoted twice per row.
  std::vector<double> promoted;
  const double* gamma = b.gamma_f64;
  if (gamma == nullptr) {
    promoted.assign(b.gamma, b.gamma + b.hidden_dim);
    gamma = promoted.data();
  }
  switch (b.storage) {
    case kernels::DType::kBF16:
      BackwardRowsWithOrWithoutGamma<hwy::bfloat16_t, false>(b, gamma);
      return;
    case kernels::DType::kF16:
      BackwardRowsWithOrWithoutGamma<hwy::float16_t, false>(b, gamma);
      return;
    case kernels::DType::kF32:
      break;
  }
  if (b.element != kernels::DType::kF32 && b.casting != kernels::CastingMode::kGemma) {
    BackwardRowsRounded(b, gamma);
  } else if (StreamsDx(b)) {
    BackwardRowsWithOrWithoutGamma<float, true>(b, gamma);
    hwy::FlushStream();
  } else {
    BackwardRowsWithOrWithoutGamma<float, false>(b, gamma);
  }
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace normgrad::server::host_rows
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace normgrad::server::host_rows {

HWY_EXPORT(BackwardRowsInDoubleImpl);
HWY_EXPORT(TargetNameImpl);

void BackwardRows(const RowBlock& block) {
  if (block.storage != kernels::DType::kF32) {
    internal::BackwardHalfRows(block);  // bf16/f16 (casting mode gemma) in f32 arithmetic
    return;
  }
  HWY_DYNAMIC_DISPATCH(BackwardRowsInDoubleImpl)(block);
}

double MaxAbsScale(const float* scale, size_t n) {
  double max = 0;
  for (size_t i = 0; i < n; ++i) {
    const double v = std::fabs(static_cast<double>(scale[i]));
    if (!std::isfinite(v)) return HUGE_VAL;
    max = std::max(max, v);
  }
  return max;
}

namespace internal {

void BackwardRowsInDouble(const RowBlock& block) {
  HWY_DYNAMIC_DISPATCH(BackwardRowsInDoubleImpl)(block);
}

const char* DispatchedTargetName() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

}  // namespace internal
}  // namespace normgrad::server::host_rows
#endif  // HWY_ONCE
