#include "kernels/ptx/verifier.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ptx/cfg.h"
#include "kernels/ptx/ptx_printer.h"
#include "base/status_macros.h"
#include "kernels/ptx/targets.h"

namespace normgrad::kernels {
namespace {

bool IsInt(PtxType t) { return IsSigned(t) || IsUnsigned(t) || IsBits(t); }

// PTX operand-type compatibility for an instruction of type `inst`.
bool Compatible(PtxType inst, PtxType operand) {
  if (inst == PtxType::kPred || operand == PtxType::kPred) return inst == operand;
  if (PtxTypeBits(inst) != PtxTypeBits(operand)) return false;
  if (IsBits(inst) || IsBits(operand)) return true;
  if (IsFloat(inst) || IsFloat(operand)) return inst == operand;
  return true;  // signed/unsigned integers of the same size
}

bool IsIdentifier(absl::string_view s) {
  if (s.empty()) return false;
  const auto alpha = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (!alpha(s[0]) && !(s.size() > 1 && (s[0] == '_' || s[0] == '$'))) return false;
  for (char c : s) {
    if (!alpha(c) && !digit(c) && c != '_' && c != '$') return false;
  }
  return true;
}

// Static `.shared` declarations of one entry may not exceed 48 KiB.
constexpr uint64_t kMaxStaticSharedBytes = 48 * 1024;
// Threads per block on every target (sm_75 ... sm_121).
constexpr uint32_t kMaxThreadsPerBlock = 1024;

bool IsIeeeRounding(Rounding r) {
  return r == Rounding::kRn || r == Rounding::kRz || r == Rounding::kRm || r == Rounding::kRp;
}

class FunctionVerifier {
 public:
  explicit FunctionVerifier(const Function& f) : f_(f) {}

