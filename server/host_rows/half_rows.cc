#include "server/host_rows/half_rows.h"

#include "server/host_rows/row_grouping.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "server/host_rows/half_rows.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "server/host_rows/element_rounding-inl.h"

HWY_BEFORE_NAMESPACE();
namespace normgrad::server::host_rows::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR

// What a row's f32 computation may meet without leaving f32's normal range (half_rows.h):
// products and sums up to kMaxProduct, 1/rms in [kMinInvRms, kMaxInvRms]. Above kMaxInvRms an
// f32 product below 2^-126 (rounded to a multiple of 2^-149) would be scaled past half a unit of
// bf16's smallest step (2^-133); with eps 1e-6 and 1e-5 1/rms is at most 1000 and 316.
constexpr double kMaxProduct = 0x1p100;
constexpr double kMinInvRms = 0x1p-60;
constexpr double kMaxInvRms = 0x1p12;
constexpr double kMinCorrection = 0x1p-100;  // a nonzero correction below this stays in double

// Pass 1 adds this many terms per lane in f32 before adding them to the double sums.
constexpr size_t kTermsPerFlush = 8;

// n elements of T at p as f32 lanes (round trip exact).
template <class DF>
HWY_INLINE hn::Vec<DF> LoadF32(DF df, const hwy::bfloat16_t* HWY_RESTRICT p) {
  return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::bfloat16_t, DF>(), p));
}
template <class DF>
HWY_INLINE hn::Vec<DF> LoadF32(DF df, const hwy::float16_t* HWY_RESTRICT p) {
  return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::float16_t, DF>(), p));
}

// |element| as its bits (sign cleared): ordered as the magnitudes are, infinity above every
// finite value and NaN above infinity, for both bf16 and f16.
template <class DF, typename T>
HWY_INLINE hn::Vec<hn::Rebind<uint16_t, DF>> MagnitudeBits(DF, const T* HWY_RESTRICT p) {
  const hn::Rebind<uint16_t, DF> du16;
  return hn::And(hn::LoadU(du16, reinterpret_cast<const uint16_t*>(p)), hn::Set(du16, 0x7fff));
}

// f32 lanes stored as T, rounded to nearest even (bf16: values known finite, rows that passed
// FactorsOf's check). kStream: a non-temporal store (p aligned to the store's size).
template <bool kStream, class DF>
HWY_INLINE void StoreAs(DF df, hn::Vec<DF> v, hwy::bfloat16_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> du16;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(lsb, hn::Set(du, 0x7fffu))));
  // Values are <= 0xffff: the signed demotion is exact.
  const auto out = hn::DemoteTo(du16, hn::BitCast(di, rounded));
  if constexpr (kStream) {
    hn::Stream(out, du16, reinterpret_cast<uint16_t*>(p));
  } else {
    hn::StoreU(out, du16, reinterpret_cast<uint16_t*>(p));
  }
}
template <bool kStream, class DF>
HWY_INLINE void StoreAs(DF df, hn::Vec<DF> v, hwy::float16_t* HWY_RESTRICT p) {
  const hn::Rebind<uint16_t, DF> du16;
  const auto out = hn::BitCast(du16, host_rows::HWY_NAMESPACE::rounding::ToF16(df, v));
  if constexpr (kStream) {
    hn::Stream(out, du16, reinterpret_cast<uint16_t*>(p));
  } else {
    hn::StoreU(out, du16, reinterpret_cast<uint16_t*>(p));
  }
}

// The f32 lanes of v, as double, times `by` added to two double vectors (lower, upper half).
template <class DF, class DD>
HWY_INLINE void AddAsDouble(DF, DD dd, hn::Vec<DF> v, hn::Vec<DD> by, hn::Vec<DD>& lo,
                            hn::Vec<DD>& hi) {
  const hn::Half<DF> dfh;
  lo = hn::MulAdd(hn::PromoteTo(dd, hn::LowerHalf(dfh, v)), by, lo);
  hi = hn::MulAdd(hn::PromoteTo(dd, hn::UpperHalf(dfh, v)), by, hi);
}

