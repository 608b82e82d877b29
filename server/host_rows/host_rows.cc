#include "server/host_rows/host_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "server/host_rows/host_rows.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace normgrad::server::host_rows {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One element the way the vector body computes it: dx = inv * fma(-x, c, g*dy) and
// dgamma = fma(dy*x, inv, dgamma), so heads and tails round exactly like the vector lanes
// on targets with FMA.
HWY_INLINE void ScalarElement(float xf, float yf, float gf, double inv_rms, double correction,
                              float* dx, double* dgamma) {
  const double x = xf, y = yf, g = gf;
  *dx = static_cast<float>(inv_rms * std::fma(-x, correction, g * y));
  *dgamma = std::fma(y * x, inv_rms, *dgamma);
}

void BackwardRowsF32Impl(const RowBlock& b) {
  const hn::ScalableTag<double> d;
  const hn::Rebind<float, decltype(d)> df;  // half-width f32 vectors, promoted to double
  const size_t lanes = hn::Lanes(d);
  const size_t h = b.hidden_dim;
  const double h_double = static_cast<double>(h);

  for (size_t r = 0; r < b.num_rows; ++r) {
    const float* HWY_RESTRICT x = b.x + r * h;
    const float* HWY_RESTRICT dy = b.dy + r * h;
    const float* HWY_RESTRICT gamma = b.gamma;
    float* HWY_RESTRICT dx = b.dx + r * h;
    double* HWY_RESTRICT dgamma = b.dgamma;

    // Pass 1: sum x^2 (unless the forward's rms is given) and sum x*dy*gamma, two
    // accumulators each for instruction-level parallelism.
    auto sq0 = hn::Zero(d), sq1 = hn::Zero(d), xg0 = hn::Zero(d), xg1 = hn::Zero(d);
    size_t i = 0;
    for (; i + 2 * lanes <= h; i += 2 * lanes) {
      const auto x0 = hn::PromoteTo(d, hn::LoadU(df, x + i));
      const auto x1 = hn::PromoteTo(d, hn::LoadU(df, x + i + lanes));
      const auto y0 = hn::PromoteTo(d, hn::LoadU(df, dy + i));
      const auto y1 = hn::PromoteTo(d, hn::LoadU(df, dy + i + lanes));
      const auto g0 = hn::PromoteTo(d, hn::LoadU(df, gamma + i));
      const auto g1 = hn::PromoteTo(d, hn::LoadU(df, gamma + i + lanes));
      sq0 = hn::MulAdd(x0, x0, sq0);
      sq1 = hn::MulAdd(x1, x1, sq1);
      xg0 = hn::MulAdd(hn::Mul(x0, y0), g0, xg0);
      xg1 = hn::MulAdd(hn::Mul(x1, y1), g1, xg1);
    }
    for (; i + lanes <= h; i += lanes) {
      const auto x0 = hn::PromoteTo(d, hn::LoadU(df, x + i));
      const auto y0 = hn::PromoteTo(d, hn::LoadU(df, dy + i));
      const auto g0 = hn::PromoteTo(d, hn::LoadU(df, gamma + i));
      sq0 = hn::MulAdd(x0, x0, sq0);
      xg0 = hn::MulAdd(hn::Mul(x0, y0), g0, xg0);
    }
    double sum_sq = hn::GetLane(hn::SumOfLanes(d, hn::Add(sq0, sq1)));
    double sum_xdyg = hn::GetLane(hn::SumOfLanes(d, hn::Add(xg0, xg1)));
    for (; i < h; ++i) {
      const double xi = x[i];
      sum_sq += xi * xi;
      sum_xdyg += xi * static_cast<double>(dy[i]) * static_cast<double>(gamma[i]);
    }

    const double rms = b.rms != nullptr ? static_cast<double>(b.rms[r])
                                        : std::sqrt(sum_sq / h_double + static_cast<double>(b.eps));
    const double inv_rms = 1.0 / rms;
    const double correction = inv_rms * inv_rms * (sum_xdyg / h_double);

    // Pass 2 (the row is still in L1/L2): dx = inv_rms * (gamma*dy - x*correction) and
    // dgamma += dy*x*inv_rms.
    const auto inv_v = hn::Set(d, inv_rms);
    const auto corr_v = hn::Set(d, correction);
    // Scalar head up to the vector alignment of dx when streaming (same operations as the
    // vector body, fused the same way, so an element's bits do not depend on its address).
    i = 0;
    if (b.stream_dx) {
      const size_t misalign = reinterpret_cast<uintptr_t>(dx) % (lanes * sizeof(float));
      size_t head = misalign == 0 ? 0 : (lanes * sizeof(float) - misalign) / sizeof(float);
      head = std::min(head, h);
      for (; i < head; ++i)
        ScalarElement(x[i], dy[i], gamma[i], inv_rms, correction, dx + i, dgamma + i);
      for (; i + lanes <= h; i += lanes) {
        const auto x0 = hn::PromoteTo(d, hn::LoadU(df, x + i));
        const auto y0 = hn::PromoteTo(d, hn::LoadU(df, dy + i));
        const auto g0 = hn::PromoteTo(d, hn::LoadU(df, gamma + i));
        const auto dx0 = hn::Mul(inv_v, hn::NegMulAdd(x0, corr_v, hn::Mul(g0, y0)));
        hn::Stream(hn::DemoteTo(df, dx0), df, dx + i);
        hn::StoreU(hn::MulAdd(hn::Mul(y0, x0), inv_v, hn::LoadU(d, dgamma + i)), d, dgamma + i);
      }
    } else {
      for (; i + lanes <= h; i += lanes) {
        const auto x0 = hn::PromoteTo(d, hn::LoadU(df, x + i));
        const auto y0 = hn::PromoteTo(d, hn::LoadU(df, dy + i));
        const auto g0 = hn::PromoteTo(d, hn::LoadU(df, gamma + i));
        const auto dx0 = hn::Mul(inv_v, hn::NegMulAdd(x0, corr_v, hn::Mul(g0, y0)));
        hn::StoreU(hn::DemoteTo(df, dx0), df, dx + i);
        hn::StoreU(hn::MulAdd(hn::Mul(y0, x0), inv_v, hn::LoadU(d, dgamma + i)), d, dgamma + i);
      }
    }
    for (; i < h; ++i)
      ScalarElement(x[i], dy[i], gamma[i], inv_rms, correction, dx + i, dgamma + i);
  }
  if (b.stream_dx) hwy::FlushStream();
}

