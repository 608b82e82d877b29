// The decoded form of a PTX module: what the parser produces once per load and the interpreter
// executes without ever looking at text again.
//
//   absl::StatusOr<ptxsim::Module> module = ptxsim::ParsePtx(ptx_text);
//   const ptxsim::Entry* entry = module->FindEntry("batched_rms_norm_backward");
//   // entry->code[i] is one decoded instruction; registers are dense slots.
//
// Registers are numbered slots (one 64-bit cell per lane each). The first kNumSpecialSlots slots
// hold the special registers (%tid.x, %ctaid.x, ...), filled in when a warp is created.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace normgrad::ptxsim {

enum class Type : uint8_t {
  kNone,
  kPred,
  kB8,
  kB16,
  kB32,
  kB64,
  kU8,
  kU16,
  kU32,
  kU64,
  kS8,
  kS16,
  kS32,
  kS64,
  kF16,
  kBF16,
  kF32,
  kF64,
};
// 1 for .pred.
constexpr int TypeBits(Type type) {
  switch (type) {
    case Type::kNone:
      return 0;
    case Type::kPred:
      return 1;
    case Type::kB8:
    case Type::kU8:
    case Type::kS8:
      return 8;
    case Type::kB16:
    case Type::kU16:
    case Type::kS16:
    case Type::kF16:
    case Type::kBF16:
      return 16;
    case Type::kB32:
    case Type::kU32:
    case Type::kS32:
    case Type::kF32:
      return 32;
    case Type::kB64:
    case Type::kU64:
    case Type::kS64:
    case Type::kF64:
      return 64;
  }
  return 0;
}
// f16, bf16, f32, f64.
constexpr bool IsFloat(Type type) {
  return type == Type::kF16 || type == Type::kBF16 || type == Type::kF32 || type == Type::kF64;
}
// s8..s64.
constexpr bool IsSigned(Type type) {
  return type == Type::kS8 || type == Type::kS16 || type == Type::kS32 || type == Type::kS64;
}
absl::string_view TypeName(Type type);  // "f32"

enum class Op : uint8_t {
  kLd,
  kSt,
  kMov,
  kAdd,
  kSub,
  kMul,
  kMad,
  kFma,
  kDiv,
  kRem,
  kMin,
  kMax,
  kNeg,
  kAbs,
  kAnd,
  kOr,
  kXor,
  kNot,
  kCnot,
  kShl,
  kShr,
  kPopc,
  kClz,
  kSqrt,
  kRsqrt,
  kRcp,
  kEx2,
  kLg2,
  kSetp,
  kSelp,
  kCvt,
  kCvta,
  kBra,
  kExit,
  kBar,
  kShfl,
  kAtom,
  kRed,
  kNop,
};

enum class Space : uint8_t { kNone, kParam, kGlobal, kShared, kGeneric };

// Modifier byte: meaning depends on the opcode.
enum class MulMode : uint8_t { kNone, kLo, kHi, kWide };
enum class Cmp : uint8_t {
  kEq,
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kLo,
  kLs,
  kHi,
  kHs,
  kEqu,
  kNeu,
  kLtu,
  kLeu,
  kGtu,
  kGeu,
  kNum,
  kNan,
};
enum class BoolOp : uint8_t { kNone, kAnd, kOr, kXor };
enum class ShflMode : uint8_t { kUp, kDown, kBfly, kIdx };
enum class AtomOp : uint8_t { kAdd, kMin, kMax, kExch, kCas, kAnd, kOr, kXor, kInc, kDec };
// Rounding of a floating-point result (.rn is also the default when none is written).
enum class FloatRound : uint8_t { kRn, kRz, kRm, kRp };
// Float-to-integer (or float-to-float integral) rounding of cvt.
enum class IntRound : uint8_t { kNone, kRni, kRzi, kRmi, kRpi };

inline constexpr uint32_t kNoReg = 0xffffffffu;

// Special registers, in slot order.
enum SpecialSlot : uint32_t {
  kTidX,
  kTidY,
  kTidZ,
  kNtidX,
  kNtidY,
  kNtidZ,
  kCtaidX,
  kCtaidY,
  kCtaidZ,
  kNctaidX,
  kNctaidY,
  kNctaidZ,
  kLaneId,
  kWarpId,
  kNwarpId,
  kLanemaskEq,
  kLanemaskLt,
  kLanemaskLe,
  kLanemaskGt,
  kLanemaskGe,
  kNumSpecialSlots,
};

struct Operand {
  enum class Kind : uint8_t { kNone, kReg, kImm, kAddress };
  Kind kind = Kind::kNone;
  bool negated = false;   // `!%p` (predicate operand of setp's boolean form)
  uint32_t reg = kNoReg;  // kReg: the slot; kAddress: the base register or kNoReg
  uint64_t imm = 0;       // kImm: bits in the operand's type; kAddress: the byte offset
};

struct Instruction {
  Op op = Op::kNop;
  Type type = Type::kNone;      // the instruction type (for cvt: the destination type)
  Type src_type = Type::kNone;  // cvt's source type
  Space space = Space::kNone;   // ld/st/atom/red/cvta
  uint8_t vec = 1;              // ld/st .v2/.v4
  uint8_t mode = 0;             // MulMode / Cmp / ShflMode / AtomOp / IntRound / cvta direction
  BoolOp bool_op = BoolOp::kNone;
  FloatRound rounding = FloatRound::kRn;
  bool ftz = false;
  bool sat = false;
  bool approx = false;  // .approx or .full: executed exactly (see docs/ptxsim.md)
  bool uni = false;     // bra.uni
  bool guard_negated = false;
  uint32_t guard = kNoReg;  // @%p / @!%p predicate slot
  uint8_t num_dst = 0;
  uint8_t num_src = 0;
  Operand dst[4];       // ld.v4 writes four; shfl/setp write a second predicate
  Operand src[5];       // st.v4: the address and four values
  uint32_t target = 0;  // bra: instruction index
  uint32_t line = 0;    // 1-based line in the PTX text
};

struct Param {
  std::string name;
  Type type = Type::kNone;
  uint32_t size = 0;
  uint32_t align = 0;
  uint32_t offset = 0;  // in the entry's parameter buffer
};

struct Entry {
  std::string name;
  std::vector<Param> params;
  uint32_t param_bytes = 0;
  std::vector<Instruction> code;
  std::vector<std::string> reg_names;  // by slot (specials included)
  std::vector<Type> reg_types;         // by slot
  uint32_t static_shared_bytes = 0;    // .shared variables; dynamic (extern) memory follows
  uint32_t max_threads_per_block = 0;  // from .maxntid / .reqntid; 0 when absent
  uint32_t line = 0;

  uint32_t NumRegs() const { return static_cast<uint32_t>(reg_names.size()); }
};

struct Module {
  int version_major = 0;
  int version_minor = 0;
  int target_sm = 0;
  std::vector<Entry> entries;

  const Entry* FindEntry(absl::string_view name) const;
  uint64_t InstructionCount() const;
};

}  // namespace normgrad::ptxsim