// The largest |element| whose bits MagnitudeBits gave, as a value (infinite for inf and NaN).
template <typename T>
double MagnitudeOf(uint16_t bits) {
  if constexpr (std::is_same<T, hwy::bfloat16_t>::value) {
    if (bits >= 0x7f80) return HUGE_VAL;
    hwy::bfloat16_t b;
    b.bits = bits;
    return hwy::F32FromBF16(b);
  } else {
    // f16: at most 65504 when finite (the bound needs no more than that).
    return bits >= 0x7c00 ? HUGE_VAL : 65504.0;
  }
}

// A row's values for pass 2, and whether it may be computed in f32 (half_rows.h).
struct RowFactors {
  double inv_rms = 0;     // for grad_gamma (double)
  float inv_rms_f32 = 0;  // dx = (gamma*dy) * inv_rms - x * correction
  float correction = 0;   // inv_rms^3 * mean(x*dy*gamma), rounded to f32 once
  bool safe = false;
};

HWY_INLINE RowFactors FactorsOf(const RowBlock& b, size_t row, double inv_h, double sum_sq,
                                double sum_xdyg, double max_dy, double max_gamma) {
  RowFactors f;
  const double rms = b.rms != nullptr ? static_cast<double>(b.rms[row])
                                      : std::sqrt(sum_sq * inv_h + static_cast<double>(b.eps));
  f.inv_rms = 1.0 / rms;
  const double inv = std::fabs(f.inv_rms);
  const double correction = f.inv_rms * f.inv_rms * f.inv_rms * (sum_xdyg * inv_h);
  const double c = std::fabs(correction);
  // Every x^2 is at most sum_sq: max |x| * v <= kMaxProduct when sum_sq * v^2 is at most its
  // square (with a margin for sum_sq's rounding).
  const double max_x_sq = sum_sq * (1 + 0x1p-9);
  constexpr double kMaxProductSq = kMaxProduct * kMaxProduct;
  f.safe = std::isfinite(sum_sq) && std::isfinite(sum_xdyg) && inv >= kMinInvRms &&
           inv <= kMaxInvRms && (c == 0 || (c >= kMinCorrection && c <= kMaxProduct)) &&
           max_gamma * max_dy <= kMaxProduct && max_x_sq * max_dy * max_dy <= kMaxProductSq &&
           max_x_sq * c * c <= kMaxProductSq;
  f.inv_rms_f32 = static_cast<float>(f.inv_rms);
  f.correction = static_cast<float>(correction);
  return f;
}