// Vector conversions; a tail shorter than a vector goes through a zero-padded local buffer so
// that every element takes the same (vector) rounding path.
template <typename T>
void PromoteToF32(const T* HWY_RESTRICT src, float* HWY_RESTRICT dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<T, decltype(df)> dt;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dt, src + i)), df, dst + i);
  if (i < n) {
    HWY_ALIGN T in[hn::MaxLanes(df)] = {};
    HWY_ALIGN float out[hn::MaxLanes(df)];
    std::memcpy(in, src + i, (n - i) * sizeof(T));
    hn::Store(hn::PromoteTo(df, hn::Load(dt, in)), df, out);
    std::memcpy(dst + i, out, (n - i) * sizeof(float));
  }
}

template <typename T>
void DemoteFromF32(const float* HWY_RESTRICT src, T* HWY_RESTRICT dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<T, decltype(df)> dt;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(hn::DemoteTo(dt, hn::LoadU(df, src + i)), dt, dst + i);
  if (i < n) {
    HWY_ALIGN float in[hn::MaxLanes(df)] = {};
    HWY_ALIGN T out[hn::MaxLanes(df)];
    std::memcpy(in, src + i, (n - i) * sizeof(float));
    hn::Store(hn::DemoteTo(dt, hn::Load(df, in)), dt, out);
    std::memcpy(dst + i, out, (n - i) * sizeof(T));
  }
}

void ConvertToF32Impl(kernels::DType dtype, const uint8_t* src, float* dst, size_t n) {
  switch (dtype) {
    case kernels::DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case kernels::DType::kBF16:
      PromoteToF32(reinterpret_cast<const hwy::bfloat16_t*>(src), dst, n);
      return;
    case kernels::DType::kF16:
      PromoteToF32(reinterpret_cast<const hwy::float16_t*>(src), dst, n);
      return;
  }
}

// f32 -> bf16 rounding to nearest even (Highway 1.0.3's DemoteTo truncates); NaN stays NaN.
HWY_ATTR HWY_INLINE hn::Vec<hn::Rebind<uint16_t, hn::ScalableTag<float>>> RoundToBF16Bits(
    hn::Vec<hn::ScalableTag<float>> v) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(lsb, hn::Set(du, 0x7fffu))));
  const auto nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x40u));  // quiet NaN
  const hn::RebindToSigned<decltype(df)> di;  // values are <= 0xffff: the signed demotion is exact
  return hn::DemoteTo(
      du16, hn::BitCast(di, hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), nan, rounded)));
}

void DemoteToBF16(const float* HWY_RESTRICT src, uint16_t* HWY_RESTRICT dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(RoundToBF16Bits(hn::LoadU(df, src + i)), du16, dst + i);
  if (i < n) {
    HWY_ALIGN float in[hn::MaxLanes(df)] = {};
    HWY_ALIGN uint16_t out[hn::MaxLanes(df)];
    std::memcpy(in, src + i, (n - i) * sizeof(float));
    hn::Store(RoundToBF16Bits(hn::Load(df, in)), du16, out);
    std::memcpy(dst + i, out, (n - i) * sizeof(uint16_t));
  }
}

void ConvertFromF32Impl(kernels::DType dtype, const float* src, uint8_t* dst, size_t n) {
  switch (dtype) {
    case kernels::DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case kernels::DType::kBF16:
      DemoteToBF16(src, reinterpret_cast<uint16_t*>(dst), n);
      return;
    case kernels::DType::kF16:
      DemoteFromF32(src, reinterpret_cast<hwy::float16_t*>(dst), n);
      return;
  }
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace normgrad::server::host_rows
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace normgrad::server::host_rows {

HWY_EXPORT(BackwardRowsF32Impl);
HWY_EXPORT(ConvertToF32Impl);
HWY_EXPORT(ConvertFromF32Impl);
HWY_EXPORT(TargetNameImpl);

void BackwardRowsF32(const RowBlock& block) { HWY_DYNAMIC_DISPATCH(BackwardRowsF32Impl)(block); }

void ConvertToF32(kernels::DType dtype, const uint8_t* src, float* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(ConvertToF32Impl)(dtype, src, dst, n);
}

void ConvertFromF32(kernels::DType dtype, const float* src, uint8_t* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(ConvertFromF32Impl)(dtype, src, dst, n);
}

std::string SimdTargetName() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

}  // namespace normgrad::server::host_rows
#endif  // HWY_ONCE
