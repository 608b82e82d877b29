#include "kernels/ptx/ptx_ir.h"

#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace normgrad::kernels {
namespace {

using ptx_internal::EnumTableEntry;

// Register classes, in `.reg` declaration order.
enum RegClass { kClassPred = 0, kClass16, kClass32, kClass64, kClassF32, kClassF64 };
constexpr absl::string_view kClassPrefix[] = {"%p", "%rs", "%r", "%rd", "%f", "%fd"};
constexpr absl::string_view kClassDeclType[] = {"pred", "b16", "b32", "b64", "f32", "f64"};
static_assert(std::size(kClassPrefix) == kClassF64 + 1 &&
              std::size(kClassDeclType) == kClassF64 + 1);

enum class TypeKind : uint8_t { kPred, kBits, kUnsigned, kSigned, kFloat, kUnknown };

struct TypeInfo {
  absl::string_view name;
  int bits;
  TypeKind kind;
  RegClass reg_class;
};

// Indexed by PtxType.
constexpr TypeInfo kTypes[] = {
    {"pred", 1, TypeKind::kPred, kClassPred},    // kPred
    {"b16", 16, TypeKind::kBits, kClass16},      // kB16
    {"b32", 32, TypeKind::kBits, kClass32},      // kB32
    {"b64", 64, TypeKind::kBits, kClass64},      // kB64
    {"u16", 16, TypeKind::kUnsigned, kClass16},  // kU16
    {"u32", 32, TypeKind::kUnsigned, kClass32},  // kU32
    {"u64", 64, TypeKind::kUnsigned, kClass64},  // kU64
    {"s16", 16, TypeKind::kSigned, kClass16},    // kS16
    {"s32", 32, TypeKind::kSigned, kClass32},    // kS32
    {"s64", 64, TypeKind::kSigned, kClass64},    // kS64
    {"f16", 16, TypeKind::kFloat, kClass16},     // kF16
    {"bf16", 16, TypeKind::kFloat, kClass16},    // kBF16
    {"f32", 32, TypeKind::kFloat, kClassF32},    // kF32
    {"f64", 64, TypeKind::kFloat, kClassF64},    // kF64
};
static_assert(std::size(kTypes) == static_cast<size_t>(PtxType::kF64) + 1, "one per PtxType");

constexpr TypeInfo Info(PtxType type) {
  return EnumTableEntry(kTypes, type, TypeInfo{"?", 0, TypeKind::kUnknown, kClass32});
}

// Indexed by SpecialReg.
constexpr absl::string_view kSpecialRegNames[] = {
    "%tid.x",   "%tid.y",   "%tid.z",    "%ntid.x",   "%ntid.y",   "%ntid.z", "%ctaid.x",
    "%ctaid.y", "%ctaid.z", "%nctaid.x", "%nctaid.y", "%nctaid.z", "%laneid", "%warpid",
};
static_assert(std::size(kSpecialRegNames) == static_cast<size_t>(SpecialReg::kWarpId) + 1,
              "one per SpecialReg");

// Indexed by Opcode.
constexpr absl::string_view kOpcodeNames[] = {
    "ld",     // kLdParam
    "ld",     // kLd
    "st",     // kSt
    "atom",   // kAtomAdd
    "mov",    // kMov
    "add",    // kAdd
    "sub",    // kSub
    "mul",    // kMul
    "mad",    // kMad
    "fma",    // kFma
    "div",    // kDiv
    "rem",    // kRem
    "min",    // kMin
    "max",    // kMax
    "neg",    // kNeg
    "abs",    // kAbs
    "cvt",    // kCvt
    "sqrt",   // kSqrt
    "rsqrt",  // kRsqrt
    "rcp",    // kRcp
    "and",    // kAnd
    "or",     // kOr
    "xor",    // kXor
    "not",    // kNot
    "shl",    // kShl
    "shr",    // kShr
    "setp",   // kSetp
    "selp",   // kSelp
    "bra",    // kBra
    "shfl",   // kShfl
    "bar",    // kBarSync
    "ret",    // kRet
    "exit",   // kExit
    "fence",  // kFence
    "label",  // kLabel
};
static_assert(std::size(kOpcodeNames) == static_cast<size_t>(Opcode::kLabel) + 1, "one per Opcode");

}  // namespace

