#include "kernels/ptx_builder.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace normgrad::kernels {
namespace {

// Register classes, in `.reg` declaration order.
enum RegClass { kClassPred = 0, kClass16, kClass32, kClass64, kClassF32, kClassF64 };
constexpr absl::string_view kClassPrefix[] = {"%p", "%rs", "%r", "%rd", "%f", "%fd"};
constexpr absl::string_view kClassDeclType[] = {"pred", "b16", "b32", "b64", "f32", "f64"};

RegClass ClassOf(PtxType type) {
  switch (type) {
    case PtxType::kPred:
      return kClassPred;
    case PtxType::kB16:
    case PtxType::kU16:
    case PtxType::kS16:
    case PtxType::kF16:
    case PtxType::kBF16:
      return kClass16;
    case PtxType::kB32:
    case PtxType::kU32:
    case PtxType::kS32:
      return kClass32;
    case PtxType::kB64:
    case PtxType::kU64:
    case PtxType::kS64:
      return kClass64;
    case PtxType::kF32:
      return kClassF32;
    case PtxType::kF64:
      return kClassF64;
  }
  return kClass32;
}

PtxType WideTypeOf(PtxType type) {
  switch (type) {
    case PtxType::kU16:
      return PtxType::kU32;
    case PtxType::kS16:
      return PtxType::kS32;
    case PtxType::kU32:
      return PtxType::kU64;
    case PtxType::kS32:
      return PtxType::kS64;
    default:
      return type;  // invalid for mul.wide; Verify reports it
  }
}

}  // namespace

absl::string_view PtxTypeName(PtxType type) {
  switch (type) {
    case PtxType::kPred:
      return "pred";
    case PtxType::kB16:
      return "b16";
    case PtxType::kB32:
      return "b32";
    case PtxType::kB64:
      return "b64";
    case PtxType::kU16:
      return "u16";
    case PtxType::kU32:
      return "u32";
    case PtxType::kU64:
      return "u64";
    case PtxType::kS16:
      return "s16";
    case PtxType::kS32:
      return "s32";
    case PtxType::kS64:
      return "s64";
    case PtxType::kF16:
      return "f16";
    case PtxType::kBF16:
      return "bf16";
    case PtxType::kF32:
      return "f32";
    case PtxType::kF64:
      return "f64";
  }
  return "?";
}

int PtxTypeBits(PtxType type) {
  switch (type) {
    case PtxType::kPred:
      return 1;
    case PtxType::kB16:
    case PtxType::kU16:
    case PtxType::kS16:
    case PtxType::kF16:
    case PtxType::kBF16:
      return 16;
    case PtxType::kB32:
    case PtxType::kU32:
    case PtxType::kS32:
    case PtxType::kF32:
      return 32;
    case PtxType::kB64:
    case PtxType::kU64:
    case PtxType::kS64:
    case PtxType::kF64:
      return 64;
  }
  return 0;
}

bool IsFloat(PtxType t) {
  return t == PtxType::kF16 || t == PtxType::kBF16 || t == PtxType::kF32 || t == PtxType::kF64;
}
bool IsSigned(PtxType t) { return t == PtxType::kS16 || t == PtxType::kS32 || t == PtxType::kS64; }
bool IsUnsigned(PtxType t) {
  return t == PtxType::kU16 || t == PtxType::kU32 || t == PtxType::kU64;
}
bool IsBits(PtxType t) { return t == PtxType::kB16 || t == PtxType::kB32 || t == PtxType::kB64; }

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
  switch (reg) {
    case SpecialReg::kTidX:
      return "%tid.x";
    case SpecialReg::kTidY:
      return "%tid.y";
    case SpecialReg::kTidZ:
      return "%tid.z";
    case SpecialReg::kNtidX:
      return "%ntid.x";
    case SpecialReg::kNtidY:
      return "%ntid.y";
    case SpecialReg::kNtidZ:
      return "%ntid.z";
    case SpecialReg::kCtaidX:
      return "%ctaid.x";
    case SpecialReg::kCtaidY:
      return "%ctaid.y";
    case SpecialReg::kCtaidZ:
      return "%ctaid.z";
    case SpecialReg::kNctaidX:
      return "%nctaid.x";
    case SpecialReg::kNctaidY:
      return "%nctaid.y";
    case SpecialReg::kNctaidZ:
      return "%nctaid.z";
    case SpecialReg::kLaneId:
      return "%laneid";
    case SpecialReg::kWarpId:
      return "%warpid";
  }
  return "%?";
}

