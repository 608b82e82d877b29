// IEEE binary16 <-> float32 in software, round to nearest even: the interpreter's f16 semantics
// and the f16 test problems' rounding. Portable C++ (no _Float16, which GCC has on x86 and
// clang 14 does not), so every compiler of the project's trees builds them.
#ifndef NORMGRAD_TESTS_PTXSIM_FLOAT16_H_
#define NORMGRAD_TESTS_PTXSIM_FLOAT16_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace normgrad::ptxsim {

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float magnitude = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
  } else {
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13))
                     : (sign | ((exp + 112) << 23) | (man << 13));
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00u;
  const float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds to infinity
  if (a < std::ldexp(1.0f, -14)) {           // subnormal half: multiple of 2^-24
    const float scaled = std::nearbyint(a * std::ldexp(1.0f, 24));
    return sign | static_cast<uint16_t>(scaled);
  }
  int e;
  const float m = std::frexp(a, &e);         // a = m * 2^e, m in [0.5, 1)
  float mant = std::nearbyint(m * 2048.0f);  // 11 significant bits
  if (mant >= 2048.0f) {
    mant /= 2.0f;
    ++e;
  }
  const uint32_t exp = static_cast<uint32_t>(e - 1 + 15);
  return sign | static_cast<uint16_t>((exp << 10) | (static_cast<uint32_t>(mant) & 0x3ffu));
}

}  // namespace normgrad::ptxsim

#endif  // NORMGRAD_TESTS_PTXSIM_FLOAT16_H_