absl::string_view PtxTypeName(PtxType type) { return Info(type).name; }
int PtxTypeBits(PtxType type) { return Info(type).bits; }
bool IsFloat(PtxType type) { return Info(type).kind == TypeKind::kFloat; }
bool IsSigned(PtxType type) { return Info(type).kind == TypeKind::kSigned; }
bool IsUnsigned(PtxType type) { return Info(type).kind == TypeKind::kUnsigned; }
bool IsBits(PtxType type) { return Info(type).kind == TypeKind::kBits; }

PtxType BitTypeOf(PtxType type) {
  switch (PtxTypeBits(type)) {
    case 1:
      return PtxType::kPred;
    case 16:
      return PtxType::kB16;
    case 64:
      return PtxType::kB64;
    default:
      return PtxType::kB32;
  }
}

absl::string_view SpecialRegName(SpecialReg reg) {
  return EnumTableEntry(kSpecialRegNames, reg, absl::string_view("%?"));
}

absl::string_view OpcodeName(Opcode op) {
  return EnumTableEntry(kOpcodeNames, op, absl::string_view("?"));
}

Value Value::S32(int32_t v) {
  return Value(Kind::kImmediate, PtxType::kS32, static_cast<uint32_t>(v));
}

Value Value::F32(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return Value(Kind::kImmediate, PtxType::kF32, bits);
}

Value Value::F64(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return Value(Kind::kImmediate, PtxType::kF64, bits);
}

Param Function::AddParam(PtxType type, absl::string_view name) {
  params_.push_back(ParamDecl{std::string(name), type});
  return Param{static_cast<uint32_t>(params_.size() - 1), type};
}

SharedArray Function::AddShared(absl::string_view name, uint32_t bytes, uint32_t align) {
  shared_.push_back(SharedDecl{std::string(name), bytes, align});
  return SharedArray{static_cast<uint32_t>(shared_.size() - 1)};
}

Value Function::NewRegister(PtxType type) {
  registers_.push_back(RegisterInfo{type, ++class_counts_[Info(type).reg_class]});
  return Value::Register(static_cast<uint32_t>(registers_.size() - 1), type);
}

std::string Function::RegisterName(uint32_t index) const {
  if (index >= registers_.size()) return absl::StrCat("%undefined", index);
  const RegisterInfo& info = registers_[index];
  return absl::StrCat(kClassPrefix[Info(info.type).reg_class], info.class_index);
}

Label Function::NewLabel(absl::string_view hint) {
  const uint32_t id = static_cast<uint32_t>(labels_.size());
  std::string clean(hint);
  for (char& c : clean) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!ok) c = '_';
  }
  labels_.push_back(LabelDecl{absl::StrCat("$L_", clean, "_", id)});
  return Label{id};
}

std::vector<Function::RegClassUse> Function::RegisterClasses() const {
  std::vector<RegClassUse> out;
  for (size_t c = 0; c < std::size(kClassPrefix); ++c) {
    if (class_counts_[c] == 0) continue;
    out.push_back(RegClassUse{kClassPrefix[c], kClassDeclType[c], class_counts_[c] + 1});
  }
  return out;
}

Function& Module::AddEntry(absl::string_view name) {
  functions_.emplace_back(std::string(name));
  return functions_.back();
}

absl::string_view CacheOpName(CacheOp op) {
  static constexpr absl::string_view kNames[] = {"", "ca", "cg", "cs", "lu", "cv", "wb", "wt"};
  static_assert(std::size(kNames) == static_cast<size_t>(CacheOp::kWt) + 1, "one per CacheOp");
  return ptx_internal::EnumTableEntry(kNames, op, absl::string_view());
}

PtxVersion InstructionsMinPtxVersion(const Module& module) {
  // shfl.sync, bar.sync with member semantics and fence.acq_rel: PTX ISA 6.0
  PtxVersion need{6, 0};
  for (const Function& f : module.functions()) {
    for (const Instruction& inst : f.instructions()) {
      // bf16 arithmetic and cvt need 7.0 (sm_80); nothing else we emit needs more than 6.0.
      if (inst.type == PtxType::kBF16 || inst.src_type == PtxType::kBF16) {
        if (need < PtxVersion{7, 0}) need = PtxVersion{7, 0};
      }
    }
  }
  return need;
}

}  // namespace normgrad::kernels