  absl::Status Run() {
    if (!IsIdentifier(f_.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry name \"", f_.name(), "\" is not a PTX identifier"));
    }
    std::set<std::string> names;
    for (const ParamDecl& p : f_.params()) {
      if (!IsIdentifier(p.name)) {
        return absl::InvalidArgumentError(absl::StrCat("entry ", f_.name(), ": parameter name \"",
                                                       p.name, "\" is not a PTX identifier"));
      }
      if (!names.insert(p.name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("entry ", f_.name(), ": parameter ", p.name, " is declared twice"));
      }
      if (p.type == PtxType::kPred) {
        return absl::InvalidArgumentError(
            absl::StrCat("entry ", f_.name(), ": parameter ", p.name, " has type .pred"));
      }
    }
    uint64_t shared_bytes = 0;
    for (const SharedDecl& sh : f_.shared()) {
      if (!IsIdentifier(sh.name) || !names.insert(sh.name).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "entry ", f_.name(), ": shared array name \"", sh.name,
            "\" is not a PTX identifier or is already used by a parameter or another array"));
      }
      if (sh.bytes == 0 || sh.align == 0 || (sh.align & (sh.align - 1)) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("entry ", f_.name(), ": shared array ", sh.name, " has ", sh.bytes,
                         " bytes and alignment ", sh.align,
                         "; needs at least 1 byte and a power-of-two alignment"));
      }
      shared_bytes += sh.bytes;
    }
    if (shared_bytes > kMaxStaticSharedBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entry ", f_.name(), ": ", shared_bytes, " bytes of static shared memory exceed ",
          kMaxStaticSharedBytes, ", the static limit (use dynamic shared memory beyond it)"));
    }
    if (f_.max_threads() > kMaxThreadsPerBlock) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry ", f_.name(), ": .maxntid ", f_.max_threads(), " exceeds ",
                       kMaxThreadsPerBlock, ", the most threads a block has on any target"));
    }
    if (f_.min_blocks_per_sm() != 0 &&
        (f_.max_threads() == 0 ||
         uint64_t{f_.min_blocks_per_sm()} * f_.max_threads() > kMaxThreadsPerBlock)) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry ", f_.name(), ": .minnctapersm ", f_.min_blocks_per_sm(),
                       " with .maxntid ", f_.max_threads(), " needs a .maxntid and at most ",
                       kMaxThreadsPerBlock, " threads per SM (what every target keeps resident)"));
    }
    const std::vector<Instruction>& code = f_.instructions();
    for (size_t i = 0; i < code.size(); ++i) {
      if (absl::Status s = CheckInstruction(code[i]); !s.ok()) return Located(i, s.message());
    }
    absl::StatusOr<Cfg> cfg = BuildCfg(f_);
    if (!cfg.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry ", f_.name(), ": ", cfg.status().message()));
    }
    if (cfg->falls_off_end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entry ", f_.name(), ": control reaches the end of the entry without ret or exit"));
    }
    return CheckDefinedBeforeUse(*cfg);
  }

 private:
  absl::Status Located(size_t index, absl::string_view problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat("entry ", f_.name(), ", instruction ", index, " (",
                     InstructionText(f_, f_.instructions()[index]), "): ", problem));
  }

  // A register handle must name an existing register of the same type.
  absl::Status CheckValue(const Value& v, absl::string_view role) const {
    if (!v.valid()) return absl::InvalidArgumentError(absl::StrCat(role, " is missing"));
    if (v.is_register()) {
      if (v.reg() >= f_.num_registers()) {
        return absl::InvalidArgumentError(
            absl::StrCat(role, " names register #", v.reg(), ", which does not exist"));
      }
      if (f_.register_type(v.reg()) != v.type()) {
        return absl::InvalidArgumentError(absl::StrCat(
            role, " handle says .", PtxTypeName(v.type()), " but register ",
            f_.RegisterName(v.reg()), " is .", PtxTypeName(f_.register_type(v.reg()))));
      }
    }
    if (v.is_shared_symbol() && v.shared_index() >= f_.shared().size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(role, " names shared array #", v.shared_index(), ", which is not declared"));
    }
    return absl::OkStatus();
  }

  absl::Status Expect(const Value& v, PtxType inst_type, absl::string_view role) const {
    NORMGRAD_RETURN_IF_ERROR(CheckValue(v, role));
    if (!Compatible(inst_type, v.type())) {
      return absl::InvalidArgumentError(absl::StrCat(role, " has type .", PtxTypeName(v.type()),
                                                     ", incompatible with .",
                                                     PtxTypeName(inst_type)));
    }
    return absl::OkStatus();
  }

  absl::Status ExpectDst(const Value& v, PtxType inst_type, absl::string_view role) const {
    if (v.valid() && !v.is_register()) {
      return absl::InvalidArgumentError(absl::StrCat(role, " must be a register"));
    }
    return Expect(v, inst_type, role);
  }

  absl::Status ExpectCounts(const Instruction& in, size_t dst, size_t src) const {
    if (in.dst.size() != dst || in.src.size() != src) {
      return absl::InvalidArgumentError(absl::StrCat("expects ", dst, " destination(s) and ", src,
                                                     " source(s), has ", in.dst.size(), " and ",
                                                     in.src.size()));
    }
    return absl::OkStatus();
  }

  // A two-operand arithmetic instruction of an integer or float type (not .pred or .bN), its
  // destination and both operands of that type.
  absl::Status ExpectArithmetic(const Instruction& in, absl::string_view first,
                                absl::string_view second) const {
    NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 2));
    const PtxType t = in.type;
    if (t == PtxType::kPred || IsBits(t)) {
      return absl::InvalidArgumentError(absl::StrCat("has no .", PtxTypeName(t), " form"));
    }
    NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
    NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, first));
    return Expect(in.src[1], t, second);
  }

  absl::Status ExpectAddress(const Value& base) const {
    NORMGRAD_RETURN_IF_ERROR(CheckValue(base, "address"));
    if (PtxTypeBits(base.type()) != 64 || !IsInt(base.type())) {
      return absl::InvalidArgumentError(absl::StrCat("address has type .", PtxTypeName(base.type()),
                                                     "; a 64-bit integer is required"));
    }
    return absl::OkStatus();
  }

  // An access of `lanes` elements must be aligned to its full size; the base register is the
  // caller's promise, the constant offset is checked here.
  absl::Status ExpectAlignedOffset(const Instruction& in, size_t lanes) const {
    const int64_t size = static_cast<int64_t>(lanes) * PtxTypeBits(in.type) / 8;
    if (size > 0 && in.offset % size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "address offset ", in.offset, " is not a multiple of the access size ", size, " bytes"));
    }
    return absl::OkStatus();
  }

  absl::Status NoRounding(const Instruction& in) const {
    if (in.rounding != Rounding::kNone) {
      return absl::InvalidArgumentError("takes no rounding modifier");
    }
    return absl::OkStatus();
  }

  absl::Status CheckInstruction(const Instruction& in) const {
    if (in.guard.valid()) {
      NORMGRAD_RETURN_IF_ERROR(CheckValue(in.guard, "guard"));
      if (!in.guard.is_register() || in.guard.type() != PtxType::kPred) {
        return absl::InvalidArgumentError("guard must be a .pred register");
      }
    }
    for (const Value& d : in.dst) {
      if (!d.is_register()) return absl::InvalidArgumentError("destination must be a register");
    }
    for (const Value& v : in.src) {
      if (v.is_shared_symbol() && in.op != Opcode::kMov) {
        return absl::InvalidArgumentError(
            "a shared array's address is read with mov.u64 (Builder::AddressOf) only");
      }
    }
    const PtxType t = in.type;
    switch (in.op) {
      case Opcode::kLabel:
        if (in.label >= f_.num_labels()) {
          return absl::InvalidArgumentError("binds a label that was never created");
        }
        return absl::OkStatus();
      case Opcode::kLdParam:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 0));
        if (in.param >= f_.params().size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("loads parameter #", in.param, ", which is not declared"));
        }
        if (f_.params()[in.param].type != t) {
          return absl::InvalidArgumentError(absl::StrCat(
              "loads .", PtxTypeName(t), " from parameter ", f_.params()[in.param].name,
              " declared .", PtxTypeName(f_.params()[in.param].type)));
        }
        return ExpectDst(in.dst[0], t, "destination");
      case Opcode::kLd:
        if (in.space == StateSpace::kParam) {
          return absl::InvalidArgumentError("parameters are read with ld.param (LdParam)");
        }
        if (in.src.size() != 1 ||
            (in.dst.size() != 1 && in.dst.size() != 2 && in.dst.size() != 4)) {
          return absl::InvalidArgumentError("expects an address and 1, 2 or 4 destinations");
        }
        if (t == PtxType::kPred) return absl::InvalidArgumentError("cannot load a .pred");
        NORMGRAD_RETURN_IF_ERROR(ExpectAddress(in.src[0]));
        NORMGRAD_RETURN_IF_ERROR(ExpectAlignedOffset(in, in.dst.size()));
        for (const Value& d : in.dst) NORMGRAD_RETURN_IF_ERROR(ExpectDst(d, t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(ExpectCacheOp(in));
        return NoRounding(in);
      case Opcode::kSt:
        if (in.space == StateSpace::kParam) {
          return absl::InvalidArgumentError("kernel parameters cannot be stored to");
        }
        if (in.src.size() != 2 && in.src.size() != 3 && in.src.size() != 5) {
          return absl::InvalidArgumentError("expects an address and 1, 2 or 4 values");
        }
        if (!in.dst.empty()) return absl::InvalidArgumentError("has no destination");
        if (t == PtxType::kPred) return absl::InvalidArgumentError("cannot store a .pred");
        NORMGRAD_RETURN_IF_ERROR(ExpectAddress(in.src[0]));
        NORMGRAD_RETURN_IF_ERROR(ExpectAlignedOffset(in, in.src.size() - 1));
        for (size_t k = 1; k < in.src.size(); ++k)
          NORMGRAD_RETURN_IF_ERROR(Expect(in.src[k], t, "value"));
        NORMGRAD_RETURN_IF_ERROR(ExpectCacheOp(in));
        return NoRounding(in);
      case Opcode::kAtomAdd:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 2));
        if (t != PtxType::kU32 && t != PtxType::kS32 && t != PtxType::kU64 && t != PtxType::kF32 &&
            t != PtxType::kF64) {
          return absl::InvalidArgumentError(
              absl::StrCat("atom.add has no .", PtxTypeName(t), " form"));
        }
        if (in.space == StateSpace::kParam) {
          return absl::InvalidArgumentError("atom.add needs .global or .shared");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectAddress(in.src[0]));
        NORMGRAD_RETURN_IF_ERROR(ExpectAlignedOffset(in, 1));
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[1], t, "value"));
        return NoRounding(in);
      case Opcode::kMov:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 1));
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "source"));
        return NoRounding(in);
      case Opcode::kAdd:
      case Opcode::kSub:
      case Opcode::kMin:
      case Opcode::kMax:
        NORMGRAD_RETURN_IF_ERROR(ExpectArithmetic(in, "first operand", "second operand"));
        if (IsFloat(t) && (in.op == Opcode::kAdd || in.op == Opcode::kSub)) {
          if (in.rounding != Rounding::kNone && !IsIeeeRounding(in.rounding)) {
            return absl::InvalidArgumentError("float add/sub take .rn/.rz/.rm/.rp only");
          }
          return absl::OkStatus();
        }
        return NoRounding(in);
      case Opcode::kMul:
      case Opcode::kMad: {
        const size_t nsrc = in.op == Opcode::kMul ? 2 : 3;
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, nsrc));
        if (t == PtxType::kPred || IsBits(t)) {
          return absl::InvalidArgumentError(absl::StrCat("has no .", PtxTypeName(t), " form"));
        }
        PtxType result = t;
        if (IsFloat(t)) {
          if (in.mul_mode != MulMode::kNone) {
            return absl::InvalidArgumentError("float multiply takes no .lo/.hi/.wide");
          }
          if (in.rounding != Rounding::kNone && !IsIeeeRounding(in.rounding)) {
            return absl::InvalidArgumentError("float mul/mad take .rn/.rz/.rm/.rp only");
          }
          if (in.op == Opcode::kMad && in.rounding == Rounding::kNone) {
            return absl::InvalidArgumentError("mad.f32 needs a rounding modifier (.rn)");
          }
        } else {
          if (in.mul_mode == MulMode::kNone) {
            return absl::InvalidArgumentError("integer multiply needs .lo, .hi or .wide");
          }
          NORMGRAD_RETURN_IF_ERROR(NoRounding(in));
          if (in.mul_mode == MulMode::kWide) {
            if (PtxTypeBits(t) != 16 && PtxTypeBits(t) != 32) {
              return absl::InvalidArgumentError(".wide needs a 16- or 32-bit source type");
            }
            result = IsSigned(t) ? (PtxTypeBits(t) == 16 ? PtxType::kS32 : PtxType::kS64)
                                 : (PtxTypeBits(t) == 16 ? PtxType::kU32 : PtxType::kU64);
          }
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], result, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "first operand"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[1], t, "second operand"));
        if (nsrc == 3) NORMGRAD_RETURN_IF_ERROR(Expect(in.src[2], result, "addend"));
        return absl::OkStatus();
      }
      case Opcode::kFma:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 3));
        if (t != PtxType::kF32 && t != PtxType::kF64) {
          return absl::InvalidArgumentError("fma is for .f32 and .f64");
        }
        if (!IsIeeeRounding(in.rounding)) {
          return absl::InvalidArgumentError("fma needs .rn, .rz, .rm or .rp");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        for (const Value& v : in.src) NORMGRAD_RETURN_IF_ERROR(Expect(v, t, "operand"));
        return absl::OkStatus();
      case Opcode::kDiv:
      case Opcode::kRem:
        NORMGRAD_RETURN_IF_ERROR(ExpectArithmetic(in, "dividend", "divisor"));
        if (IsFloat(t)) {
          if (in.op == Opcode::kRem) return absl::InvalidArgumentError("rem is integer only");
          const bool ok = IsIeeeRounding(in.rounding) ||
                          (t == PtxType::kF32 &&
                           (in.rounding == Rounding::kApprox || in.rounding == Rounding::kFull));
          if (!ok) {
            return absl::InvalidArgumentError(
                "float div needs .rn/.rz/.rm/.rp (IEEE), or .approx/.full (f32 only)");
          }
          return absl::OkStatus();
        }
        return NoRounding(in);
      case Opcode::kNeg:
      case Opcode::kAbs:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 1));
        if (!IsSigned(t) && !IsFloat(t)) {
          return absl::InvalidArgumentError(absl::StrCat("has no .", PtxTypeName(t), " form"));
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "operand"));
        return NoRounding(in);
      case Opcode::kSqrt:
      case Opcode::kRcp:
      case Opcode::kRsqrt: {
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 1));
        if (t != PtxType::kF32 && t != PtxType::kF64) {
          return absl::InvalidArgumentError("is for .f32 and .f64");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "operand"));
        if (in.op == Opcode::kRsqrt) {
          if (in.rounding != Rounding::kApprox) {
            return absl::InvalidArgumentError("rsqrt exists only as .approx");
          }
          return absl::OkStatus();
        }
        const bool ok =
            IsIeeeRounding(in.rounding) || (t == PtxType::kF32 && in.rounding == Rounding::kApprox);
        if (!ok) {
          return absl::InvalidArgumentError(
              "needs an explicit .rn/.rz/.rm/.rp (exact) or .approx (f32 only)");
        }
        return absl::OkStatus();
      }
      case Opcode::kCvt: {
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 1));
        const PtxType from = in.src_type;
        if (t == PtxType::kPred || from == PtxType::kPred || IsBits(t) || IsBits(from)) {
          return absl::InvalidArgumentError("cvt converts between integer and float types only");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], from, "source"));
        if (IsFloat(from) && !IsFloat(t)) {
          return absl::InvalidArgumentError(
              "float-to-integer cvt (needs .rni/.rzi) is not supported by this builder");
        }
        const bool needs_rounding =
            (!IsFloat(from) && IsFloat(t)) ||
            (IsFloat(from) && IsFloat(t) && PtxTypeBits(t) < PtxTypeBits(from));
        if (needs_rounding && !IsIeeeRounding(in.rounding)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "cvt.", PtxTypeName(t), ".", PtxTypeName(from), " needs .rn/.rz/.rm/.rp"));
        }
        if (!needs_rounding) return NoRounding(in);
        return absl::OkStatus();
      }
      case Opcode::kAnd:
      case Opcode::kOr:
      case Opcode::kXor:
      case Opcode::kNot: {
        const size_t nsrc = in.op == Opcode::kNot ? 1 : 2;
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, nsrc));
        if (!IsBits(t) && t != PtxType::kPred) {
          return absl::InvalidArgumentError("logic operations take .bN or .pred");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        for (const Value& v : in.src) NORMGRAD_RETURN_IF_ERROR(Expect(v, t, "operand"));
        return NoRounding(in);
      }
      case Opcode::kShl:
      case Opcode::kShr:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 2));
        if (!IsInt(t) || PtxTypeBits(t) < 16) {
          return absl::InvalidArgumentError("shifts take 16/32/64-bit integer types");
        }
        if (in.op == Opcode::kShl && !IsBits(t)) {
          return absl::InvalidArgumentError("shl takes .b16/.b32/.b64");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "operand"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[1], PtxType::kU32, "shift amount"));
        return NoRounding(in);
      case Opcode::kSetp:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 2));
        if (t == PtxType::kPred) return absl::InvalidArgumentError("setp cannot compare .pred");
        if (IsBits(t) && in.cmp != CmpOp::kEq && in.cmp != CmpOp::kNe) {
          return absl::InvalidArgumentError(".bN comparisons are eq/ne only");
        }
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], PtxType::kPred, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "first operand"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[1], t, "second operand"));
        return NoRounding(in);
      case Opcode::kSelp:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 1, 3));
        if (t == PtxType::kPred) return absl::InvalidArgumentError("selp cannot select .pred");
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "first operand"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[1], t, "second operand"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[2], PtxType::kPred, "selector"));
        return NoRounding(in);
      case Opcode::kBra:
        if (!in.dst.empty() || !in.src.empty()) {
          return absl::InvalidArgumentError("bra takes only a label");
        }
        if (in.label >= f_.num_labels()) {
          return absl::InvalidArgumentError("branches to a label that was never created");
        }
        return absl::OkStatus();
      case Opcode::kShfl:
        if (in.dst.empty() || in.dst.size() > 2 || in.src.size() != 4) {
          return absl::InvalidArgumentError("shfl.sync expects d[|p], a, b, c, membermask");
        }
        if (t != PtxType::kB32) return absl::InvalidArgumentError("shfl.sync is .b32 only");
        NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[0], t, "destination"));
        if (in.dst.size() == 2) {
          NORMGRAD_RETURN_IF_ERROR(ExpectDst(in.dst[1], PtxType::kPred, "predicate destination"));
        }
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], t, "value"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[1], t, "lane/delta"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[2], t, "clamp"));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[3], t, "member mask"));
        return NoRounding(in);
      case Opcode::kBarSync:
        NORMGRAD_RETURN_IF_ERROR(ExpectCounts(in, 0, 1));
        NORMGRAD_RETURN_IF_ERROR(Expect(in.src[0], PtxType::kU32, "barrier id"));
        if (in.src[0].is_immediate() && in.src[0].bits() > 15) {
          return absl::InvalidArgumentError("barrier id must be 0..15");
        }
        return absl::OkStatus();
      case Opcode::kRet:
      case Opcode::kExit:
      case Opcode::kFence:
        return ExpectCounts(in, 0, 0);
    }
    return absl::InvalidArgumentError("unknown opcode");
  }

  // A cache operator only on global ld/st, and one of those the access kind has (PTX ISA, "Cache
  // Operators": loads .ca .cg .cs .lu .cv, stores .wb .cg .cs .wt).
  static absl::Status ExpectCacheOp(const Instruction& in) {
    if (in.cache == CacheOp::kNone) return absl::OkStatus();
    if (in.space != StateSpace::kGlobal) {
      return absl::InvalidArgumentError("a cache operator applies to .global accesses only");
    }
    const bool load = in.op == Opcode::kLd;
    const bool ok =
        in.cache == CacheOp::kCg || in.cache == CacheOp::kCs ||
        (load ? in.cache == CacheOp::kCa || in.cache == CacheOp::kLu || in.cache == CacheOp::kCv
              : in.cache == CacheOp::kWb || in.cache == CacheOp::kWt);
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(load ? "ld" : "st", " has no cache operator .", CacheOpName(in.cache)));
    }
    return absl::OkStatus();
  }

  // Forward must-analysis: a register is defined at a point when every path from the entry
  // writes it without a guard.
  absl::Status CheckDefinedBeforeUse(const Cfg& cfg) const {
    const size_t nregs = f_.num_registers();
    const int nblocks = static_cast<int>(cfg.blocks.size());
    std::vector<std::vector<char>> in(nblocks, std::vector<char>(nregs, 1));
    std::vector<std::vector<char>> out(nblocks, std::vector<char>(nregs, 1));
    in[0].assign(nregs, 0);
    const auto transfer = [&](int b, std::vector<char> state) {
      for (size_t i = cfg.blocks[b].begin; i < cfg.blocks[b].end; ++i) {
        const Instruction& inst = f_.instructions()[i];
        if (inst.guard.valid()) continue;
        for (const Value& d : inst.dst) {
          if (d.is_register() && d.reg() < nregs) state[d.reg()] = 1;
        }
      }
      return state;
    };
    bool changed = true;
    while (changed) {
      changed = false;
      for (int b = 0; b < nblocks; ++b) {
        std::vector<char> state(nregs, b == 0 ? 0 : 1);
        if (b != 0) {
          for (int p : cfg.blocks[b].preds) {
            for (size_t r = 0; r < nregs; ++r) state[r] = state[r] && out[p][r];
          }
        }
        if (state != in[b]) {
          in[b] = state;
          changed = true;
        }
        std::vector<char> next = transfer(b, in[b]);
        if (next != out[b]) {
          out[b] = std::move(next);
          changed = true;
        }
      }
    }
    // Blocks no path reaches are skipped: nothing in them runs.
    std::vector<bool> reachable(nblocks, false);
    std::vector<int> stack{0};
    reachable[0] = true;
    while (!stack.empty()) {
      const int b = stack.back();
      stack.pop_back();
      for (int s : cfg.blocks[b].succs) {
        if (s < nblocks && !reachable[s]) {
          reachable[s] = true;
          stack.push_back(s);
        }
      }
    }
    for (int b = 0; b < nblocks; ++b) {
      if (!reachable[b]) continue;
      std::vector<char> state = in[b];
      for (size_t i = cfg.blocks[b].begin; i < cfg.blocks[b].end; ++i) {
        const Instruction& inst = f_.instructions()[i];
        std::vector<Value> reads = inst.src;
        if (inst.guard.valid()) reads.push_back(inst.guard);
        for (const Value& v : reads) {
          if (v.is_register() && v.reg() < nregs && !state[v.reg()]) {
            return Located(i, absl::StrCat("reads ", f_.RegisterName(v.reg()),
                                           " before it is written on every path"));
          }
        }
        if (!inst.guard.valid()) {
          for (const Value& d : inst.dst) {
            if (d.is_register() && d.reg() < nregs) state[d.reg()] = 1;
          }
        }
      }
    }
    return absl::OkStatus();
  }

  const Function& f_;
};

}  // namespace

