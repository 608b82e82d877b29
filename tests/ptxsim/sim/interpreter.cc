// SIMT execution model (see docs/ptxsim.md for the why):
//  - A warp is a sorted list of groups (pc, lane mask). Each step runs the group with the lowest
//    pc; when a group's pc reaches another group's pc the two merge. This is the "minimum-PC"
//    reconvergence rule: for the structured code compilers emit, lanes that took different
//    sides of a branch meet again at the first instruction both reach, i.e. the immediate
//    post-dominator, without a CFG analysis and with loops handled naturally.
//  - Registers are slot-major arrays of 32 lanes (regs[slot * 32 + lane]); a 32-bit mask per
//    slot records which lanes have written it (the uninitialized-read check is one AND).
//  - A group reaching bar.sync parks in the warp's waiting list. When no warp of the block can
//    run, the block is either finished, releasable (every thread waits at the same bar.sync), or
//    broken (a diagnosed barrier finding).
#include "tests/ptxsim/sim/interpreter.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tests/ptxsim/sim/float16.h"

namespace normgrad::ptxsim {

absl::string_view FindingName(Finding finding) {
  // Indexed by Finding.
  constexpr absl::string_view kNames[] = {
      "none",                            // kNone
      "invalid launch",                  // kInvalidLaunch
      "out-of-bounds access",            // kOutOfBounds
      "misaligned access",               // kMisaligned
      "shfl.sync member mask error",     // kShuffleMask
      "barrier error",                   // kBarrier
      "read of uninitialized register",  // kUninitializedRegister
      "non-uniform bra.uni",             // kNonUniformBranch
      "instruction limit exceeded",      // kInstructionLimit
  };
  static_assert(std::size(kNames) == static_cast<size_t>(Finding::kInstructionLimit) + 1,
                "one name per Finding");
  const size_t i = static_cast<size_t>(finding);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

namespace {

// Generic addresses in [kSharedWindow, kSharedWindow + 4 GiB) name shared memory; user-space
// host addresses (what device pointers are here) stay below 2^47.
constexpr uint64_t kSharedWindow = uint64_t{1} << 48;

inline float AsF32(uint64_t v) { return absl::bit_cast<float>(static_cast<uint32_t>(v)); }
inline uint64_t F32Bits(float f) { return absl::bit_cast<uint32_t>(f); }
inline double AsF64(uint64_t v) { return absl::bit_cast<double>(v); }
inline uint64_t F64Bits(double d) { return absl::bit_cast<uint64_t>(d); }
inline float Ftz(float f) {
  return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f;
}
// .sat: clamps to [0, 1], NaN to 0.
template <typename F>
F Sat(F f) {
  return std::isnan(f) ? F{0} : std::min(F{1}, std::max(F{0}, f));
}

inline uint32_t Popcount(uint32_t v) {
  v = v - ((v >> 1) & 0x55555555u);
  v = (v & 0x33333333u) + ((v >> 2) & 0x33333333u);
  return (((v + (v >> 4)) & 0x0f0f0f0fu) * 0x01010101u) >> 24;
}

inline int64_t SignExtend(uint64_t v, int bits) {
  if (bits >= 64) return static_cast<int64_t>(v);
  const uint64_t m = uint64_t{1} << (bits - 1);
  v &= (uint64_t{1} << bits) - 1;
  return static_cast<int64_t>((v ^ m) - m);
}
inline uint64_t Mask(int bits) { return bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1; }

// IEEE binary16 (tests/ptxsim/sim/float16.h) / bfloat16 <-> f32, round to nearest even.
float Bf16ToFloat(uint16_t b) { return AsF32(static_cast<uint32_t>(b) << 16); }
uint16_t FloatToBf16(float f) {
  const uint32_t u = static_cast<uint32_t>(F32Bits(f));
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// The exact value of a result rounded toward zero / -inf / +inf (mode), from `nearest`, that value
// rounded to nearest even (and not equal to it): infinity when it overflowed, else the
// representable neighbour on the side `exact_above` says is the exact value's.
template <typename F>
F RoundFromNearest(F nearest, bool exact_above, FloatRound mode) {
  const F max = std::numeric_limits<F>::max();
  const F inf = std::numeric_limits<F>::infinity();
  if (std::isinf(nearest)) {  // overflowed while rounding to nearest: the sign is the exact one's
    const bool positive = nearest > 0;
    switch (mode) {
      case FloatRound::kRz:
        return positive ? max : -max;
      case FloatRound::kRm:
        return positive ? max : -inf;
      case FloatRound::kRp:
        return positive ? inf : -max;
      case FloatRound::kRn:
        break;
    }
    return nearest;
  }
  switch (mode) {
    case FloatRound::kRz:
      if (nearest > 0 && !exact_above) return std::nextafter(nearest, F{0});
      if (nearest < 0 && exact_above) return std::nextafter(nearest, F{0});
      if (nearest == 0) return exact_above ? F{0} : -F{0};
      return nearest;
    case FloatRound::kRm:
      return exact_above ? nearest : std::nextafter(nearest, -inf);
    case FloatRound::kRp:
      return exact_above ? std::nextafter(nearest, inf) : nearest;
    case FloatRound::kRn:
      break;
  }
  return nearest;
}

// `exact` (representable in long double: every integer up to 64 bits, every f32/f64) rounded to
// F in `mode`.
template <typename F>
F RoundLongDouble(long double exact, FloatRound mode) {
  const F f = static_cast<F>(exact);  // round to nearest even
  if (mode == FloatRound::kRn || std::isnan(exact) || static_cast<long double>(f) == exact)
    return f;
  return RoundFromNearest(f, exact > static_cast<long double>(f), mode);
}

// hi + lo (two doubles, |lo| tiny against hi or hi already exact) rounded to f32 in `mode`.
float RoundTwoDoubles(double hi, double lo, FloatRound mode) {
  if (std::isnan(hi) || std::isinf(hi)) return static_cast<float>(hi);
  const float f = static_cast<float>(hi);
  if (std::isinf(f)) return RoundFromNearest(f, /*exact_above=*/false, mode);  // overflowed
  const double side = (hi - static_cast<double>(f)) + lo;  // hi - f is exact (Sterbenz)
  if (side == 0) return f;
  return RoundFromNearest(f, side > 0, mode);
}

// f32 add/sub/mul/div/sqrt/rcp/fma with .rz/.rm/.rp: the exact result as hi + lo (error-free
// transformations in double), then rounded once in the asked direction.
float DirectedF32(Op op, float a, float b, float c, FloatRound mode) {
  const double da = a, db = b, dc = c;
  auto two_sum = [](double x, double y, double* lo) {
    const double s = x + y;
    const double yy = s - x;
    *lo = (x - (s - yy)) + (y - yy);
    return s;
  };
  double hi = 0, lo = 0;
  switch (op) {
    case Op::kAdd:
      hi = two_sum(da, db, &lo);
      break;
    case Op::kSub:
      hi = two_sum(da, -db, &lo);
      break;
    case Op::kMul:
      hi = da * db;
      break;  // 48-bit product: exact in double
    case Op::kMad:
    case Op::kFma:
      hi = two_sum(da * db, dc, &lo);
      break;
    case Op::kRcp:
    case Op::kDiv: {
      const double num = op == Op::kRcp ? 1.0 : da;
      const double den = op == Op::kRcp ? da : db;
      hi = num / den;
      if (std::isfinite(hi) && den != 0) lo = std::fma(-hi, den, num) / den;  // exact remainder
      break;
    }
    case Op::kSqrt:
      hi = std::sqrt(da);
      if (hi > 0 && std::isfinite(hi)) lo = std::fma(-hi, hi, da) / (2 * hi);
      break;
    default:
      break;
  }
  return RoundTwoDoubles(hi, lo, mode);
}

// Source value of cvt as double (floats) or int64 (integers, extended per signedness).
double CvtSourceAsDouble(uint64_t v, Type t) {
  switch (t) {
    case Type::kF16:
      return HalfToFloat(static_cast<uint16_t>(v));
    case Type::kBF16:
      return Bf16ToFloat(static_cast<uint16_t>(v));
    case Type::kF32:
      return AsF32(v);
    case Type::kF64:
      return AsF64(v);
    default:
      break;
  }
  return IsSigned(t) ? static_cast<double>(SignExtend(v, TypeBits(t)))
                     : static_cast<double>(v & Mask(TypeBits(t)));
}

double RoundIntegral(double d, IntRound r) {
  switch (r) {
    case IntRound::kRni:
      return std::nearbyint(d);
    case IntRound::kRzi:
      return std::trunc(d);
    case IntRound::kRmi:
      return std::floor(d);
    case IntRound::kRpi:
      return std::ceil(d);
    case IntRound::kNone:
      break;
  }
  return d;
}

uint64_t Convert(const Instruction& in, uint64_t v) {
  const Type dt = in.type;
  const Type st = in.src_type;
  const int db = TypeBits(dt);
  const IntRound ir = static_cast<IntRound>(in.mode);
  if (IsFloat(dt) && in.rounding != FloatRound::kRn && ir == IntRound::kNone) {
    const long double exact = IsFloat(st)    ? static_cast<long double>(CvtSourceAsDouble(v, st))
                              : IsSigned(st) ? static_cast<long double>(SignExtend(v, TypeBits(st)))
                                             : static_cast<long double>(v & Mask(TypeBits(st)));
    if (dt == Type::kF64) return F64Bits(RoundLongDouble<double>(exact, in.rounding));
    float f = RoundLongDouble<float>(exact, in.rounding);
    if (in.ftz) f = Ftz(f);
    if (in.sat) f = Sat(f);
    return F32Bits(f);
  }
  if (IsFloat(dt)) {
    if (!IsFloat(st)) {
      // Integer -> float, round to nearest (C++'s conversion under the default rounding mode).
      if (dt == Type::kF64) {
        return F64Bits(IsSigned(st) ? static_cast<double>(SignExtend(v, TypeBits(st)))
                                    : static_cast<double>(v & Mask(TypeBits(st))));
      }
      float f = IsSigned(st) ? static_cast<float>(SignExtend(v, TypeBits(st)))
                             : static_cast<float>(v & Mask(TypeBits(st)));
      if (dt == Type::kF32) {
        if (in.sat) f = Sat(f);
        return F32Bits(f);
      }
      return dt == Type::kF16 ? FloatToHalf(f) : FloatToBf16(f);
    }
    double d = CvtSourceAsDouble(v, st);
    if (ir != IntRound::kNone) d = RoundIntegral(d, ir);
    if (dt == Type::kF64) return F64Bits(d);
    float f = static_cast<float>(d);  // exact for widening, round-to-nearest for f64 -> f32
    if (in.ftz) f = Ftz(f);
    if (in.sat) f = Sat(f);
    if (dt == Type::kF32) return F32Bits(f);
    return dt == Type::kF16 ? FloatToHalf(f) : FloatToBf16(f);
  }
  if (IsFloat(st)) {
    // Float -> integer: round as asked, NaN -> 0, saturate to the destination's range.
    double d = CvtSourceAsDouble(v, st);
    if (std::isnan(d)) return 0;
    d = RoundIntegral(d, ir);
    if (IsSigned(dt)) {
      const double lo = -std::ldexp(1.0, db - 1);
      const double hi = std::ldexp(1.0, db - 1) - 1;
      if (d <= lo) return static_cast<uint64_t>(static_cast<int64_t>(lo)) & Mask(db);
      if (d >= hi) return (Mask(db) >> 1);
      return static_cast<uint64_t>(static_cast<int64_t>(d)) & Mask(db);
    }
    if (d <= 0) return 0;
    if (d >= std::ldexp(1.0, db)) return Mask(db);
    return static_cast<uint64_t>(d) & Mask(db);
  }
  // Integer -> integer: extend per the source's signedness, then truncate (or clamp with .sat).
  const int sb = TypeBits(st);
  if (in.sat) {
    const bool s_signed = IsSigned(st);
    const bool d_signed = IsSigned(dt);
    if (s_signed) {
      int64_t x = SignExtend(v, sb);
      const int64_t lo = d_signed ? -(int64_t{1} << (db - 1)) : 0;
      const int64_t hi = d_signed ? static_cast<int64_t>(Mask(db - 1))
                                  : static_cast<int64_t>(Mask(db) >> (db == 64));
      x = std::max(lo, std::min(hi, x));
      return static_cast<uint64_t>(x) & Mask(db);
    }
    uint64_t x = v & Mask(sb);
    const uint64_t hi = d_signed ? Mask(db - 1) : Mask(db);
    return std::min(x, hi);
  }
  const uint64_t x = IsSigned(st) ? static_cast<uint64_t>(SignExtend(v, sb)) : (v & Mask(sb));
  return x & Mask(db);
}

// An integer setp: ua, ub are the operands masked to the type's width, sa, sb the same
// sign-extended; the signed comparisons use them when `is_signed`.
inline bool CompareInts(Cmp c, bool is_signed, uint64_t ua, uint64_t ub, int64_t sa, int64_t sb) {
  switch (c) {
    case Cmp::kEq:
      return ua == ub;
    case Cmp::kNe:
      return ua != ub;
    case Cmp::kLt:
      return is_signed ? sa < sb : ua < ub;
    case Cmp::kLe:
      return is_signed ? sa <= sb : ua <= ub;
    case Cmp::kGt:
      return is_signed ? sa > sb : ua > ub;
    case Cmp::kGe:
      return is_signed ? sa >= sb : ua >= ub;
    case Cmp::kLo:
      return ua < ub;
    case Cmp::kLs:
      return ua <= ub;
    case Cmp::kHi:
      return ua > ub;
    case Cmp::kHs:
      return ua >= ub;
    default:
      return false;
  }
}

bool Compare(const Instruction& in, uint64_t a, uint64_t b) {
  const Cmp c = static_cast<Cmp>(in.mode);
  const Type t = in.type;
  if (IsFloat(t)) {
    double x, y;
    if (t == Type::kF32) {
      float fx = AsF32(a), fy = AsF32(b);
      if (in.ftz) {
        fx = Ftz(fx);
        fy = Ftz(fy);
      }
      x = fx;
      y = fy;
    } else {
      x = AsF64(a);
      y = AsF64(b);
    }
    const bool unordered = std::isnan(x) || std::isnan(y);
    switch (c) {
      case Cmp::kEq:
        return !unordered && x == y;
      case Cmp::kNe:
        return !unordered && x != y;
      case Cmp::kLt:
        return !unordered && x < y;
      case Cmp::kLe:
        return !unordered && x <= y;
      case Cmp::kGt:
        return !unordered && x > y;
      case Cmp::kGe:
        return !unordered && x >= y;
      case Cmp::kEqu:
        return unordered || x == y;
      case Cmp::kNeu:
        return unordered || x != y;
      case Cmp::kLtu:
        return unordered || x < y;
      case Cmp::kLeu:
        return unordered || x <= y;
      case Cmp::kGtu:
        return unordered || x > y;
      case Cmp::kGeu:
        return unordered || x >= y;
      case Cmp::kNum:
        return !unordered;
      case Cmp::kNan:
        return unordered;
      default:
        return false;
    }
  }
  const int bits = TypeBits(t);
  return CompareInts(c, IsSigned(t), a & Mask(bits), b & Mask(bits), SignExtend(a, bits),
                     SignExtend(b, bits));
}

// A float result rounded to nearest (.approx and .full are computed the same way: the correctly
// rounded result is within every error bound PTX documents for them). neg/abs are not here: they
// change the sign bit only.
template <typename F>
F RoundToNearestResult(Op op, F a, F b, F c) {
  switch (op) {
    case Op::kAdd:
      return a + b;
    case Op::kSub:
      return a - b;
    case Op::kMul:
      return a * b;
    case Op::kMad:
    case Op::kFma:
      return std::fma(a, b, c);
    case Op::kDiv:
      return a / b;
    case Op::kMin:
      return std::fmin(a, b);
    case Op::kMax:
      return std::fmax(a, b);
    case Op::kSqrt:
      return std::sqrt(a);
    case Op::kRsqrt:
      return static_cast<F>(1.0 / std::sqrt(static_cast<double>(a)));
    case Op::kRcp:
      return F{1} / a;
    case Op::kEx2:  // f32 only (the parser refuses f64)
      return static_cast<F>(std::exp2(static_cast<double>(a)));
    case Op::kLg2:  // likewise
      return static_cast<F>(std::log2(static_cast<double>(a)));
    default:
      return F{0};
  }
}

uint64_t FloatAlu32(const Instruction& in, uint64_t ra, uint64_t rb, uint64_t rc) {
  float a = AsF32(ra), b = AsF32(rb), c = AsF32(rc);
  if (in.ftz) {
    a = Ftz(a);
    b = Ftz(b);
    c = Ftz(c);
  }
  if (in.op == Op::kNeg) return F32Bits(a) ^ 0x80000000u;
  if (in.op == Op::kAbs) return F32Bits(a) & 0x7fffffffu;
  // .rz/.rm/.rp: the parser allows them on add/sub/mul/div/sqrt/rcp/fma/mad only.
  float r = in.rounding != FloatRound::kRn ? DirectedF32(in.op, a, b, c, in.rounding)
                                           : RoundToNearestResult(in.op, a, b, c);
  if (in.ftz) r = Ftz(r);
  if (in.sat) r = Sat(r);
  return F32Bits(r);
}

uint64_t FloatAlu64(const Instruction& in, uint64_t ra, uint64_t rb, uint64_t rc) {
  if (in.op == Op::kNeg) return ra ^ (uint64_t{1} << 63);
  if (in.op == Op::kAbs) return ra & ~(uint64_t{1} << 63);
  double r = RoundToNearestResult(in.op, AsF64(ra), AsF64(rb), AsF64(rc));
  if (in.sat) r = Sat(r);
  return F64Bits(r);
}

// min (or max) of a and b as `bits`-bit integers, signed or not.
inline uint64_t IntMinMax(bool max, bool is_signed, int bits, uint64_t a, uint64_t b) {
  const uint64_t m = Mask(bits);
  if (is_signed) {
    const int64_t x = SignExtend(a, bits), y = SignExtend(b, bits);
    return static_cast<uint64_t>(max ? std::max(x, y) : std::min(x, y)) & m;
  }
  return max ? std::max(a & m, b & m) : std::min(a & m, b & m);
}

uint64_t IntAlu(const Instruction& in, uint64_t a, uint64_t b, uint64_t c) {
  const Type t = in.type;
  const int bits = TypeBits(t);
  const bool s = IsSigned(t);
  const uint64_t m = Mask(bits);
  const MulMode mul = static_cast<MulMode>(in.mode);
  auto clamp_s32 = [](int64_t v) {
    return static_cast<uint64_t>(std::max<int64_t>(INT32_MIN, std::min<int64_t>(INT32_MAX, v))) &
           0xffffffffu;
  };
  auto product = [&](bool high) -> uint64_t {
    if (bits == 64) {
      const unsigned __int128 p =
          s ? static_cast<unsigned __int128>(static_cast<__int128>(static_cast<int64_t>(a)) *
                                             static_cast<__int128>(static_cast<int64_t>(b)))
            : static_cast<unsigned __int128>(a) * b;
      return static_cast<uint64_t>(high ? p >> 64 : p);
    }
    const uint64_t p =
        s ? static_cast<uint64_t>(SignExtend(a, bits) * SignExtend(b, bits)) : (a & m) * (b & m);
    return high ? (p >> bits) & m : p & m;
  };
  switch (in.op) {
    case Op::kAdd:
      if (in.sat) return clamp_s32(SignExtend(a, 32) + SignExtend(b, 32));
      return (a + b) & m;
    case Op::kSub:
      if (in.sat) return clamp_s32(SignExtend(a, 32) - SignExtend(b, 32));
      return (a - b) & m;
    case Op::kMul:
      if (mul == MulMode::kWide) {
        return s ? static_cast<uint64_t>(SignExtend(a, bits) * SignExtend(b, bits)) & Mask(2 * bits)
                 : ((a & m) * (b & m)) & Mask(2 * bits);
      }
      return product(mul == MulMode::kHi);
    case Op::kMad:
      if (mul == MulMode::kWide) {
        const uint64_t p = s ? static_cast<uint64_t>(SignExtend(a, bits) * SignExtend(b, bits))
                             : (a & m) * (b & m);
        return (p + c) & Mask(2 * bits);
      }
      if (in.sat)
        return clamp_s32(static_cast<int64_t>(SignExtend(product(false), 32)) + SignExtend(c, 32));
      return (product(mul == MulMode::kHi) + c) & m;
    case Op::kDiv:
      if ((b & m) == 0) return m;  // undefined in PTX; all ones, like the hardware's u32 result
      if (s) {
        const int64_t x = SignExtend(a, bits), y = SignExtend(b, bits);
        if (y == -1) return static_cast<uint64_t>(-static_cast<uint64_t>(x)) & m;
        return static_cast<uint64_t>(x / y) & m;
      }
      return (a & m) / (b & m);
    case Op::kRem:
      if ((b & m) == 0) return a & m;
      if (s) {
        const int64_t x = SignExtend(a, bits), y = SignExtend(b, bits);
        if (y == -1) return 0;
        return static_cast<uint64_t>(x % y) & m;
      }
      return (a & m) % (b & m);
    case Op::kMin:
    case Op::kMax:
      return IntMinMax(in.op == Op::kMax, s, bits, a, b);
    case Op::kNeg:
      return (~a + 1) & m;
    case Op::kAbs: {
      const int64_t x = SignExtend(a, bits);
      return static_cast<uint64_t>(x < 0 ? -x : x) & m;
    }
    case Op::kAnd:
      return a & b & m;
    case Op::kOr:
      return (a | b) & m;
    case Op::kXor:
      return (a ^ b) & m;
    case Op::kNot:
      return t == Type::kPred ? (a & 1) ^ 1 : ~a & m;
    case Op::kCnot:
      return (a & m) == 0 ? 1 : 0;
    case Op::kShl: {
      const uint64_t n = b & 0xffffffffu;
      return n >= static_cast<uint64_t>(bits) ? 0 : (a << n) & m;
    }
    case Op::kShr: {
      const uint64_t n = std::min<uint64_t>(b & 0xffffffffu, bits);
      if (s) {
        const int64_t x = SignExtend(a, bits);
        return static_cast<uint64_t>(n >= 64 ? (x < 0 ? -1 : 0)
                                             : (x >> std::min<uint64_t>(n, 63))) &
               m;
      }
      return n >= static_cast<uint64_t>(bits) ? 0 : (a & m) >> n;
    }
    case Op::kPopc:
      return static_cast<uint64_t>(__builtin_popcountll(a & m));
    case Op::kClz: {
      const uint32_t x = static_cast<uint32_t>(a);
      return x == 0 ? 32 : static_cast<uint64_t>(__builtin_clz(x));
    }
    default:
      break;
  }
  return 0;
}

struct Group {
  uint32_t pc;
  uint32_t mask;
};

struct WarpState {
  uint32_t present = 0;  // lanes that exist (the last warp of a block may be partial)
  uint32_t exited = 0;
  std::vector<Group> groups;   // runnable, sorted by pc, distinct pcs
  std::vector<Group> waiting;  // parked at bar.sync
};

void InsertGroup(std::vector<Group>& groups, uint32_t pc, uint32_t mask) {
  auto it = std::lower_bound(groups.begin(), groups.end(), pc,
                             [](const Group& g, uint32_t p) { return g.pc < p; });
  if (it != groups.end() && it->pc == pc) {
    it->mask |= mask;
  } else {
    groups.insert(it, Group{pc, mask});
  }
}

// Moves the front group to `pc` (keeping the list sorted and merged).
void MoveFront(std::vector<Group>& groups, uint32_t pc) {
  if (groups.size() == 1 || pc < groups[1].pc) {
    groups[0].pc = pc;
    return;
  }
  const uint32_t mask = groups[0].mask;
  groups.erase(groups.begin());
  InsertGroup(groups, pc, mask);
}

// The buffers of a launch, kept per thread from one launch to the next: the register file is
// megabytes for a block of 1024 threads, and allocating it anew at every launch (fresh pages, each
// faulted in) was most of a small launch's time, a fifth of the emulated CUDA backend's tests.
// A thread runs one launch at a time, so one set per thread is enough.
struct LaunchBuffers {
  std::vector<MemoryRange> range_cache;
  std::vector<uint8_t> shared;
  std::vector<uint64_t> regs;
  std::vector<uint32_t> defined;
};
LaunchBuffers& ThisThreadsLaunchBuffers() {
  thread_local LaunchBuffers buffers;
  return buffers;
}

class Launcher {
 public:
  Launcher(const Entry& entry, const LaunchConfig& config, void* const* params,
           const MemoryMap& memory, LaunchReport* report)
      : entry_(entry), config_(config), params_(params), memory_(memory), report_(report) {}

  absl::Status Run() {
    const Dim3& g = config_.grid;
    const Dim3& b = config_.block;
    if (g.x == 0 || g.y == 0 || g.z == 0 || b.x == 0 || b.y == 0 || b.z == 0) {
      return Invalid("grid and block dimensions must be at least 1");
    }
    if (b.z > 64 || g.y > 65535 || g.z > 65535) {
      return Invalid(
          absl::StrFormat("block (%u,%u,%u) or grid (%u,%u,%u) exceeds the device limits", b.x, b.y,
                          b.z, g.x, g.y, g.z));
    }
    const uint64_t threads = uint64_t{b.x} * b.y * b.z;
    if (threads > 1024) return Invalid(absl::StrCat("block of ", threads, " threads exceeds 1024"));
    if (entry_.max_threads_per_block != 0 && threads > entry_.max_threads_per_block) {
      return Invalid(absl::StrCat("block of ", threads,
                                  " threads exceeds the entry's .maxntid/.reqntid of ",
                                  entry_.max_threads_per_block));
    }
    const uint64_t shared =
        (entry_.static_shared_bytes + 15) / 16 * 16 + uint64_t{config_.dynamic_shared_bytes};
    if (shared > 227 * 1024)
      return Invalid(absl::StrCat(shared, " bytes of shared memory exceed 227 KiB"));
    if (!entry_.params.empty() && params_ == nullptr)
      return Invalid("kernel parameters are missing");

    param_buf_.assign(entry_.param_bytes, 0);
    for (size_t i = 0; i < entry_.params.size(); ++i) {
      if (params_[i] == nullptr) return Invalid(absl::StrCat("kernel parameter ", i, " is null"));
      std::memcpy(param_buf_.data() + entry_.params[i].offset, params_[i], entry_.params[i].size);
    }
    ranges_ = memory_.Snapshot();
    range_cache_.assign(entry_.code.size(), MemoryRange{});
    shared_.assign(shared, 0);
    nregs_ = entry_.NumRegs();
    threads_ = static_cast<uint32_t>(threads);
    nwarps_ = (threads_ + 31) / 32;
    regs_.assign(size_t{nwarps_} * nregs_ * 32, 0);
    defined_.assign(size_t{nwarps_} * nregs_, 0);
    reg_mask_.resize(nregs_);
    for (uint32_t r = 0; r < nregs_; ++r) {
      const Type t = entry_.reg_types[r];
      reg_mask_[r] = t == Type::kPred ? 1 : Mask(TypeBits(t));
    }
    warps_.assign(nwarps_, WarpState{});
    if (config_.count_traffic) {
      read_sectors_.assign(ranges_.size(), {});
      written_sectors_.assign(ranges_.size(), {});
    }

    for (uint32_t z = 0; z < g.z; ++z) {
      for (uint32_t y = 0; y < g.y; ++y) {
        for (uint32_t x = 0; x < g.x; ++x) {
          block_ = config_.reverse_block_order ? Dim3{g.x - 1 - x, g.y - 1 - y, g.z - 1 - z}
                                               : Dim3{x, y, z};
          if (absl::Status s = RunBlock(); !s.ok()) return s;
        }
      }
    }
    return absl::OkStatus();
  }

  // Fills report_->traffic's distinct-sector figures from the sectors marked so far.
  void FinishTraffic() {
    if (!config_.count_traffic) return;
    TrafficReport& t = report_->traffic;
    for (size_t i = 0; i < read_sectors_.size(); ++i) {
      t.read_bytes += CountBits(read_sectors_[i]) * TrafficReport::kSectorBytes;
      t.written_bytes += CountBits(written_sectors_[i]) * TrafficReport::kSectorBytes;
    }
    // Each sector of a marked range once, even where marked ranges overlap.
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // [first, last] sector
    for (const MemoryRange& m : config_.traffic_marked) {
      if (m.size != 0) spans.push_back({m.base >> 5, (m.base + m.size - 1) >> 5});
    }
    std::sort(spans.begin(), spans.end());
    uint64_t next = 0;  // first sector not yet counted
    for (const auto& [span_first, last] : spans) {
      const uint64_t first = std::max(span_first, next);
      if (first > last) continue;
      next = last + 1;
      for (size_t i = 0; i < read_sectors_.size(); ++i) {
        const uint64_t r_first = ranges_[i].base >> 5;
        const uint64_t r_last = (ranges_[i].base + ranges_[i].size - 1) >> 5;
        for (uint64_t s = std::max(first, r_first); s <= std::min(last, r_last); ++s) {
          t.marked_read_bytes +=
              TestBit(read_sectors_[i], s - r_first) * TrafficReport::kSectorBytes;
          t.marked_written_bytes +=
              TestBit(written_sectors_[i], s - r_first) * TrafficReport::kSectorBytes;
        }
      }
    }
  }

 private:
  static uint64_t CountBits(const std::vector<uint64_t>& bits) {
    uint64_t n = 0;
    for (uint64_t w : bits) n += static_cast<uint64_t>(__builtin_popcountll(w));
    return n;
  }
  static uint64_t TestBit(const std::vector<uint64_t>& bits, uint64_t i) {
    return i / 64 < bits.size() ? (bits[i / 64] >> (i % 64)) & 1 : 0;
  }

  // Traffic of warp-level access `in` (`size` bytes per lane of `exec`): its distinct sectors
  // and useful bytes, and its sectors marked read and/or written in their allocation's bitmap.
  // Runs before the access is checked; an access that then fails ends the launch anyway.
  void CountTraffic(const Instruction& in, uint32_t exec, const uint64_t* r, uint32_t size,
                    bool read, bool write) {
    if (in.space != Space::kGlobal && in.space != Space::kGeneric) return;
    uint64_t sectors[64];
    uint64_t starts[32];  // the lanes' addresses, for the bytes they ask for
    int n = 0;
    int lanes = 0;
    for (uint32_t m = exec; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      const uint64_t addr = Address(in.src[0], r, lane);
      if (in.space == Space::kGeneric && addr >= kSharedWindow &&
          addr - kSharedWindow < (uint64_t{1} << 32)) {
        continue;  // shared memory
      }
      starts[lanes++] = addr;
      const uint64_t last = (addr + size - 1) >> 5;
      // An aligned access of up to 32 bytes spans one sector; a misaligned one (a finding) two.
      for (uint64_t s = addr >> 5; s <= last && n < 64; ++s) sectors[n++] = s;
    }
    if (lanes == 0) return;
    std::sort(sectors, sectors + n);
    n = static_cast<int>(std::unique(sectors, sectors + n) - sectors);
    // Useful bytes: the union of the lanes' [addr, addr + size), so that lanes reading the same
    // word (a broadcast) ask for it once.
    std::sort(starts, starts + lanes);
    uint64_t useful = 0;
    uint64_t covered = 0;  // end of the union so far
    for (int i = 0; i < lanes; ++i) {
      const uint64_t end = starts[i] + size;
      if (i == 0 || starts[i] >= covered) {
        useful += size;
      } else if (end > covered) {
        useful += end - covered;
      }
      if (i == 0 || end > covered) covered = end;
    }
    const uint64_t times = uint64_t{read} + uint64_t{write};
    TrafficReport& t = report_->traffic;
    t.accesses += times;
    t.requested_sector_bytes += times * static_cast<uint64_t>(n) * TrafficReport::kSectorBytes;
    t.useful_bytes += times * useful;
    for (int i = 0; i < n; ++i) {
      const size_t range = RangeOfSector(sectors[i]);
      if (range == kNoRange) continue;  // outside every allocation: the access fails
      const uint64_t bit = sectors[i] - (ranges_[range].base >> 5);
      if (read) SetBit(read_sectors_[range], bit, ranges_[range]);
      if (write) SetBit(written_sectors_[range], bit, ranges_[range]);
    }
  }

  static constexpr size_t kNoRange = ~size_t{0};
  // The allocation holding part of `sector` (the last one found is tried first).
  size_t RangeOfSector(uint64_t sector) {
    const uint64_t lo = sector << 5;
    const uint64_t hi = lo + 31;
    auto holds = [&](const MemoryRange& m) { return m.base <= hi && m.base + m.size > lo; };
    if (last_range_ < ranges_.size() && holds(ranges_[last_range_])) return last_range_;
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), hi,
                               [](uint64_t a, const MemoryRange& m) { return a < m.base; });
    if (it == ranges_.begin() || !holds(*(it - 1))) return kNoRange;
    last_range_ = static_cast<size_t>(it - 1 - ranges_.begin());
    return last_range_;
  }
  static void SetBit(std::vector<uint64_t>& bits, uint64_t i, const MemoryRange& range) {
    if (bits.empty()) {
      const uint64_t sectors = (range.base + range.size - 1) / 32 - range.base / 32 + 1;
      bits.assign((sectors + 63) / 64, 0);
    }
    bits[i / 64] |= uint64_t{1} << (i % 64);
  }

  absl::Status Invalid(absl::string_view why) {
    report_->finding = Finding::kInvalidLaunch;
    return absl::InvalidArgumentError(absl::StrCat("launch of '", entry_.name, "': ", why));
  }

  // The thread's index in its block (%tid).
  Dim3 ThreadIndex(uint32_t warp, uint32_t lane) const {
    const uint32_t t = warp * 32 + lane;
    const Dim3& b = config_.block;
    return {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
  }

  absl::Status Fail(Finding finding, uint32_t warp, uint32_t lane, uint32_t line,
                    absl::string_view what) {
    report_->finding = finding;
    const Dim3 t = ThreadIndex(warp, lane);
    const std::string message = absl::StrFormat(
        "%s: %s [kernel '%s', line %u, block (%u,%u,%u), thread (%u,%u,%u)]", FindingName(finding),
        what, entry_.name, line, block_.x, block_.y, block_.z, t.x, t.y, t.z);
    if (finding == Finding::kInstructionLimit) return absl::DeadlineExceededError(message);
    return absl::InternalError(message);
  }

  void InitBlock() {
    const Dim3& b = config_.block;
    const Dim3& g = config_.grid;
    std::fill(shared_.begin(), shared_.end(), 0);
    std::fill(defined_.begin(), defined_.end(), 0);
    for (uint32_t w = 0; w < nwarps_; ++w) {
      WarpState& ws = warps_[w];
      const uint32_t lanes = std::min<uint32_t>(32, threads_ - w * 32);
      ws.present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
      ws.exited = 0;
      ws.groups.assign(1, Group{0, ws.present});
      ws.waiting.clear();
      uint64_t* r = &regs_[size_t{w} * nregs_ * 32];
      uint32_t* d = &defined_[size_t{w} * nregs_];
      for (uint32_t lane = 0; lane < lanes; ++lane) {
        const Dim3 t = ThreadIndex(w, lane);
        const uint64_t values[kNumSpecialSlots] = {t.x,
                                                   t.y,
                                                   t.z,
                                                   b.x,
                                                   b.y,
                                                   b.z,
                                                   block_.x,
                                                   block_.y,
                                                   block_.z,
                                                   g.x,
                                                   g.y,
                                                   g.z,
                                                   lane,
                                                   w,
                                                   nwarps_,
                                                   1u << lane,
                                                   (1u << lane) - 1,
                                                   (lane == 31 ? 0xffffffffu : (2u << lane) - 1),
                                                   lane == 31 ? 0u : ~((2u << lane) - 1),
                                                   ~((1u << lane) - 1)};
        for (uint32_t s = 0; s < kNumSpecialSlots; ++s) r[s * 32 + lane] = values[s] & 0xffffffffu;
      }
      for (uint32_t s = 0; s < kNumSpecialSlots; ++s) d[s] = ws.present;
    }
  }

  absl::Status RunBlock() {
    InitBlock();
    while (true) {
      for (uint32_t w = 0; w < nwarps_; ++w) {
        if (absl::Status s = RunWarp(w); !s.ok()) return s;
      }
      // Every thread has exited or waits at a barrier.
      uint32_t bar_pc = kNoReg;
      uint32_t bar_warp = 0, bar_lane = 0;
      for (uint32_t w = 0; w < nwarps_; ++w) {
        for (const Group& g : warps_[w].waiting) {
          if (bar_pc == kNoReg) {
            bar_pc = g.pc;
            bar_warp = w;
            bar_lane = static_cast<uint32_t>(__builtin_ctz(g.mask));
          } else if (g.pc != bar_pc) {
            const Dim3 t = ThreadIndex(bar_warp, bar_lane);
            return Fail(
                Finding::kBarrier, w, static_cast<uint32_t>(__builtin_ctz(g.mask)),
                entry_.code[g.pc].line,
                absl::StrFormat("divergent barrier: this thread waits at the bar.sync on "
                                "line %u while thread (%u,%u,%u) waits at the bar.sync on "
                                "line %u",
                                entry_.code[g.pc].line, t.x, t.y, t.z, entry_.code[bar_pc].line));
          }
        }
      }
      if (bar_pc == kNoReg) return absl::OkStatus();  // all threads exited
      for (uint32_t w = 0; w < nwarps_; ++w) {
        if (warps_[w].exited != 0) {
          return Fail(
              Finding::kBarrier, w, static_cast<uint32_t>(__builtin_ctz(warps_[w].exited)),
              entry_.code[bar_pc].line,
              absl::StrFormat("barrier not reached by all threads of the block: this thread "
                              "exited while others wait at the bar.sync on line %u",
                              entry_.code[bar_pc].line));
        }
      }
      for (uint32_t w = 0; w < nwarps_; ++w) {
        WarpState& ws = warps_[w];
        for (const Group& g : ws.waiting) InsertGroup(ws.groups, g.pc + 1, g.mask);
        ws.waiting.clear();
      }
    }
  }

  // "global load of 4 bytes at address 0x..." / "shared store of 8 bytes at offset 16".
  static std::string DescribeAccess(bool shared, bool store, uint32_t size, uint64_t at) {
    return shared ? absl::StrFormat("shared %s of %u bytes at offset %u", store ? "store" : "load",
                                    size, at)
                  : absl::StrFormat("global %s of %u bytes at address 0x%x",
                                    store ? "store" : "load", size, at);
  }

  // True when [addr, addr + size) lies inside `r`.
  static bool Holds(const MemoryRange& r, uint64_t addr, uint32_t size) {
    return addr >= r.base && addr - r.base < r.size && r.size - (addr - r.base) >= size;
  }

  // The host pointer of an aligned global access; nullptr after setting *status to its
  // out-of-bounds finding.
  uint8_t* GlobalPointer(uint64_t addr, uint32_t size, bool store, const Instruction& in,
                         uint32_t warp, uint32_t lane, absl::Status* status) {
    if (Holds(*cache_, addr, size)) return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(addr));
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), addr,
                               [](uint64_t a, const MemoryRange& r) { return a < r.base; });
    if (it != ranges_.begin() && Holds(*(it - 1), addr, size)) {
      *cache_ = *(it - 1);
      return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(addr));
    }
    std::string where = "no allocation contains it";
    if (it != ranges_.begin()) {
      const MemoryRange& r = *(it - 1);
      if (addr >= r.base + r.size) {
        where = absl::StrFormat("%u bytes past the end of the %u-byte allocation at 0x%x",
                                addr - (r.base + r.size), r.size, r.base);
      } else {
        where = absl::StrFormat("the access runs past the end of the %u-byte allocation at 0x%x",
                                r.size, r.base);
      }
    }
    *status = Fail(Finding::kOutOfBounds, warp, lane, in.line,
                   absl::StrCat(DescribeAccess(false, store, size, addr), ": ", where));
    return nullptr;
  }

  // The same for an aligned access at `offset` in the block's shared memory.
  uint8_t* SharedPointer(uint64_t offset, uint32_t size, bool store, const Instruction& in,
                         uint32_t warp, uint32_t lane, absl::Status* status) {
    if (offset < shared_.size() && shared_.size() - offset >= size) return shared_.data() + offset;
    *status = Fail(Finding::kOutOfBounds, warp, lane, in.line,
                   absl::StrFormat("%s outside the block's %u bytes of shared memory",
                                   DescribeAccess(true, store, size, offset), shared_.size()));
    return nullptr;
  }

  // The host pointer of lane's access of `size` bytes at in.src[0] (a load unless `store`);
  // nullptr after setting *status to its finding. Alignment is checked first, then bounds.
  uint8_t* Pointer(const Instruction& in, uint32_t size, bool store, const uint64_t* r,
                   uint32_t warp, int lane, absl::Status* status) {
    const uint32_t thread_lane = static_cast<uint32_t>(lane);
    uint64_t addr = Address(in.src[0], r, lane);
    bool shared = in.space == Space::kShared;
    if (in.space == Space::kGeneric && addr >= kSharedWindow &&
        addr - kSharedWindow < (uint64_t{1} << 32)) {
      shared = true;
      addr -= kSharedWindow;
    }
    if ((addr & (size - 1)) != 0) {
      *status = Fail(Finding::kMisaligned, warp, thread_lane, in.line,
                     absl::StrFormat("%s is not %u-byte aligned",
                                     DescribeAccess(shared, store, size, addr), size));
      return nullptr;
    }
    return shared ? SharedPointer(addr, size, store, in, warp, thread_lane, status)
                  : GlobalPointer(addr, size, store, in, warp, thread_lane, status);
  }

  absl::Status Shuffle(const Instruction& in, uint32_t w, uint32_t group_mask, uint32_t exec,
                       uint64_t* r, uint32_t* d) {
    const WarpState& ws = warps_[w];
    uint64_t a[32];
    for (uint32_t m = exec; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      a[lane] = Value(in.src[0], r, lane);
    }
    for (uint32_t m = exec; m; m &= m - 1) {
      const uint32_t lane = static_cast<uint32_t>(__builtin_ctz(m));
      const uint32_t member = static_cast<uint32_t>(Value(in.src[3], r, lane));
      if ((member & (1u << lane)) == 0) {
        return Fail(Finding::kShuffleMask, w, lane, in.line,
                    absl::StrFormat("member mask 0x%08x does not include the executing lane %u",
                                    member, lane));
      }
      const uint32_t missing = member & ~exec;
      if (missing != 0) {
        const uint32_t other = static_cast<uint32_t>(__builtin_ctz(missing));
        std::string why;
        if ((ws.present & (1u << other)) == 0) {
          why = "does not exist (the block has fewer threads)";
        } else if (ws.exited & (1u << other)) {
          why = "has exited";
        } else if (group_mask & (1u << other)) {
          why = "skips this shfl.sync (its guard predicate is false)";
        } else {
          uint32_t at = 0;
          bool exiting = false;
          for (const Group& g : ws.groups) {
            if (g.mask & (1u << other)) {
              at = entry_.code[g.pc].line;
              exiting = entry_.code[g.pc].op == Op::kExit;
            }
          }
          for (const Group& g : ws.waiting) {
            if (g.mask & (1u << other)) at = entry_.code[g.pc].line;
          }
          why = exiting ? absl::StrFormat("has diverged to an exit (the ret/exit on line %u)", at)
                        : absl::StrFormat("has diverged (it is at line %u)", at);
        }
        return Fail(
            Finding::kShuffleMask, w, lane, in.line,
            absl::StrFormat("member mask 0x%08x names lane %u, which %s", member, other, why));
      }
    }
    const ShflMode mode = static_cast<ShflMode>(in.mode);
    for (uint32_t m = exec; m; m &= m - 1) {
      const uint32_t lane = static_cast<uint32_t>(__builtin_ctz(m));
      const uint32_t b = static_cast<uint32_t>(Value(in.src[1], r, lane));
      const uint32_t c = static_cast<uint32_t>(Value(in.src[2], r, lane));
      const uint32_t cval = c & 0x1f;
      const uint32_t segmask = (c >> 8) & 0x1f;
      const int32_t min_lane = static_cast<int32_t>(lane & segmask);
      const int32_t max_lane = min_lane | static_cast<int32_t>(cval & ~segmask);
      int32_t j = 0;
      bool pval = false;
      switch (mode) {
        case ShflMode::kUp:
          j = static_cast<int32_t>(lane) - static_cast<int32_t>(b);
          pval = j >= max_lane;
          break;
        case ShflMode::kDown:
          j = static_cast<int32_t>(lane) + static_cast<int32_t>(b);
          pval = j <= max_lane;
          break;
        case ShflMode::kBfly:
          j = static_cast<int32_t>(lane ^ b);
          pval = j <= max_lane;
          break;
        case ShflMode::kIdx:
          j = min_lane | static_cast<int32_t>(b & ~segmask & 0x1f);
          pval = j <= max_lane;
          break;
      }
      if (!pval || j < 0 || j > 31) j = static_cast<int32_t>(lane);
      if ((exec & (1u << j)) == 0) {
        return Fail(Finding::kShuffleMask, w, lane, in.line,
                    absl::StrFormat("reads lane %d, which does not execute this shfl.sync "
                                    "(the value is undefined)",
                                    j));
      }
      r[in.dst[0].reg * 32 + lane] = a[j] & 0xffffffffu;
      if (in.num_dst > 1) r[in.dst[1].reg * 32 + lane] = pval ? 1 : 0;
    }
    d[in.dst[0].reg] |= exec;
    if (in.num_dst > 1) d[in.dst[1].reg] |= exec;
    return absl::OkStatus();
  }

  static uint64_t Value(const Operand& o, const uint64_t* r, int lane) {
    return o.kind == Operand::Kind::kReg ? r[o.reg * 32 + lane] : o.imm;
  }

  uint64_t Address(const Operand& o, const uint64_t* r, int lane) const {
    return (o.reg == kNoReg ? 0 : r[o.reg * 32 + lane]) + o.imm;
  }

  static uint64_t AtomicNew(const Instruction& in, uint64_t old, uint64_t b, uint64_t c) {
    const AtomOp op = static_cast<AtomOp>(in.mode);
    const int bits = TypeBits(in.type);
    const uint64_t m = Mask(bits);
    switch (op) {
      case AtomOp::kAdd:
        if (in.type == Type::kF32) return F32Bits(AsF32(old) + AsF32(b));
        if (in.type == Type::kF64) return F64Bits(AsF64(old) + AsF64(b));
        return (old + b) & m;
      case AtomOp::kMin:
      case AtomOp::kMax:
        return IntMinMax(op == AtomOp::kMax, IsSigned(in.type), bits, old, b);
      case AtomOp::kExch:
        return b & m;
      case AtomOp::kCas:
        return (old & m) == (b & m) ? c & m : old & m;
      case AtomOp::kAnd:
        return old & b & m;
      case AtomOp::kOr:
        return (old | b) & m;
      case AtomOp::kXor:
        return (old ^ b) & m;
      case AtomOp::kInc:
        return (old & m) >= (b & m) ? 0 : (old + 1) & m;
      case AtomOp::kDec:
        return ((old & m) == 0 || (old & m) > (b & m)) ? b & m : (old - 1) & m;
    }
    return old;
  }

  // Applies atomic `in` to *ptr and returns the value before. Shared memory belongs to the block,
  // whose threads run one at a time; global memory may be shared with concurrent launches.
  template <typename T>
  static T AtomicUpdate(T* ptr, bool shared, const Instruction& in, uint64_t b, uint64_t c) {
    if (shared) {
      const T old = *ptr;
      *ptr = static_cast<T>(AtomicNew(in, old, b, c));
      return old;
    }
    T old = __atomic_load_n(ptr, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(ptr, &old, static_cast<T>(AtomicNew(in, old, b, c)), false,
                                        __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return old;
  }

  absl::Status Atomic(const Instruction& in, uint32_t w, uint32_t exec, uint64_t* r, uint32_t* d) {
    const uint32_t size = static_cast<uint32_t>(TypeBits(in.type) / 8);
    if (config_.count_traffic) CountTraffic(in, exec, r, size, /*read=*/true, /*write=*/true);
    for (uint32_t m = exec; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      absl::Status status;
      uint8_t* p = Pointer(in, size, /*store=*/true, r, w, lane, &status);
      if (p == nullptr) return status;
      const bool shared = in.space == Space::kShared;
      const uint64_t b = Value(in.src[1], r, lane);
      const uint64_t c = in.num_src > 2 ? Value(in.src[2], r, lane) : 0;
      const uint64_t old = size == 4
                               ? AtomicUpdate(reinterpret_cast<uint32_t*>(p), shared, in, b, c)
                               : AtomicUpdate(reinterpret_cast<uint64_t*>(p), shared, in, b, c);
      if (in.op == Op::kAtom) r[in.dst[0].reg * 32 + lane] = old & reg_mask_[in.dst[0].reg];
    }
    if (in.op == Op::kAtom) d[in.dst[0].reg] |= exec;
    return absl::OkStatus();
  }

  absl::Status Load(const Instruction& in, uint32_t w, uint32_t exec, uint64_t* r, uint32_t* d) {
    if (config_.count_traffic) {
      CountTraffic(in, exec, r, static_cast<uint32_t>(TypeBits(in.type) / 8) * in.vec,
                   /*read=*/true, /*write=*/false);
    }
    if (in.space == Space::kGlobal && in.vec == 1 && TypeBits(in.type) == 32) {
      // Hot path: 4-byte global loads that hit the cached allocation; the rest go the long way.
      uint64_t* out = r + in.dst[0].reg * 32;
      uint32_t rest = 0;
      for (uint32_t m = exec; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        const uint64_t addr = Address(in.src[0], r, lane);
        if ((addr & 3) == 0 && Holds(*cache_, addr, 4)) {
          uint32_t v;
          std::memcpy(&v, reinterpret_cast<const void*>(static_cast<uintptr_t>(addr)), 4);
          out[lane] = v;
        } else {
          rest |= 1u << lane;
        }
      }
      d[in.dst[0].reg] |= exec & ~rest;
      exec = rest;
      if (exec == 0) return absl::OkStatus();
    }
    const uint32_t elem = static_cast<uint32_t>(TypeBits(in.type) / 8);
    const uint32_t size = elem * in.vec;
    const bool sign = IsSigned(in.type) && elem < 8;
    for (uint32_t m = exec; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      const uint8_t* p;
      if (in.space == Space::kParam) {
        p = param_buf_.data() + Address(in.src[0], r, lane);  // bounds checked when parsed
      } else {
        absl::Status status;
        p = Pointer(in, size, /*store=*/false, r, w, lane, &status);
        if (p == nullptr) return status;
      }
      for (uint32_t k = 0; k < in.vec; ++k) {
        uint64_t v = 0;
        std::memcpy(&v, p + k * elem, elem);
        if (sign) v = static_cast<uint64_t>(SignExtend(v, static_cast<int>(elem * 8)));
        const uint32_t slot = in.dst[k].reg;
        r[slot * 32 + lane] = v & reg_mask_[slot];
      }
    }
    for (uint32_t k = 0; k < in.vec; ++k) d[in.dst[k].reg] |= exec;
    return absl::OkStatus();
  }

  absl::Status Store(const Instruction& in, uint32_t w, uint32_t exec, const uint64_t* r) {
    if (config_.count_traffic) {
      CountTraffic(in, exec, r, static_cast<uint32_t>(TypeBits(in.type) / 8) * in.vec,
                   /*read=*/false, /*write=*/true);
    }
    if (in.space == Space::kGlobal && in.vec == 1 && TypeBits(in.type) == 32) {
      uint32_t rest = 0;
      for (uint32_t m = exec; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        const uint64_t addr = Address(in.src[0], r, lane);
        if ((addr & 3) == 0 && Holds(*cache_, addr, 4)) {
          const uint32_t v = static_cast<uint32_t>(Value(in.src[1], r, lane));
          std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(addr)), &v, 4);
        } else {
          rest |= 1u << lane;
        }
      }
      exec = rest;
      if (exec == 0) return absl::OkStatus();
    }
    const uint32_t elem = static_cast<uint32_t>(TypeBits(in.type) / 8);
    const uint32_t size = elem * in.vec;
    for (uint32_t m = exec; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      absl::Status status;
      uint8_t* p = Pointer(in, size, /*store=*/true, r, w, lane, &status);
      if (p == nullptr) return status;
      for (uint32_t k = 0; k < in.vec; ++k) {
        const uint64_t v = Value(in.src[1 + k], r, lane);
        std::memcpy(p + k * elem, &v, elem);
      }
    }
    return absl::OkStatus();
  }

  absl::Status RunWarp(uint32_t w) {
    WarpState& ws = warps_[w];
    uint64_t* r = &regs_[size_t{w} * nregs_ * 32];
    uint32_t* d = &defined_[size_t{w} * nregs_];
    const Instruction* code = entry_.code.data();
    while (!ws.groups.empty()) {
      if (++report_->warp_instructions > config_.max_warp_instructions) {
        return Fail(Finding::kInstructionLimit, w,
                    static_cast<uint32_t>(__builtin_ctz(ws.groups[0].mask)),
                    code[ws.groups[0].pc].line,
                    absl::StrCat("more than ", config_.max_warp_instructions,
                                 " warp-instructions executed (a hang?)"));
      }
      const uint32_t pc = ws.groups[0].pc;
      const uint32_t mask = ws.groups[0].mask;
      const Instruction& in = code[pc];
      uint32_t exec = mask;
      if (in.guard != kNoReg) {
        if ((d[in.guard] & mask) != mask) {
          return Uninitialized(in, in.guard, w, mask & ~d[in.guard]);
        }
        exec = 0;
        const uint64_t* g = r + in.guard * 32;
        for (uint32_t m = mask; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          if ((g[lane] != 0) != in.guard_negated) exec |= 1u << lane;
        }
      }
      report_->thread_instructions += static_cast<uint64_t>(Popcount(exec));
      for (int k = 0; k < in.num_src; ++k) {
        const uint32_t slot = in.src[k].reg;
        if (slot != kNoReg && (d[slot] & exec) != exec)
          return Uninitialized(in, slot, w, exec & ~d[slot]);
      }
      switch (in.op) {
        case Op::kBra: {
          if (exec == mask) {
            MoveFront(ws.groups, in.target);
          } else if (in.uni && exec != 0) {
            return Fail(Finding::kNonUniformBranch, w, static_cast<uint32_t>(__builtin_ctz(exec)),
                        in.line,
                        absl::StrFormat("bra.uni taken by lanes 0x%08x of 0x%08x", exec, mask));
          } else if (exec == 0) {
            MoveFront(ws.groups, pc + 1);
          } else {
            ws.groups.erase(ws.groups.begin());
            InsertGroup(ws.groups, in.target, exec);
            InsertGroup(ws.groups, pc + 1, mask & ~exec);
          }
          continue;
        }
        case Op::kExit: {
          ws.exited |= exec;
          if (exec == mask) {
            ws.groups.erase(ws.groups.begin());
          } else {
            ws.groups[0].mask = mask & ~exec;
            MoveFront(ws.groups, pc + 1);
          }
          continue;
        }
        case Op::kBar: {
          ws.groups.erase(ws.groups.begin());
          if (exec != 0) InsertGroup(ws.waiting, pc, exec);
          if (mask & ~exec) InsertGroup(ws.groups, pc + 1, mask & ~exec);
          continue;
        }
        case Op::kShfl:
          if (exec != 0) {
            if (absl::Status s = Shuffle(in, w, mask, exec, r, d); !s.ok()) return s;
          }
          break;
        case Op::kLd:
          cache_ = &range_cache_[pc];
          if (absl::Status s = Load(in, w, exec, r, d); !s.ok()) return s;
          break;
        case Op::kSt:
          cache_ = &range_cache_[pc];
          if (absl::Status s = Store(in, w, exec, r); !s.ok()) return s;
          break;
        case Op::kAtom:
        case Op::kRed:
          cache_ = &range_cache_[pc];
          if (absl::Status s = Atomic(in, w, exec, r, d); !s.ok()) return s;
          break;
        case Op::kNop:
          break;
        default:
          Compute(in, exec, r, d);
          break;
      }
      // Advance the front group; merge with the next group when it is already there.
      ws.groups[0].pc = pc + 1;
      if (ws.groups.size() > 1 && ws.groups[1].pc == pc + 1) {
        ws.groups[1].mask |= ws.groups[0].mask;
        ws.groups.erase(ws.groups.begin());
      }
    }
    return absl::OkStatus();
  }

  absl::Status Uninitialized(const Instruction& in, uint32_t slot, uint32_t w, uint32_t lanes) {
    return Fail(
        Finding::kUninitializedRegister, w, static_cast<uint32_t>(__builtin_ctz(lanes)), in.line,
        absl::StrFormat("register %s is read before any instruction wrote it in this thread",
                        entry_.reg_names[slot]));
  }

  // out[lane] = f(a, b, c) over the lanes of exec; operands read as 64-bit cells.
  template <int kArity, typename F>
  static void Map(const Instruction& in, uint32_t exec, const uint64_t* r, uint64_t* out, F f) {
    const uint64_t* p[3] = {nullptr, nullptr, nullptr};
    uint64_t imm[3] = {0, 0, 0};
    for (int k = 0; k < kArity; ++k) {
      if (in.src[k].kind == Operand::Kind::kReg) {
        p[k] = r + in.src[k].reg * 32;
      } else {
        imm[k] = in.src[k].imm;
      }
    }
    auto get = [&](int k, int lane) { return p[k] != nullptr ? p[k][lane] : imm[k]; };
    if (exec == 0xffffffffu) {
      for (int lane = 0; lane < 32; ++lane) out[lane] = f(get(0, lane), get(1, lane), get(2, lane));
    } else {
      for (uint32_t m = exec; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        out[lane] = f(get(0, lane), get(1, lane), get(2, lane));
      }
    }
  }

  // The instructions the kernels spend their time in, without the generic dispatch per lane.
  // Returns false when `in` is not one of them.
  static bool ComputeCommon(const Instruction& in, uint32_t exec, const uint64_t* r,
                            uint64_t* out) {
    const Type t = in.type;
    const MulMode mul = static_cast<MulMode>(in.mode);
    if (t == Type::kF32 && !in.ftz && !in.sat && in.rounding == FloatRound::kRn) {
      switch (in.op) {
        case Op::kAdd:
          Map<2>(in, exec, r, out,
                 [](uint64_t a, uint64_t b, uint64_t) { return F32Bits(AsF32(a) + AsF32(b)); });
          return true;
        case Op::kSub:
          Map<2>(in, exec, r, out,
                 [](uint64_t a, uint64_t b, uint64_t) { return F32Bits(AsF32(a) - AsF32(b)); });
          return true;
        case Op::kMul:
          Map<2>(in, exec, r, out,
                 [](uint64_t a, uint64_t b, uint64_t) { return F32Bits(AsF32(a) * AsF32(b)); });
          return true;
        case Op::kFma:
        case Op::kMad:
          Map<3>(in, exec, r, out, [](uint64_t a, uint64_t b, uint64_t c) {
            return F32Bits(std::fma(AsF32(a), AsF32(b), AsF32(c)));
          });
          return true;
        default:
          return false;
      }
    }
    const bool int32 = t == Type::kU32 || t == Type::kS32 || t == Type::kB32;
    const bool int64 = t == Type::kU64 || t == Type::kS64 || t == Type::kB64;
    if (in.sat || !(int32 || int64)) return false;
    const uint64_t m = int32 ? 0xffffffffu : ~uint64_t{0};
    switch (in.op) {
      case Op::kAdd:
        Map<2>(in, exec, r, out, [m](uint64_t a, uint64_t b, uint64_t) { return (a + b) & m; });
        return true;
      case Op::kSub:
        Map<2>(in, exec, r, out, [m](uint64_t a, uint64_t b, uint64_t) { return (a - b) & m; });
        return true;
      case Op::kAnd:
        Map<2>(in, exec, r, out, [m](uint64_t a, uint64_t b, uint64_t) { return a & b & m; });
        return true;
      case Op::kMul:
      case Op::kMad:
        if (t == Type::kU32 && mul == MulMode::kWide) {
          if (in.op == Op::kMul) {
            Map<2>(in, exec, r, out, [](uint64_t a, uint64_t b, uint64_t) {
              return (a & 0xffffffffu) * (b & 0xffffffffu);
            });
          } else {
            Map<3>(in, exec, r, out, [](uint64_t a, uint64_t b, uint64_t c) {
              return (a & 0xffffffffu) * (b & 0xffffffffu) + c;
            });
          }
          return true;
        }
        if (mul == MulMode::kLo) {
          if (in.op == Op::kMul) {
            Map<2>(in, exec, r, out, [m](uint64_t a, uint64_t b, uint64_t) { return (a * b) & m; });
          } else {
            Map<3>(in, exec, r, out,
                   [m](uint64_t a, uint64_t b, uint64_t c) { return (a * b + c) & m; });
          }
          return true;
        }
        return false;
      case Op::kShl: {
        const uint64_t bits = int32 ? 32 : 64;
        Map<2>(in, exec, r, out, [m, bits](uint64_t a, uint64_t b, uint64_t) {
          const uint64_t n = b & 0xffffffffu;
          return n >= bits ? 0 : (a << n) & m;
        });
        return true;
      }
      case Op::kSetp: {
        if (in.bool_op != BoolOp::kNone || in.num_dst != 1) return false;
        const Cmp c = static_cast<Cmp>(in.mode);
        const bool s = IsSigned(t);
        const int shift = int32 ? 32 : 0;  // moves a 32-bit value's sign bit to bit 63
        Map<2>(in, exec, r, out, [c, s, m, shift](uint64_t a, uint64_t b, uint64_t) -> uint64_t {
          const uint64_t ua = a & m, ub = b & m;
          const int64_t sa = static_cast<int64_t>(ua << shift) >> shift;
          const int64_t sb = static_cast<int64_t>(ub << shift) >> shift;
          return CompareInts(c, s, ua, ub, sa, sb);
        });
        return true;
      }
      default:
        break;
    }
    return false;
  }

  void Compute(const Instruction& in, uint32_t exec, uint64_t* r, uint32_t* d) {
    const uint32_t dst = in.dst[0].reg;
    const uint64_t dmask = reg_mask_[dst];
    uint64_t* out = r + dst * 32;
    if (ComputeCommon(in, exec, r, out)) {
      d[dst] |= exec;
      return;
    }
    switch (in.op) {
      case Op::kMov:
        for (uint32_t m = exec; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          out[lane] = Value(in.src[0], r, lane) & dmask;
        }
        break;
      case Op::kSetp: {
        const bool two = in.num_dst > 1;
        uint64_t* out2 = two ? r + in.dst[1].reg * 32 : nullptr;
        for (uint32_t m = exec; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          bool t = Compare(in, Value(in.src[0], r, lane), Value(in.src[1], r, lane));
          bool f = !t;
          if (in.bool_op != BoolOp::kNone) {
            const bool c = (Value(in.src[2], r, lane) != 0) != in.src[2].negated;
            switch (in.bool_op) {
              case BoolOp::kAnd:
                t = t && c;
                f = f && c;
                break;
              case BoolOp::kOr:
                t = t || c;
                f = f || c;
                break;
              case BoolOp::kXor:
                t = t != c;
                f = f != c;
                break;
              case BoolOp::kNone:
                break;
            }
          }
          out[lane] = t ? 1 : 0;
          if (two) out2[lane] = f ? 1 : 0;
        }
        if (two) d[in.dst[1].reg] |= exec;
        break;
      }
      case Op::kSelp:
        for (uint32_t m = exec; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          const bool c = Value(in.src[2], r, lane) != 0;
          out[lane] = (c ? Value(in.src[0], r, lane) : Value(in.src[1], r, lane)) & dmask;
        }
        break;
      case Op::kCvt: {
        const bool sign = IsSigned(in.type) && TypeBits(in.type) < 64;
        for (uint32_t m = exec; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          uint64_t v = Convert(in, Value(in.src[0], r, lane));
          if (sign) v = static_cast<uint64_t>(SignExtend(v, TypeBits(in.type)));
          out[lane] = v & dmask;
        }
        break;
      }
      case Op::kCvta:
        for (uint32_t m = exec; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          uint64_t v = Value(in.src[0], r, lane);
          if (in.space == Space::kShared) v = in.mode ? v - kSharedWindow : v + kSharedWindow;
          out[lane] = v;
        }
        break;
      default: {
        const bool is_float = IsFloat(in.type);
        const bool f64 = in.type == Type::kF64;
        for (uint32_t m = exec; m; m &= m - 1) {
          const int lane = __builtin_ctz(m);
          const uint64_t a = Value(in.src[0], r, lane);
          const uint64_t b = in.num_src > 1 ? Value(in.src[1], r, lane) : 0;
          const uint64_t c = in.num_src > 2 ? Value(in.src[2], r, lane) : 0;
          const uint64_t v = !is_float ? IntAlu(in, a, b, c)
                             : f64     ? FloatAlu64(in, a, b, c)
                                       : FloatAlu32(in, a, b, c);
          out[lane] = v & dmask;
        }
        break;
      }
    }
    d[dst] |= exec;
  }

  const Entry& entry_;
  const LaunchConfig& config_;
  void* const* params_;
  const MemoryMap& memory_;
  LaunchReport* report_;

  std::vector<uint8_t> param_buf_;
  std::vector<MemoryRange> ranges_;
  MemoryRange* cache_ = nullptr;          // the executing instruction's entry of range_cache_
  LaunchBuffers& buffers_ = ThisThreadsLaunchBuffers();
  // per instruction: the allocation it touched last
  std::vector<MemoryRange>& range_cache_ = buffers_.range_cache;
  std::vector<uint8_t>& shared_ = buffers_.shared;
  uint32_t nregs_ = 0;
  uint32_t threads_ = 0;
  uint32_t nwarps_ = 0;
  std::vector<uint64_t>& regs_ = buffers_.regs;
  std::vector<uint32_t>& defined_ = buffers_.defined;
  std::vector<uint64_t> reg_mask_;
  std::vector<WarpState> warps_;
  Dim3 block_;
  // With count_traffic, per allocation of ranges_: one bit per sector it overlaps (allocated on
  // the first access), set when the launch reads / writes it.
  std::vector<std::vector<uint64_t>> read_sectors_;
  std::vector<std::vector<uint64_t>> written_sectors_;
  size_t last_range_ = 0;
};

}  // namespace

absl::Status Launch(const Entry& entry, const LaunchConfig& config, void* const* kernel_params,
                    const MemoryMap& memory, LaunchReport* report) {
  LaunchReport local;
  if (report == nullptr) report = &local;
  *report = LaunchReport{};
  Launcher launcher(entry, config, kernel_params, memory, report);
  absl::Status status = launcher.Run();
  launcher.FinishTraffic();
  return status;
}

}  // namespace normgrad::ptxsim