// R rows of `b` from row r on, every element of them in f32 (pass 1 for each, then one pass 2 over
// hidden_dim for all, as host_rows' double path groups them). False, and nothing written, when a
// row is not safe in f32 (RowFactors::safe). Each row's operations are those of R = 1 in the same
// order, and grad_gamma receives row r's terms before row r + 1's.
template <typename T, size_t R, bool kStream, bool kAccumulate>
HWY_INLINE bool GroupInF32(const RowBlock& b, double max_gamma, size_t r, size_t prefetch_rows) {
  const hn::ScalableTag<float> df;
  const hn::Half<decltype(df)> dfh;
  const hn::Rebind<double, decltype(dfh)> dd;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  using VF = hn::Vec<decltype(df)>;
  using VD = hn::Vec<decltype(dd)>;
  using VU = hn::Vec<decltype(du16)>;
  const size_t lanes = hn::Lanes(df);
  const size_t half = lanes / 2;
  const size_t h = b.hidden_dim;
  const float* HWY_RESTRICT gamma = b.gamma;
  double* HWY_RESTRICT dgamma = b.dgamma;
  const T* x[R];
  const T* dy[R];
  T* dx[R];
  const T* next_x[R];
  const T* next_dy[R];
  for (size_t k = 0; k < R; ++k) {
    x[k] = static_cast<const T*>(b.x) + (r + k) * h;
    dy[k] = static_cast<const T*>(b.dy) + (r + k) * h;
    dx[k] = static_cast<T*>(b.dx) + (r + k) * h;
    // The next group's rows, into L2 while this group computes (host_rows.cc says why); past the
    // block's end this group's own rows, harmless.
    const size_t next = k < prefetch_rows ? r + R + k : r + k;
    next_x[k] = static_cast<const T*>(b.x) + next * h;
    next_dy[k] = static_cast<const T*>(b.dy) + next * h;
  }
  // The rows' last h % lanes elements, zero-padded to a vector (zeros add nothing to the sums).
  const size_t tail = h - h % lanes;
  HWY_ALIGN T tail_x[R][hn::MaxLanes(df)];
  HWY_ALIGN T tail_dy[R][hn::MaxLanes(df)];
  HWY_ALIGN float tail_gamma[hn::MaxLanes(df)] = {};
  if (tail < h) {
    for (size_t k = 0; k < R; ++k) {
      std::memset(tail_x[k], 0, sizeof(tail_x[k]));
      std::memset(tail_dy[k], 0, sizeof(tail_dy[k]));
      std::memcpy(tail_x[k], x[k] + tail, (h - tail) * sizeof(T));
      std::memcpy(tail_dy[k], dy[k] + tail, (h - tail) * sizeof(T));
    }
    std::memcpy(tail_gamma, gamma + tail, (h - tail) * sizeof(float));
  }

  // Pass 1: sum x^2 and sum x*dy*gamma (f32, then double every kTermsPerFlush terms per lane),
  // and the largest |dy|.
  VF sq[R], xg[R];
  VD sq_lo[R], sq_hi[R], xg_lo[R], xg_hi[R];
  VU max_dy[R];
  const VD one = hn::Set(dd, 1.0);
  for (size_t k = 0; k < R; ++k) {
    sq[k] = xg[k] = hn::Zero(df);
    sq_lo[k] = sq_hi[k] = xg_lo[k] = xg_hi[k] = hn::Zero(dd);
    max_dy[k] = hn::Zero(du16);
  }
  auto pass1_step = [&](const float* HWY_RESTRICT g_at, const T* const* x_at,
                        const T* const* dy_at) HWY_ATTR {
    const VF g = hn::LoadU(df, g_at);
    HWY_UNROLL(4)
    for (size_t k = 0; k < R; ++k) {
      const VF xv = LoadF32(df, x_at[k]);
      const VF yv = LoadF32(df, dy_at[k]);
      max_dy[k] = hn::Max(max_dy[k], MagnitudeBits(df, dy_at[k]));
      sq[k] = hn::MulAdd(xv, xv, sq[k]);
      xg[k] = hn::MulAdd(hn::Mul(xv, yv), g, xg[k]);
    }
  };
  auto flush = [&]() HWY_ATTR {
    for (size_t k = 0; k < R; ++k) {
      AddAsDouble(df, dd, sq[k], one, sq_lo[k], sq_hi[k]);
      AddAsDouble(df, dd, xg[k], one, xg_lo[k], xg_hi[k]);
      sq[k] = xg[k] = hn::Zero(df);
    }
  };
  size_t i = 0;
  const size_t flush_span = kTermsPerFlush * lanes;
  for (; i + flush_span <= tail; ) {
    for (size_t end = i + flush_span; i < end; i += lanes) {
      const T* x_at[R];
      const T* dy_at[R];
      for (size_t k = 0; k < R; ++k) {
        __builtin_prefetch(next_x[k] + i, 0, 2);
        x_at[k] = x[k] + i;
        dy_at[k] = dy[k] + i;
      }
      pass1_step(gamma + i, x_at, dy_at);
    }
    flush();
  }
  for (; i < tail; i += lanes) {
    const T* x_at[R];
    const T* dy_at[R];
    for (size_t k = 0; k < R; ++k) {
      x_at[k] = x[k] + i;
      dy_at[k] = dy[k] + i;
    }
    pass1_step(gamma + i, x_at, dy_at);
  }
  if (tail < h) {
    const T* x_at[R];
    const T* dy_at[R];
    for (size_t k = 0; k < R; ++k) {
      x_at[k] = tail_x[k];
      dy_at[k] = tail_dy[k];
    }
    pass1_step(tail_gamma, x_at, dy_at);
  }
  if (tail % flush_span != 0 || tail < h) flush();  // terms since the last flush

  RowFactors f[R];
  const double inv_h = 1.0 / static_cast<double>(h);
  for (size_t k = 0; k < R; ++k) {
    const double sum_sq = hn::GetLane(hn::SumOfLanes(dd, hn::Add(sq_lo[k], sq_hi[k])));
    const double sum_xdyg = hn::GetLane(hn::SumOfLanes(dd, hn::Add(xg_lo[k], xg_hi[k])));
    const hn::Rebind<uint32_t, decltype(df)> du32;
    const auto max_bits = hn::GetLane(hn::MaxOfLanes(du32, hn::PromoteTo(du32, max_dy[k])));
    f[k] = FactorsOf(b, r + k, inv_h, sum_sq, sum_xdyg,
                     MagnitudeOf<T>(static_cast<uint16_t>(max_bits)), max_gamma);
    if (!f[k].safe) return false;
  }

  // Pass 2 (the rows are in L1/L2): dx = (gamma*dy) * inv_rms - x * correction, and grad_gamma
  // += (dy*x) * inv_rms in double. Every row's loads come before the first store (dx may be dy).
  VF inv_v[R], corr_v[R];
  VD inv_d[R];
  for (size_t k = 0; k < R; ++k) {
    inv_v[k] = hn::Set(df, f[k].inv_rms_f32);
    corr_v[k] = hn::Set(df, f[k].correction);
    inv_d[k] = hn::Set(dd, f[k].inv_rms);
  }
  auto pass2_step = [&](const float* HWY_RESTRICT g_at, double* HWY_RESTRICT dg_at,
                        const T* const* x_at, const T* const* dy_at, T* const* dx_at) HWY_ATTR {
    const VF g = hn::LoadU(df, g_at);
    VD dg_lo, dg_hi;
    if (kAccumulate) {
      dg_lo = hn::LoadU(dd, dg_at);
      dg_hi = hn::LoadU(dd, dg_at + half);
    }
    VF xs[R], ys[R];
    HWY_UNROLL(4)
    for (size_t k = 0; k < R; ++k) {
      xs[k] = LoadF32(df, x_at[k]);
      ys[k] = LoadF32(df, dy_at[k]);
    }
    HWY_UNROLL(4)
    for (size_t k = 0; k < R; ++k) {
      StoreAs<kStream>(df, hn::NegMulAdd(xs[k], corr_v[k], hn::Mul(hn::Mul(g, ys[k]), inv_v[k])),
              dx_at[k]);
      if (kAccumulate) AddAsDouble(df, dd, hn::Mul(ys[k], xs[k]), inv_d[k], dg_lo, dg_hi);
    }
    if (kAccumulate) {
      hn::StoreU(dg_lo, dd, dg_at);
      hn::StoreU(dg_hi, dd, dg_at + half);
    }
  };
  for (i = 0; i < tail; i += lanes) {
    const T* x_at[R];
    const T* dy_at[R];
    T* dx_at[R];
    for (size_t k = 0; k < R; ++k) {
      __builtin_prefetch(next_dy[k] + i, 0, 2);
      x_at[k] = x[k] + i;
      dy_at[k] = dy[k] + i;
      dx_at[k] = dx[k] + i;
    }
    pass2_step(gamma + i, kAccumulate ? dgamma + i : nullptr, x_at, dy_at, dx_at);
  }
  if (tail < h) {
    HWY_ALIGN T tail_dx[R][hn::MaxLanes(df)];
    HWY_ALIGN double tail_dgamma[hn::MaxLanes(df)] = {};
    if (kAccumulate) std::memcpy(tail_dgamma, dgamma + tail, (h - tail) * sizeof(double));
    const T* x_at[R];
    const T* dy_at[R];
    T* dx_at[R];
    for (size_t k = 0; k < R; ++k) {
      x_at[k] = tail_x[k];
      dy_at[k] = tail_dy[k];
      dx_at[k] = tail_dx[k];
    }
    pass2_step(tail_gamma, tail_dgamma, x_at, dy_at, dx_at);  // never with kStream (no tail)
    for (size_t k = 0; k < R; ++k) std::memcpy(dx[k] + tail, tail_dx[k], (h - tail) * sizeof(T));
    if (kAccumulate) std::memcpy(dgamma + tail, tail_dgamma, (h - tail) * sizeof(double));
  }
  return true;
}