absl::string_view OpcodeName(Opcode op) {
  switch (op) {
    case Opcode::kLdParam:
      return "ld";
    case Opcode::kLd:
      return "ld";
    case Opcode::kSt:
      return "st";
    case Opcode::kAtomAdd:
      return "atom";
    case Opcode::kMov:
      return "mov";
    case Opcode::kAdd:
      return "add";
    case Opcode::kSub:
      return "sub";
    case Opcode::kMul:
      return "mul";
    case Opcode::kMad:
      return "mad";
    case Opcode::kFma:
      return "fma";
    case Opcode::kDiv:
      return "div";
    case Opcode::kRem:
      return "rem";
    case Opcode::kMin:
      return "min";
    case Opcode::kMax:
      return "max";
    case Opcode::kNeg:
      return "neg";
    case Opcode::kAbs:
      return "abs";
    case Opcode::kCvt:
      return "cvt";
    case Opcode::kSqrt:
      return "sqrt";
    case Opcode::kRsqrt:
      return "rsqrt";
    case Opcode::kRcp:
      return "rcp";
    case Opcode::kAnd:
      return "and";
    case Opcode::kOr:
      return "or";
    case Opcode::kXor:
      return "xor";
    case Opcode::kNot:
      return "not";
    case Opcode::kShl:
      return "shl";
    case Opcode::kShr:
      return "shr";
    case Opcode::kSetp:
      return "setp";
    case Opcode::kSelp:
      return "selp";
    case Opcode::kBra:
      return "bra";
    case Opcode::kShfl:
      return "shfl";
    case Opcode::kBarSync:
      return "bar";
    case Opcode::kRet:
      return "ret";
    case Opcode::kExit:
      return "exit";
    case Opcode::kLabel:
      return "label";
  }
  return "?";
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

// ---------------------------------------------------------------------------------------------
// Function / Module

Param Function::AddParam(PtxType type, absl::string_view name) {
  params_.push_back(ParamDecl{std::string(name), type});
  return Param{static_cast<uint32_t>(params_.size() - 1), type};
}

SharedArray Function::AddShared(absl::string_view name, uint32_t bytes, uint32_t align) {
  shared_.push_back(SharedDecl{std::string(name), bytes, align});
  return SharedArray{static_cast<uint32_t>(shared_.size() - 1)};
}

Value Function::NewRegister(PtxType type) {
  const RegClass c = ClassOf(type);
  registers_.push_back(RegisterInfo{type, ++class_counts_[c]});
  return Value::Register(static_cast<uint32_t>(registers_.size() - 1), type);
}

std::string Function::RegisterName(uint32_t index) const {
  if (index >= registers_.size()) return absl::StrCat("%undefined", index);
  const RegisterInfo& info = registers_[index];
  return absl::StrCat(kClassPrefix[ClassOf(info.type)], info.class_index);
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
  for (int c = 0; c < 6; ++c) {
    if (class_counts_[c] == 0) continue;
    out.push_back(RegClassUse{kClassPrefix[c], kClassDeclType[c], class_counts_[c] + 1});
  }
  return out;
}

Function& Module::AddEntry(absl::string_view name) {
  functions_.emplace_back(std::string(name));
  return functions_.back();
}

PtxVersion InstructionsMinPtxVersion(const Module& module) {
  PtxVersion need{6, 0};  // shfl.sync and bar.sync with member semantics: PTX ISA 6.0
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

// ---------------------------------------------------------------------------------------------
// Emission

namespace {

std::string ImmediateText(const Value& v) {
  switch (v.type()) {
    case PtxType::kF32:
      return absl::StrFormat("0f%08X", static_cast<uint32_t>(v.bits()));
    case PtxType::kF64:
      return absl::StrFormat("0d%016X", v.bits());
    case PtxType::kB16:
    case PtxType::kB32:
    case PtxType::kB64:
      return absl::StrFormat("0x%x", v.bits());
    case PtxType::kS16:
    case PtxType::kS32:
      return absl::StrCat(static_cast<int32_t>(static_cast<uint32_t>(v.bits())));
    case PtxType::kS64:
      return absl::StrCat(static_cast<int64_t>(v.bits()));
    default:
      return absl::StrCat(v.bits());
  }
}

std::string OperandText(const Function& f, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kRegister:
      return f.RegisterName(v.reg());
    case Value::Kind::kImmediate:
      return ImmediateText(v);
    case Value::Kind::kSpecial:
      return std::string(SpecialRegName(v.special()));
    case Value::Kind::kSharedSymbol:
      return v.shared_index() < f.shared().size() ? f.shared()[v.shared_index()].name
                                                  : "undeclared_shared";
    case Value::Kind::kNone:
      break;
  }
  return "%invalid";
}

absl::string_view RoundingText(Rounding r) {
  switch (r) {
    case Rounding::kNone:
      return "";
    case Rounding::kRn:
      return ".rn";
    case Rounding::kRz:
      return ".rz";
    case Rounding::kRm:
      return ".rm";
    case Rounding::kRp:
      return ".rp";
    case Rounding::kApprox:
      return ".approx";
    case Rounding::kFull:
      return ".full";
  }
  return "";
}

absl::string_view MulModeText(MulMode m) {
  switch (m) {
    case MulMode::kNone:
      return "";
    case MulMode::kLo:
      return ".lo";
    case MulMode::kHi:
      return ".hi";
    case MulMode::kWide:
      return ".wide";
  }
  return "";
}

absl::string_view CmpText(CmpOp c) {
  switch (c) {
    case CmpOp::kEq:
      return "eq";
    case CmpOp::kNe:
      return "ne";
    case CmpOp::kLt:
      return "lt";
    case CmpOp::kLe:
      return "le";
    case CmpOp::kGt:
      return "gt";
    case CmpOp::kGe:
      return "ge";
  }
  return "";
}

absl::string_view ShflText(ShflMode m) {
  switch (m) {
    case ShflMode::kUp:
      return "up";
    case ShflMode::kDown:
      return "down";
    case ShflMode::kBfly:
      return "bfly";
    case ShflMode::kIdx:
      return "idx";
  }
  return "";
}

absl::string_view SpaceText(StateSpace s) {
  switch (s) {
    case StateSpace::kGlobal:
      return "global";
    case StateSpace::kShared:
      return "shared";
    case StateSpace::kParam:
      return "param";
  }
  return "";
}

std::string AddressText(const Function& f, const Value& base, int64_t offset) {
  std::string s = absl::StrCat("[", OperandText(f, base));
  // PTX writes a negative displacement as "+-N" ("[%rd1-4]" is a syntax error for ptxas).
  if (offset != 0) absl::StrAppend(&s, "+", offset);
  s += "]";
  return s;
}

std::string VectorText(const Function& f, const std::vector<Value>& values, size_t first) {
  std::vector<std::string> parts;
  for (size_t i = first; i < values.size(); ++i) parts.push_back(OperandText(f, values[i]));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::string JoinOperands(const Function& f, const std::vector<Value>& dst,
                         const std::vector<Value>& src) {
  std::vector<std::string> parts;
  for (const Value& v : dst) parts.push_back(OperandText(f, v));
  for (const Value& v : src) parts.push_back(OperandText(f, v));
  return absl::StrJoin(parts, ", ");
}

// The instruction without guard, indentation or ';'.
std::string InstructionBody(const Function& f, const Instruction& in) {
  const absl::string_view t = PtxTypeName(in.type);
  switch (in.op) {
    case Opcode::kLdParam: {
      const std::string name =
          in.param < f.params().size() ? f.params()[in.param].name : "undeclared_param";
      return absl::StrCat("ld.param.", t, " ", OperandText(f, in.dst.empty() ? Value() : in.dst[0]),
                          ", [", name, "]");
    }
    case Opcode::kLd: {
      const Value base = in.src.empty() ? Value() : in.src[0];
      if (in.dst.size() > 1) {
        return absl::StrCat("ld.", SpaceText(in.space), ".v", in.dst.size(), ".", t, " ",
                            VectorText(f, in.dst, 0), ", ", AddressText(f, base, in.offset));
      }
      return absl::StrCat("ld.", SpaceText(in.space), ".", t, " ",
                          OperandText(f, in.dst.empty() ? Value() : in.dst[0]), ", ",
                          AddressText(f, base, in.offset));
    }
    case Opcode::kSt: {
      const Value base = in.src.empty() ? Value() : in.src[0];
      if (in.src.size() > 2) {
        return absl::StrCat("st.", SpaceText(in.space), ".v", in.src.size() - 1, ".", t, " ",
                            AddressText(f, base, in.offset), ", ", VectorText(f, in.src, 1));
      }
      return absl::StrCat("st.", SpaceText(in.space), ".", t, " ", AddressText(f, base, in.offset),
                          ", ", OperandText(f, in.src.size() > 1 ? in.src[1] : Value()));
    }
    case Opcode::kAtomAdd:
      return absl::StrCat("atom.", SpaceText(in.space), ".add.", t, " ",
                          OperandText(f, in.dst.empty() ? Value() : in.dst[0]), ", ",
                          AddressText(f, in.src.empty() ? Value() : in.src[0], in.offset), ", ",
                          OperandText(f, in.src.size() > 1 ? in.src[1] : Value()));
    case Opcode::kCvt:
      return absl::StrCat("cvt", RoundingText(in.rounding), ".", t, ".", PtxTypeName(in.src_type),
                          " ", JoinOperands(f, in.dst, in.src));
    case Opcode::kSetp:
      return absl::StrCat("setp.", CmpText(in.cmp), ".", t, " ", JoinOperands(f, in.dst, in.src));
    case Opcode::kShfl: {
      std::string dst = in.dst.empty() ? "%invalid" : OperandText(f, in.dst[0]);
      if (in.dst.size() > 1) absl::StrAppend(&dst, "|", OperandText(f, in.dst[1]));
      std::vector<std::string> parts{dst};
      for (const Value& v : in.src) parts.push_back(OperandText(f, v));
      return absl::StrCat("shfl.sync.", ShflText(in.shfl), ".", t, " ", absl::StrJoin(parts, ", "));
    }
    case Opcode::kBarSync:
      return absl::StrCat("bar.sync ", OperandText(f, in.src.empty() ? Value() : in.src[0]));
    case Opcode::kBra: {
      const std::string target =
          in.label < f.num_labels() ? f.label_name(in.label) : "$L_undefined";
      return absl::StrCat(in.uniform ? "bra.uni " : "bra ", target);
    }
    case Opcode::kRet:
      return "ret";
    case Opcode::kExit:
      return "exit";
    case Opcode::kLabel:
      return "";
    default:
      break;
  }
  // Arithmetic, logic, mov, selp: op[.mode][.rounding].type dst, src...
  return absl::StrCat(OpcodeName(in.op), MulModeText(in.mul_mode), RoundingText(in.rounding), ".",
                      t, " ", JoinOperands(f, in.dst, in.src));
}

}  // namespace

std::string InstructionText(const Function& f, const Instruction& in) {
  if (in.op == Opcode::kLabel) {
    return absl::StrCat(in.label < f.num_labels() ? f.label_name(in.label) : "$L_undefined", ":");
  }
  std::string s;
  if (in.guard.valid())
    absl::StrAppend(&s, in.guard_negated ? "@!" : "@", OperandText(f, in.guard), " ");
  absl::StrAppend(&s, InstructionBody(f, in));
  return s;
}

std::string EmitPtx(const Module& module) {
  std::string out;
  absl::StrAppend(&out, "//\n// Generated by ", kGeneratorVersion, "\n//\n\n");
  absl::StrAppend(&out, ".version ", module.version().ToString(), "\n");
  absl::StrAppend(&out, ".target sm_", module.target_sm(), "\n");
  absl::StrAppend(&out, ".address_size 64\n");
  for (const Function& f : module.functions()) {
    absl::StrAppend(&out, "\n.visible .entry ", f.name(), "(");
    for (size_t i = 0; i < f.params().size(); ++i) {
      absl::StrAppend(&out, i == 0 ? "\n" : ",\n", "\t.param .", PtxTypeName(f.params()[i].type),
                      " ", f.params()[i].name);
    }
    absl::StrAppend(&out, f.params().empty() ? ")\n{\n" : "\n)\n{\n");
    for (const Function::RegClassUse& c : f.RegisterClasses()) {
      absl::StrAppend(&out, "\t.reg .", c.decl_type, " ", c.prefix, "<", c.count, ">;\n");
    }
    for (const SharedDecl& sh : f.shared()) {
      absl::StrAppend(&out, "\t.shared .align ", sh.align, " .b8 ", sh.name, "[", sh.bytes, "];\n");
    }
    out += "\n";
    for (const Instruction& in : f.instructions()) {
      if (in.op == Opcode::kLabel) {
        absl::StrAppend(&out, in.label < f.num_labels() ? f.label_name(in.label) : "$L_undefined",
                        ":\n");
        continue;
      }
      out += "\t";
      if (in.guard.valid()) {
        absl::StrAppend(&out, in.guard_negated ? "@!" : "@", OperandText(f, in.guard), " ");
      }
      absl::StrAppend(&out, InstructionBody(f, in), ";\n");
    }
    out += "}\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Builder

Builder::PredicateScope::PredicateScope(Builder* b, Value pred, bool negated)
    : b_(b), saved_guard_(b->guard_), saved_negated_(b->guard_negated_) {
  b_->guard_ = pred;
  b_->guard_negated_ = negated;
}

Builder::PredicateScope::~PredicateScope() {
  b_->guard_ = saved_guard_;
  b_->guard_negated_ = saved_negated_;
}

void Builder::Append(Instruction inst) {
  if (!inst.guard.valid() && guard_.valid() && inst.op != Opcode::kLabel) {
    inst.guard = guard_;
    inst.guard_negated = guard_negated_;
  }
  auto& list = fn_->mutable_instructions();
  if (insert_at_ > list.size()) insert_at_ = list.size();
  list.insert(list.begin() + static_cast<std::ptrdiff_t>(insert_at_), std::move(inst));
  ++insert_at_;
}

void Builder::Bind(Label label) {
  Instruction in;
  in.op = Opcode::kLabel;
  in.label = label.id;
  Append(std::move(in));
}

Value Builder::LdParam(Param param) {
  Instruction in;
  in.op = Opcode::kLdParam;
  in.type = param.type;
  in.space = StateSpace::kParam;
  in.param = param.index;
  Value d = fn_->NewRegister(param.type);
  in.dst = {d};
  Append(std::move(in));
  return d;
}

Value Builder::Mov(Value src) {
  Value d = fn_->NewRegister(src.type());
  Assign(d, src);
  return d;
}

void Builder::Assign(Value dst, Value src) {
  Instruction in;
  in.op = Opcode::kMov;
  in.type = dst.type();
  in.dst = {dst};
  in.src = {src};
  Append(std::move(in));
}

Value Builder::Ld(StateSpace space, PtxType type, Address addr) {
  Instruction in;
  in.op = Opcode::kLd;
  in.type = type;
  in.space = space;
  in.src = {addr.base};
  in.offset = addr.offset;
  Value d = fn_->NewRegister(type);
  in.dst = {d};
  Append(std::move(in));
  return d;
}

Value Builder::LdOr(StateSpace space, Value pred, Address addr, Value fallback) {
  Value d = Mov(fallback);
  Instruction in;
  in.op = Opcode::kLd;
  in.type = fallback.type();
  in.space = space;
  in.src = {addr.base};
  in.offset = addr.offset;
  in.dst = {d};
  in.guard = pred;
  Append(std::move(in));
  return d;
}

std::vector<Value> Builder::LdV4(StateSpace space, PtxType type, Address addr) {
  Instruction in;
  in.op = Opcode::kLd;
  in.type = type;
  in.space = space;
  in.src = {addr.base};
  in.offset = addr.offset;
  for (int i = 0; i < 4; ++i) in.dst.push_back(fn_->NewRegister(type));
  std::vector<Value> out = in.dst;
  Append(std::move(in));
  return out;
}

void Builder::St(StateSpace space, Address addr, Value value) {
  Instruction in;
  in.op = Opcode::kSt;
  in.type = value.type();
  in.space = space;
  in.src = {addr.base, value};
  in.offset = addr.offset;
  Append(std::move(in));
}

void Builder::StAs(StateSpace space, PtxType type, Address addr, Value value) {
  Instruction in;
  in.op = Opcode::kSt;
  in.type = type;
  in.space = space;
  in.src = {addr.base, value};
  in.offset = addr.offset;
  Append(std::move(in));
}

void Builder::StV4(StateSpace space, Address addr, absl::Span<const Value> values) {
  Instruction in;
  in.op = Opcode::kSt;
  in.type = values.empty() ? PtxType::kF32 : values[0].type();
  in.space = space;
  in.src = {addr.base};
  in.src.insert(in.src.end(), values.begin(), values.end());
  in.offset = addr.offset;
  Append(std::move(in));
}

Value Builder::AtomAdd(StateSpace space, Address addr, Value value) {
  Instruction in;
  in.op = Opcode::kAtomAdd;
  in.type = value.type();
  in.space = space;
  in.src = {addr.base, value};
  in.offset = addr.offset;
  Value d = fn_->NewRegister(value.type());
  in.dst = {d};
  Append(std::move(in));
  return d;
}

Value Builder::Binary(Opcode op, Value a, Value b, Rounding r, MulMode mode, PtxType dst_type) {
  Instruction in;
  in.op = op;
  in.type = a.type();
  in.rounding = r;
  in.mul_mode = mode;
  Value d = fn_->NewRegister(dst_type);
  in.dst = {d};
  in.src = {a, b};
  Append(std::move(in));
  return d;
}

namespace {
// Float add/sub/mul without an explicit rounding get `.rn`: exact IEEE, never contracted.
Rounding DefaultFloatRounding(PtxType t, Rounding r) {
  return (IsFloat(t) && r == Rounding::kNone) ? Rounding::kRn : r;
}
}  // namespace

Value Builder::Add(Value a, Value b, Rounding r) {
  return Binary(Opcode::kAdd, a, b, DefaultFloatRounding(a.type(), r), MulMode::kNone, a.type());
}

void Builder::AddTo(Value acc, Value b, Rounding r) {
  Instruction in;
  in.op = Opcode::kAdd;
  in.type = acc.type();
  in.rounding = DefaultFloatRounding(acc.type(), r);
  in.dst = {acc};
  in.src = {acc, b};
  Append(std::move(in));
}

Value Builder::Sub(Value a, Value b, Rounding r) {
  return Binary(Opcode::kSub, a, b, DefaultFloatRounding(a.type(), r), MulMode::kNone, a.type());
}

Value Builder::Mul(Value a, Value b, Rounding r) {
  if (IsFloat(a.type())) {
    return Binary(Opcode::kMul, a, b, DefaultFloatRounding(a.type(), r), MulMode::kNone, a.type());
  }
  return Binary(Opcode::kMul, a, b, r, MulMode::kLo, a.type());
}

Value Builder::MulHi(Value a, Value b) {
  return Binary(Opcode::kMul, a, b, Rounding::kNone, MulMode::kHi, a.type());
}

Value Builder::MulWide(Value a, Value b) {
  return Binary(Opcode::kMul, a, b, Rounding::kNone, MulMode::kWide, WideTypeOf(a.type()));
}

Value Builder::Mad(Value a, Value b, Value c) {
  Instruction in;
  in.op = Opcode::kMad;
  in.type = a.type();
  in.mul_mode = IsFloat(a.type()) ? MulMode::kNone : MulMode::kLo;
  if (IsFloat(a.type())) in.rounding = Rounding::kRn;
  Value d = fn_->NewRegister(a.type());
  in.dst = {d};
  in.src = {a, b, c};
  Append(std::move(in));
  return d;
}

Value Builder::MadWide(Value a, Value b, Value c) {
  Instruction in;
  in.op = Opcode::kMad;
  in.type = a.type();
  in.mul_mode = MulMode::kWide;
  Value d = fn_->NewRegister(WideTypeOf(a.type()));
  in.dst = {d};
  in.src = {a, b, c};
  Append(std::move(in));
  return d;
}

Value Builder::Fma(Value a, Value b, Value c, Rounding r) {
  Value d = fn_->NewRegister(a.type());
  Instruction in;
  in.op = Opcode::kFma;
  in.type = a.type();
  in.rounding = r;
  in.dst = {d};
  in.src = {a, b, c};
  Append(std::move(in));
  return d;
}

void Builder::FmaTo(Value acc, Value a, Value b, Rounding r) {
  Instruction in;
  in.op = Opcode::kFma;
  in.type = acc.type();
  in.rounding = r;
  in.dst = {acc};
  in.src = {a, b, acc};
  Append(std::move(in));
}

Value Builder::Div(Value a, Value b, Rounding r) {
  return Binary(Opcode::kDiv, a, b, r, MulMode::kNone, a.type());
}
Value Builder::Rem(Value a, Value b) {
  return Binary(Opcode::kRem, a, b, Rounding::kNone, MulMode::kNone, a.type());
}
Value Builder::Min(Value a, Value b) {
  return Binary(Opcode::kMin, a, b, Rounding::kNone, MulMode::kNone, a.type());
}
Value Builder::Max(Value a, Value b) {
  return Binary(Opcode::kMax, a, b, Rounding::kNone, MulMode::kNone, a.type());
}

namespace {
Instruction Unary(Opcode op, PtxType type, Value d, Value a, Rounding r) {
  Instruction in;
  in.op = op;
  in.type = type;
  in.rounding = r;
  in.dst = {d};
  in.src = {a};
  return in;
}
}  // namespace

Value Builder::Neg(Value a) {
  Value d = fn_->NewRegister(a.type());
  Append(Unary(Opcode::kNeg, a.type(), d, a, Rounding::kNone));
  return d;
}
Value Builder::Abs(Value a) {
  Value d = fn_->NewRegister(a.type());
  Append(Unary(Opcode::kAbs, a.type(), d, a, Rounding::kNone));
  return d;
}
Value Builder::Sqrt(Value a, Rounding r) {
  Value d = fn_->NewRegister(a.type());
  Append(Unary(Opcode::kSqrt, a.type(), d, a, r));
  return d;
}
Value Builder::Rsqrt(Value a) {
  Value d = fn_->NewRegister(a.type());
  Append(Unary(Opcode::kRsqrt, a.type(), d, a, Rounding::kApprox));
  return d;
}
Value Builder::Rcp(Value a, Rounding r) {
  Value d = fn_->NewRegister(a.type());
  Append(Unary(Opcode::kRcp, a.type(), d, a, r));
  return d;
}
Value Builder::Cvt(PtxType to, Value a, Rounding r) {
  Value d = fn_->NewRegister(to);
  Instruction in = Unary(Opcode::kCvt, to, d, a, r);
  in.src_type = a.type();
  Append(std::move(in));
  return d;
}

Value Builder::CvtFrom(PtxType to, PtxType from, Value a, Rounding r) {
  Value d = fn_->NewRegister(to);
  Instruction in = Unary(Opcode::kCvt, to, d, a, r);
  in.src_type = from;
  Append(std::move(in));
  return d;
}

Value Builder::Bitcast(PtxType to, Value a) {
  Value d = fn_->NewRegister(to);
  Append(Unary(Opcode::kMov, BitTypeOf(to), d, a, Rounding::kNone));
  return d;
}

Value Builder::BitwiseBinary(Opcode op, Value a, Value b) {
  Instruction in;
  in.op = op;
  in.type = BitTypeOf(a.type());
  Value d = fn_->NewRegister(a.type());
  in.dst = {d};
  in.src = {a, b};
  Append(std::move(in));
  return d;
}

Value Builder::And(Value a, Value b) { return BitwiseBinary(Opcode::kAnd, a, b); }
Value Builder::Or(Value a, Value b) { return BitwiseBinary(Opcode::kOr, a, b); }
Value Builder::Xor(Value a, Value b) { return BitwiseBinary(Opcode::kXor, a, b); }
Value Builder::Not(Value a) {
  Value d = fn_->NewRegister(a.type());
  Append(Unary(Opcode::kNot, BitTypeOf(a.type()), d, a, Rounding::kNone));
  return d;
}
Value Builder::Shl(Value a, Value amount) {
  Instruction in;
  in.op = Opcode::kShl;
  in.type = BitTypeOf(a.type());
  Value d = fn_->NewRegister(a.type());
  in.dst = {d};
  in.src = {a, amount};
  Append(std::move(in));
  return d;
}
Value Builder::Shr(Value a, Value amount) {
  // shr.u32 is logical, shr.s32 arithmetic: keep the operand's own type.
  Instruction in;
  in.op = Opcode::kShr;
  in.type = a.type();
  Value d = fn_->NewRegister(a.type());
  in.dst = {d};
  in.src = {a, amount};
  Append(std::move(in));
  return d;
}

Value Builder::Setp(CmpOp op, Value a, Value b) {
  Instruction in;
  in.op = Opcode::kSetp;
  in.type = a.type();
  in.cmp = op;
  Value d = fn_->NewRegister(PtxType::kPred);
  in.dst = {d};
  in.src = {a, b};
  Append(std::move(in));
  return d;
}

Value Builder::Selp(Value a, Value b, Value pred) {
  Instruction in;
  in.op = Opcode::kSelp;
  in.type = a.type();
  Value d = fn_->NewRegister(a.type());
  in.dst = {d};
  in.src = {a, b, pred};
  Append(std::move(in));
  return d;
}

void Builder::Bra(Label target, bool uniform) {
  Instruction in;
  in.op = Opcode::kBra;
  in.label = target.id;
  in.uniform = uniform;
  Append(std::move(in));
}

void Builder::BraIf(Value pred, Label target) {
  Instruction in;
  in.op = Opcode::kBra;
  in.label = target.id;
  in.guard = pred;
  Append(std::move(in));
}

void Builder::BraIfNot(Value pred, Label target) {
  Instruction in;
  in.op = Opcode::kBra;
  in.label = target.id;
  in.guard = pred;
  in.guard_negated = true;
  Append(std::move(in));
}

void Builder::Ret() {
  Instruction in;
  in.op = Opcode::kRet;
  Append(std::move(in));
}

void Builder::Exit() {
  Instruction in;
  in.op = Opcode::kExit;
  Append(std::move(in));
}

void Builder::BarSync(uint32_t barrier) {
  Instruction in;
  in.op = Opcode::kBarSync;
  in.src = {Value::U32(barrier)};
  Append(std::move(in));
}

Value Builder::Shfl(ShflMode mode, Value value, Value lane_or_delta, uint32_t member_mask) {
  Instruction in;
  in.op = Opcode::kShfl;
  in.type = PtxType::kB32;
  in.shfl = mode;
  Value d = fn_->NewRegister(value.type());
  in.dst = {d};
  // c = ((32 - width) << 8) | clamp; a full 32-lane segment clamps at 31 (up: at 0).
  const uint32_t clamp = mode == ShflMode::kUp ? 0 : 31;
  in.src = {value, lane_or_delta, Value::U32(clamp), Value::B32(member_mask)};
  Append(std::move(in));
  return d;
}

}  // namespace normgrad::kernels
