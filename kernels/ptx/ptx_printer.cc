#include "kernels/ptx/ptx_printer.h"

#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"

namespace normgrad::kernels {
namespace {

using ptx_internal::EnumTableEntry;

// Modifier texts, each indexed by its enum.
constexpr absl::string_view kRoundingText[] = {"", ".rn", ".rz", ".rm", ".rp", ".approx", ".full"};
static_assert(std::size(kRoundingText) == static_cast<size_t>(Rounding::kFull) + 1);
constexpr absl::string_view kMulModeText[] = {"", ".lo", ".hi", ".wide"};
static_assert(std::size(kMulModeText) == static_cast<size_t>(MulMode::kWide) + 1);
constexpr absl::string_view kCmpText[] = {"eq", "ne", "lt", "le", "gt", "ge"};
static_assert(std::size(kCmpText) == static_cast<size_t>(CmpOp::kGe) + 1);
constexpr absl::string_view kShflText[] = {"up", "down", "bfly", "idx"};
static_assert(std::size(kShflText) == static_cast<size_t>(ShflMode::kIdx) + 1);
constexpr absl::string_view kSpaceText[] = {"global", "shared", "param"};
static_assert(std::size(kSpaceText) == static_cast<size_t>(StateSpace::kParam) + 1);

template <typename Enum, size_t N>
absl::string_view Text(const absl::string_view (&table)[N], Enum value) {
  return EnumTableEntry(table, value, absl::string_view());
}

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

// Operand `i` of `values`; "%invalid" where a broken instruction lacks it.
std::string OperandAt(const Function& f, const std::vector<Value>& values, size_t i) {
  return OperandText(f, i < values.size() ? values[i] : Value());
}

std::string OperandList(const Function& f, absl::Span<const Value> values) {
  return absl::StrJoin(values, ", ", [&f](std::string* out, const Value& v) {
    absl::StrAppend(out, OperandText(f, v));
  });
}

// Destinations, then sources: the operands of most instructions.
std::string DstThenSrc(const Function& f, const Instruction& in) {
  std::vector<Value> all = in.dst;
  all.insert(all.end(), in.src.begin(), in.src.end());
  return OperandList(f, all);
}

// The data operands of a memory instruction from `values[first]` on: one operand with an empty
// width, or the `.vN` width and `{a, b, ...}`.
struct DataOperands {
  std::string width;
  std::string text;
};
DataOperands Data(const Function& f, const std::vector<Value>& values, size_t first) {
  const size_t n = values.size() > first ? values.size() - first : 0;
  if (n > 1) {
    return {absl::StrCat(".v", n),
            absl::StrCat("{", OperandList(f, absl::MakeConstSpan(values).subspan(first)), "}")};
  }
  return {"", OperandAt(f, values, first)};
}

// `[base+offset]` of a ld/st/atom. PTX writes a negative displacement as "+-N" ("[%rd1-4]" is a
// syntax error for ptxas).
std::string AddressText(const Function& f, const Instruction& in) {
  std::string s = absl::StrCat("[", OperandAt(f, in.src, 0));
  if (in.offset != 0) absl::StrAppend(&s, "+", in.offset);
  s += "]";
  return s;
}

std::string LabelName(const Function& f, uint32_t label) {
  return label < f.num_labels() ? f.label_name(label) : "$L_undefined";
}

// The instruction without guard, indentation or ';'.
std::string InstructionBody(const Function& f, const Instruction& in) {
  const absl::string_view t = PtxTypeName(in.type);
  const absl::string_view space = Text(kSpaceText, in.space);
  switch (in.op) {
    case Opcode::kLdParam:
      return absl::StrCat(
          "ld.param.", t, " ", OperandAt(f, in.dst, 0), ", [",
          in.param < f.params().size() ? f.params()[in.param].name : "undeclared_param", "]");
    case Opcode::kLd: {
      const DataOperands dst = Data(f, in.dst, 0);
      return absl::StrCat("ld.", space, in.cache == CacheOp::kNone ? "" : ".",
                          CacheOpName(in.cache), dst.width, ".", t, " ", dst.text, ", ",
                          AddressText(f, in));
    }
    case Opcode::kSt: {
      const DataOperands values = Data(f, in.src, 1);
      return absl::StrCat("st.", space, in.cache == CacheOp::kNone ? "" : ".",
                          CacheOpName(in.cache), values.width, ".", t, " ", AddressText(f, in),
                          ", ", values.text);
    }
    case Opcode::kAtomAdd:
      return absl::StrCat("atom.", space, ".add.", t, " ", OperandAt(f, in.dst, 0), ", ",
                          AddressText(f, in), ", ", OperandAt(f, in.src, 1));
    case Opcode::kCvt:
      return absl::StrCat("cvt", Text(kRoundingText, in.rounding), ".", t, ".",
                          PtxTypeName(in.src_type), " ", DstThenSrc(f, in));
    case Opcode::kSetp:
      return absl::StrCat("setp.", Text(kCmpText, in.cmp), ".", t, " ", DstThenSrc(f, in));
    case Opcode::kShfl: {
      // The optional predicate destination is written `%r1|%p1`.
      std::vector<std::string> parts{OperandAt(f, in.dst, 0)};
      if (in.dst.size() > 1) absl::StrAppend(&parts[0], "|", OperandText(f, in.dst[1]));
      for (const Value& v : in.src) parts.push_back(OperandText(f, v));
      return absl::StrCat("shfl.sync.", Text(kShflText, in.shfl), ".", t, " ",
                          absl::StrJoin(parts, ", "));
    }
    case Opcode::kBarSync:
      return absl::StrCat("bar.sync ", OperandAt(f, in.src, 0));
    case Opcode::kFence:
      return "fence.acq_rel.gpu";
    case Opcode::kBra:
      return absl::StrCat(in.uniform ? "bra.uni " : "bra ", LabelName(f, in.label));
    case Opcode::kRet:
    case Opcode::kExit:
      return std::string(OpcodeName(in.op));
    case Opcode::kLabel:
      return "";
    default:
      break;
  }
  // Arithmetic, logic, mov, selp: op[.mode][.rounding].type dst, src...
  return absl::StrCat(OpcodeName(in.op), Text(kMulModeText, in.mul_mode),
                      Text(kRoundingText, in.rounding), ".", t, " ", DstThenSrc(f, in));
}

}  // namespace

std::string InstructionText(const Function& f, const Instruction& in) {
  if (in.op == Opcode::kLabel) return absl::StrCat(LabelName(f, in.label), ":");
  std::string s;
  if (in.guard.valid()) {
    absl::StrAppend(&s, in.guard_negated ? "@!" : "@", OperandText(f, in.guard), " ");
  }
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
    absl::StrAppend(&out, f.params().empty() ? ")\n" : "\n)\n");
    if (f.max_threads() != 0) absl::StrAppend(&out, ".maxntid ", f.max_threads(), ", 1, 1\n");
    if (f.min_blocks_per_sm() != 0) {
      absl::StrAppend(&out, ".minnctapersm ", f.min_blocks_per_sm(), "\n");
    }
    out += "{\n";
    for (const Function::RegClassUse& c : f.RegisterClasses()) {
      absl::StrAppend(&out, "\t.reg .", c.decl_type, " ", c.prefix, "<", c.count, ">;\n");
    }
    for (const SharedDecl& sh : f.shared()) {
      absl::StrAppend(&out, "\t.shared .align ", sh.align, " .b8 ", sh.name, "[", sh.bytes, "];\n");
    }
    out += "\n";
    for (const Instruction& in : f.instructions()) {
      // Labels start in column 0; instructions are indented and end in ';'.
      if (in.op == Opcode::kLabel) {
        absl::StrAppend(&out, InstructionText(f, in), "\n");
      } else {
        absl::StrAppend(&out, "\t", InstructionText(f, in), ";\n");
      }
    }
    out += "}\n";
  }
  return out;
}

}  // namespace normgrad::kernels