// Rows [r, r + n) one at a time, each in f32 where safe, else in double.
template <typename T, bool kStream, bool kAccumulate>
void RowsOneByOne(const RowBlock& b, double max_gamma, size_t r, size_t n) {
  for (size_t k = r; k < r + n; ++k) {
    if (GroupInF32<T, 1, kStream, kAccumulate>(b, max_gamma, k, b.num_rows - k - 1)) continue;
    RowBlock row = b;
    const size_t bytes = b.hidden_dim * sizeof(T);
    row.x = static_cast<const uint8_t*>(b.x) + k * bytes;
    row.dy = static_cast<const uint8_t*>(b.dy) + k * bytes;
    row.dx = static_cast<uint8_t*>(b.dx) + k * bytes;
    row.rms = b.rms != nullptr ? b.rms + k : nullptr;
    row.num_rows = 1;
    BackwardRowsInDouble(row);
  }
}

template <typename T, bool kStream, bool kAccumulate>
void HalfRows(const RowBlock& b, double max_gamma) {
  // Groups as host_rows' double path forms them (row_grouping.h): a group with a row that is
  // not safe in f32 goes again row by row, so every row's bits are the same in any group.
  const size_t group = RowsPerGroup(b.hidden_dim, sizeof(T));
  size_t r = 0;
  if (group == 4) {
    for (; r + 4 <= b.num_rows; r += 4) {
      if (!GroupInF32<T, 4, kStream, kAccumulate>(b, max_gamma, r, b.num_rows - r - 4)) {
        RowsOneByOne<T, kStream, kAccumulate>(b, max_gamma, r, 4);
      }
    }
  }
  if (group >= 2) {
    for (; r + 2 <= b.num_rows; r += 2) {
      if (!GroupInF32<T, 2, kStream, kAccumulate>(b, max_gamma, r, b.num_rows - r - 2)) {
        RowsOneByOne<T, kStream, kAccumulate>(b, max_gamma, r, 2);
      }
    }
  }
  RowsOneByOne<T, kStream, kAccumulate>(b, max_gamma, r, b.num_rows - r);
}