absl::Status VerifyFunction(const Function& function) { return FunctionVerifier(function).Run(); }

absl::Status Verify(const Module& module) {
  absl::StatusOr<PtxVersion> target_min = MinPtxVersionForTarget(module.target_sm());
  if (!target_min.ok()) return target_min.status();
  if (module.version() < *target_min) {
    return absl::InvalidArgumentError(
        absl::StrCat(".version ", module.version().ToString(), " is below ", target_min->ToString(),
                     ", the lowest PTX ISA version that supports sm_", module.target_sm()));
  }
  const PtxVersion needed = InstructionsMinPtxVersion(module);
  if (module.version() < needed) {
    return absl::InvalidArgumentError(absl::StrCat(".version ", module.version().ToString(),
                                                   " is below ", needed.ToString(),
                                                   ", which the module's instructions need"));
  }
  if (kMaxPtxVersion < module.version()) {
    return absl::InvalidArgumentError(absl::StrCat(".version ", module.version().ToString(),
                                                   " is newer than ", kMaxPtxVersion.ToString()));
  }
  if (module.target_sm() < 80) {
    for (const Function& f : module.functions()) {
      for (const Instruction& in : f.instructions()) {
        if (in.type == PtxType::kBF16 || (in.op == Opcode::kCvt && in.src_type == PtxType::kBF16)) {
          return absl::InvalidArgumentError(
              absl::StrCat("entry ", f.name(), " uses .bf16 (", InstructionText(f, in),
                           "), which needs sm_80 or newer; the target is sm_", module.target_sm()));
        }
      }
    }
  }
  if (module.functions().empty()) {
    return absl::InvalidArgumentError("module has no entry");
  }
  std::set<std::string> names;
  for (const Function& f : module.functions()) {
    if (!names.insert(f.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("entry ", f.name(), " is declared twice"));
    }
    NORMGRAD_RETURN_IF_ERROR(VerifyFunction(f));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::kernels
