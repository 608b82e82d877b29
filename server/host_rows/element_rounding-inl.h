// f32 <-> bf16/f16 in registers on every Highway target, for host_rows.cc, half_rows.cc and
// element_conversion.cc (included once per target, after hwy/highway.h): rounding to nearest
// even (Highway 1.0.3's own DemoteTo truncates for bf16, and for f16 on targets without F16C,
// SSE4, SSSE3 and EMU128, where it also turns values beyond f16's range into 65504 instead of
// infinity), and whole buffers converted a vector at a time.

// Per-target include guard (Highway's -inl.h convention).
#if defined(NORMGRAD_HOST_ROWS_ELEMENT_ROUNDING_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef NORMGRAD_HOST_ROWS_ELEMENT_ROUNDING_INL_H_
#undef NORMGRAD_HOST_ROWS_ELEMENT_ROUNDING_INL_H_
#else
#define NORMGRAD_HOST_ROWS_ELEMENT_ROUNDING_INL_H_
#endif

#include <cstring>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace normgrad::server::host_rows {
namespace HWY_NAMESPACE {
namespace rounding {
namespace hn = hwy::HWY_NAMESPACE;

// The bf16 bits of f32 lanes rounded to nearest even; NaN stays NaN (quiet).
template <class DF>
HWY_INLINE hn::Vec<hn::Rebind<uint16_t, DF>> ToBF16Bits(DF df, hn::Vec<DF> v) {
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

// f32 lanes as f16, rounded to nearest even, beyond 65504 infinite, NaN a quiet NaN: the
// hardware's conversion where the target has F16C (AVX2 and up), else the same result in integer
// and f32 operations (the method of Maratyszcza's FP16 library: scaling |v| up by 2^112 and down
// by 2^-110 makes f32's own rounding round at f16's last bit, subnormals included).
template <class DF>
HWY_INLINE hn::Vec<hn::Rebind<hwy::float16_t, DF>> ToF16(DF df, hn::Vec<DF> v) {
  const hn::Rebind<hwy::float16_t, DF> dh;
#if HWY_TARGET >= HWY_SSE4 || defined(HWY_DISABLE_F16C)
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> du16;
  const auto w = hn::BitCast(du, v);
  const auto shl1_w = hn::Add(w, w);
  const auto sign = hn::And(w, hn::Set(du, 0x80000000u));
  auto base = hn::Mul(hn::Mul(hn::Abs(v), hn::Set(df, 0x1.0p+112f)), hn::Set(df, 0x1.0p-110f));
  const auto bias = hn::Max(hn::And(shl1_w, hn::Set(du, 0xFF000000u)), hn::Set(du, 0x71000000u));
  base = hn::Add(hn::BitCast(df, hn::Add(hn::ShiftRight<1>(bias), hn::Set(du, 0x07800000u))), base);
  const auto bits = hn::BitCast(du, base);
  const auto exp_bits = hn::And(hn::ShiftRight<13>(bits), hn::Set(du, 0x00007C00u));
  const auto mantissa_bits = hn::And(bits, hn::Set(du, 0x00000FFFu));
  const auto nonsign = hn::Add(exp_bits, mantissa_bits);
  const auto is_nan = shl1_w > hn::Set(du, 0xFF000000u);
  const auto h = hn::Or(hn::ShiftRight<16>(sign),
                        hn::IfThenElse(is_nan, hn::Set(du, 0x7E00u), nonsign));
  // Values are <= 0xffff: the signed demotion is exact.
  return hn::BitCast(dh, hn::DemoteTo(du16, hn::BitCast(di, h)));
#else
  return hn::DemoteTo(dh, v);
#endif
}

// dst[i] = convert(src[i]), a vector of the f32 tag's lane count at a time; a tail shorter than a
// vector goes through a zero-padded local buffer so that every element takes the same (vector)
// rounding path. kPartial: the caller promises n < one vector (a row's tail), and there is no
// vector loop (which the compiler would otherwise check against the caller's small buffers).
template <bool kPartial, typename From, typename To, class Convert>
HWY_ATTR HWY_INLINE void ConvertLanes(const From* HWY_RESTRICT src, To* HWY_RESTRICT dst, size_t n,
                                      Convert convert) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<From, decltype(df)> d_from;
  const hn::Rebind<To, decltype(df)> d_to;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  if constexpr (!kPartial) {
    for (; i + lanes <= n; i += lanes) {
      hn::StoreU(convert(hn::LoadU(d_from, src + i)), d_to, dst + i);
    }
  }
  if (i < n) {
    HWY_ALIGN From in[hn::MaxLanes(df)] = {};
    HWY_ALIGN To out[hn::MaxLanes(df)];
    std::memcpy(in, src + i, (n - i) * sizeof(From));
    hn::Store(convert(hn::Load(d_from, in)), d_to, out);
    std::memcpy(dst + i, out, (n - i) * sizeof(To));
  }
}

template <bool kPartial = false, typename T>
void PromoteToF32(const T* HWY_RESTRICT src, float* HWY_RESTRICT dst, size_t n) {
  ConvertLanes<kPartial>(
      src, dst, n, [](auto v) HWY_ATTR { return hn::PromoteTo(hn::ScalableTag<float>(), v); });
}

template <bool kPartial = false>
void DemoteFromF32(const float* HWY_RESTRICT src, hwy::float16_t* HWY_RESTRICT dst, size_t n) {
  ConvertLanes<kPartial>(src, dst, n, [](auto v) HWY_ATTR {
    return ToF16(hn::ScalableTag<float>(), v);
  });
}

template <bool kPartial = false>
void DemoteFromF32(const float* HWY_RESTRICT src, hwy::bfloat16_t* HWY_RESTRICT dst, size_t n) {
  ConvertLanes<kPartial>(src, reinterpret_cast<uint16_t*>(dst), n, [](auto v) HWY_ATTR {
    return ToBF16Bits(hn::ScalableTag<float>(), v);
  });
}

}  // namespace rounding
}  // namespace HWY_NAMESPACE
}  // namespace normgrad::server::host_rows
HWY_AFTER_NAMESPACE();

#endif  // NORMGRAD_HOST_ROWS_ELEMENT_ROUNDING_INL_H_