// Whether dx goes to memory with non-temporal stores: when the caller asks (RowBlock::stream_dx),
// every row's dx starts on a store's alignment (whole vectors, no tail), and a group's rows do
// not alias modulo 4 KiB where the L1 does not tolerate it (row_grouping.h: on an 8-way L1, bf16
// rows of 2048 elements and more that alias streamed at 2.4 GB/s against 14 stored).
template <typename T>
bool StreamsDx(const RowBlock& b) {
  const size_t lanes = hn::Lanes(hn::ScalableTag<float>());
  const size_t row_bytes = b.hidden_dim * sizeof(T);
  return b.stream_dx && b.hidden_dim % lanes == 0 &&
         reinterpret_cast<uintptr_t>(b.dx) % (lanes * sizeof(T)) == 0 &&
         (ToleratesAliasedRows() ||
          !GroupRowsAlias(row_bytes, RowsPerGroup(b.hidden_dim, sizeof(T))));
}

template <typename T>
void HalfRowsOf(const RowBlock& b, double max_gamma) {
  const bool stream = StreamsDx<T>(b);
  if (b.dgamma != nullptr) {
    stream ? HalfRows<T, true, true>(b, max_gamma) : HalfRows<T, false, true>(b, max_gamma);
  } else {
    stream ? HalfRows<T, true, false>(b, max_gamma) : HalfRows<T, false, false>(b, max_gamma);
  }
  if (stream) hwy::FlushStream();
}

void BackwardHalfRowsImpl(const RowBlock& block) {
  RowBlock b = block;
  std::vector<float> scale;  // the scale as f32 when the caller gave it as double only
  if (b.gamma == nullptr) {
    scale.assign(b.gamma_f64, b.gamma_f64 + b.hidden_dim);
    b.gamma = scale.data();
  }
  const double max_gamma =
      b.gamma_max_abs >= 0 ? b.gamma_max_abs : MaxAbsScale(b.gamma, b.hidden_dim);
  if (b.storage == kernels::DType::kBF16) {
    HalfRowsOf<hwy::bfloat16_t>(b, max_gamma);
  } else {
    HalfRowsOf<hwy::float16_t>(b, max_gamma);
  }
}

#else  // HWY_SCALAR: one lane; the double path.

void BackwardHalfRowsImpl(const RowBlock& b) { BackwardRowsInDouble(b); }

#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace HWY_NAMESPACE
}  // namespace normgrad::server::host_rows::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace normgrad::server::host_rows::internal {

HWY_EXPORT(BackwardHalfRowsImpl);

void BackwardHalfRows(const RowBlock& block) {
  HWY_DYNAMIC_DISPATCH(BackwardHalfRowsImpl)(block);
}

}  // namespace normgrad::server::host_rows::internal
#endif  // HWY_ONCE
