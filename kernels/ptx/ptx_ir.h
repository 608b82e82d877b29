// The PTX IR: typed values (virtual registers, immediates, special registers, shared-array
// addresses), Instructions with their operand layout, and Functions (`.visible .entry`) inside a
// Module (`.version`, `.target`). Plain data that checks nothing: a Builder (kernels/ptx/ptx_builder.h)
// writes it, Verify() (kernels/ptx/verifier.h), the CFG and the divergence analysis read it, and
// EmitPtx() (kernels/ptx/ptx_printer.h) turns it into text.
//
//   Module m(PtxVersion{7, 0}, 80);
//   Function& f = m.AddEntry("scale");
//   Param out = f.AddParam(PtxType::kU64, "out");        // .param .u64 out
//   SharedArray sums = f.AddShared("sums", 128);         // .shared .align 16 .b8 sums[128];
//   Value x = f.NewRegister(PtxType::kF32);              // %f1 (a Builder does this for you)
//   for (const Instruction& in : f.instructions()) {
//     if (in.op == Opcode::kSt) ...                      // in.type, in.dst, in.src, in.guard
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "kernels/ptx/targets.h"

namespace normgrad::kernels {

// PTX fundamental types a register or an instruction can have.
enum class PtxType : uint8_t {
  kPred,
  kB16,
  kB32,
  kB64,
  kU16,
  kU32,
  kU64,
  kS16,
  kS32,
  kS64,
  kF16,
  kBF16,
  kF32,
  kF64,
};
absl::string_view PtxTypeName(PtxType type);  // "u32", "pred", ...
int PtxTypeBits(PtxType type);                // 1 for pred
bool IsFloat(PtxType type);                   // f16, bf16, f32, f64
bool IsSigned(PtxType type);                  // s16, s32, s64
bool IsUnsigned(PtxType type);                // u16, u32, u64
bool IsBits(PtxType type);                    // b16, b32, b64
PtxType BitTypeOf(PtxType type);              // u32 -> b32, f64 -> b64, pred -> pred

enum class SpecialReg : uint8_t {
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
};
absl::string_view SpecialRegName(SpecialReg reg);  // "%tid.x"

// A typed operand: a virtual register, an immediate, a special register (u32), or the address of
// a `.shared` array (u64; see Function::AddShared). Immediates are made by the static factories;
// registers only by a Builder.
class Value {
 public:
  enum class Kind : uint8_t { kNone, kRegister, kImmediate, kSpecial, kSharedSymbol };

  Value() = default;
  static Value U32(uint32_t v) { return Value(Kind::kImmediate, PtxType::kU32, v); }
  static Value S32(int32_t v);
  static Value U64(uint64_t v) { return Value(Kind::kImmediate, PtxType::kU64, v); }
  static Value B32(uint32_t v) { return Value(Kind::kImmediate, PtxType::kB32, v); }
  static Value F32(float v);
  static Value F64(double v);
  // Any type from its bit pattern (e.g. Value::Imm(PtxType::kB16, 0)).
  static Value Imm(PtxType type, uint64_t bits) { return Value(Kind::kImmediate, type, bits); }
  static Value Special(SpecialReg reg) {
    return Value(Kind::kSpecial, PtxType::kU32, static_cast<uint64_t>(reg));
  }
  // The address of shared array `index` of the function (use Builder::AddressOf).
  static Value SharedSymbol(uint32_t index) {
    return Value(Kind::kSharedSymbol, PtxType::kU64, index);
  }
  // A register handle by index; for tests that hand-build (possibly broken) instructions.
  static Value Register(uint32_t index, PtxType type) {
    return Value(Kind::kRegister, type, index);
  }

  Kind kind() const { return kind_; }
  PtxType type() const { return type_; }
  bool valid() const { return kind_ != Kind::kNone; }
  bool is_register() const { return kind_ == Kind::kRegister; }
  bool is_immediate() const { return kind_ == Kind::kImmediate; }
  bool is_special() const { return kind_ == Kind::kSpecial; }
  bool is_shared_symbol() const { return kind_ == Kind::kSharedSymbol; }
  uint32_t shared_index() const { return static_cast<uint32_t>(payload_); }
  uint32_t reg() const { return static_cast<uint32_t>(payload_); }  // register index
  uint64_t bits() const { return payload_; }                        // immediate bit pattern
  SpecialReg special() const { return static_cast<SpecialReg>(payload_); }

  friend bool operator==(const Value& a, const Value& b) {
    return a.kind_ == b.kind_ && a.type_ == b.type_ && a.payload_ == b.payload_;
  }
  friend bool operator!=(const Value& a, const Value& b) { return !(a == b); }

 private:
  Value(Kind kind, PtxType type, uint64_t payload) : kind_(kind), type_(type), payload_(payload) {}
  Kind kind_ = Kind::kNone;
  PtxType type_ = PtxType::kB32;
  uint64_t payload_ = 0;
};

// A branch target made by Builder::CreateLabel; emitted as `$L_<hint>_<n>` (unique per function).
struct Label {
  uint32_t id = UINT32_MAX;
};

// A kernel parameter handle made by Function::AddParam.
struct Param {
  uint32_t index = UINT32_MAX;
  PtxType type = PtxType::kU64;
};

// A `.shared .align A .b8 name[bytes]` array of an entry, made by Function::AddShared.
struct SharedArray {
  uint32_t index = UINT32_MAX;
};

// `[base+offset]` with a 64-bit register base.
struct Address {
  Value base;
  int64_t offset = 0;
};

enum class Opcode : uint8_t {
  kLdParam,
  kLd,
  kSt,
  kAtomAdd,
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
  kCvt,
  kSqrt,
  kRsqrt,
  kRcp,
  kAnd,
  kOr,
  kXor,
  kNot,
  kShl,
  kShr,
  kSetp,
  kSelp,
  kBra,
  kShfl,
  kBarSync,
  kRet,
  kExit,
  kFence,  // fence.acq_rel.gpu: orders this thread's memory accesses before/after at GPU scope
  kLabel,  // a pseudo-instruction that binds `label` here
};
absl::string_view OpcodeName(Opcode op);  // "add", "ld", ...

enum class StateSpace : uint8_t { kGlobal, kShared, kParam };
// Rounding / precision modifier. Floating add/sub/mul/fma/div/sqrt/rcp state theirs explicitly so
// ptxas never contracts or approximates behind the builder's back.
enum class Rounding : uint8_t { kNone, kRn, kRz, kRm, kRp, kApprox, kFull };
enum class MulMode : uint8_t { kNone, kLo, kHi, kWide };
enum class CmpOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe };
enum class ShflMode : uint8_t { kUp, kDown, kBfly, kIdx };
// Cache operator of a global ld/st (PTX ISA "Cache Operators"): kNone leaves the default (.ca
// for loads, .wb for stores). Loads take .ca .cg .cs .lu .cv, stores .wb .cg .cs .wt.
//   kCs: streaming, likely read or written once (evict first): x, dy and dx of a backward.
//   kCg: cache in L2 only, not L1: data other blocks wrote during this launch.
enum class CacheOp : uint8_t { kNone, kCa, kCg, kCs, kLu, kCv, kWb, kWt };
absl::string_view CacheOpName(CacheOp op);  // "cs", ...; "" for kNone

// One PTX instruction. Operand layout per opcode:
//   kLdParam: dst[0]; param.                     kLd: dst[0..vec); src[0] = address base.
//   kSt: src[0] = address base, src[1..] values. kAtomAdd: dst[0]; src = {base, value}.
//   kCvt: dst type = type, source type = src_type (rounding as PTX requires).
//   kMul/kMad with kWide: type is the source type; dst is twice as wide.
//   kSetp: dst[0] pred; src = {a, b}; type = compared type.  kSelp: src = {a, b, pred}.
//   kShfl: dst[0] (+ optional dst[1] pred); src = {value, lane/delta, clamp, member mask}; type
//   b32. kBarSync: src[0] = barrier id.  kBra: label.  kLabel: label.  kFence: no operands.
struct Instruction {
  Opcode op = Opcode::kMov;
  PtxType type = PtxType::kB32;
  PtxType src_type = PtxType::kB32;
  Rounding rounding = Rounding::kNone;
  MulMode mul_mode = MulMode::kNone;
  CmpOp cmp = CmpOp::kEq;
  ShflMode shfl = ShflMode::kDown;
  StateSpace space = StateSpace::kGlobal;
  CacheOp cache = CacheOp::kNone;  // kLd / kSt only
  bool uniform = false;            // bra.uni
  std::vector<Value> dst;
  std::vector<Value> src;
  int64_t offset = 0;           // address offset of kLd/kSt/kAtomAdd
  Value guard;                  // predicate register, or invalid for none
  bool guard_negated = false;   // @!%p
  uint32_t label = UINT32_MAX;  // kBra / kLabel
  uint32_t param = UINT32_MAX;  // kLdParam
};

struct ParamDecl {
  std::string name;
  PtxType type;
};

struct SharedDecl {
  std::string name;
  uint32_t bytes;
  uint32_t align;  // a power of two
};

struct LabelDecl {
  std::string name;  // unique emitted name
};

// One `.visible .entry`. Owns its parameters, virtual registers, labels and instruction list.
class Function {
 public:
  explicit Function(std::string name) : name_(std::move(name)) {}

  const std::string& name() const { return name_; }
  Param AddParam(PtxType type, absl::string_view name);
  const std::vector<ParamDecl>& params() const { return params_; }

  // Static shared memory: emitted as `.shared .align <align> .b8 <name>[<bytes>];` in the entry.
  SharedArray AddShared(absl::string_view name, uint32_t bytes, uint32_t align = 16);
  const std::vector<SharedDecl>& shared() const { return shared_; }

  // The most threads a block launching this entry has: emitted as `.maxntid <n>, 1, 1` between
  // the parameter list and the body (0: not declared). ptxas then keeps registers * n within the
  // SM's register file, and the driver refuses a larger block (CUDA_ERROR_INVALID_VALUE).
  void set_max_threads(uint32_t n) { max_threads_ = n; }
  uint32_t max_threads() const { return max_threads_; }
  // Blocks of max_threads() that must fit on one SM at once: emitted as `.minnctapersm <n>` (0:
  // not declared), so ptxas keeps registers <= 65536 / (n * max_threads) and the launch's grid
  // can be sized from n without asking the driver.
  void set_min_blocks_per_sm(uint32_t n) { min_blocks_per_sm_ = n; }
  uint32_t min_blocks_per_sm() const { return min_blocks_per_sm_; }

  Value NewRegister(PtxType type);
  uint32_t num_registers() const { return static_cast<uint32_t>(registers_.size()); }
  PtxType register_type(uint32_t index) const { return registers_[index].type; }
  // "%r3", "%f1", "%rd2", "%p1": per register class, numbered from 1 in creation order.
  std::string RegisterName(uint32_t index) const;

  Label NewLabel(absl::string_view hint);
  uint32_t num_labels() const { return static_cast<uint32_t>(labels_.size()); }
  const std::string& label_name(uint32_t id) const { return labels_[id].name; }

  const std::vector<Instruction>& instructions() const { return instructions_; }
  std::vector<Instruction>& mutable_instructions() { return instructions_; }

  // Number of registers per class as `.reg` declarations need them: {prefix, type, count}.
  struct RegClassUse {
    absl::string_view prefix;     // "%r"
    absl::string_view decl_type;  // "b32"
    uint32_t count;               // highest index + 1
  };
  std::vector<RegClassUse> RegisterClasses() const;

 private:
  struct RegisterInfo {
    PtxType type;
    uint32_t class_index;  // number within its class, from 1
  };
  std::string name_;
  std::vector<ParamDecl> params_;
  std::vector<SharedDecl> shared_;
  uint32_t max_threads_ = 0;
  uint32_t min_blocks_per_sm_ = 0;
  std::vector<RegisterInfo> registers_;
  std::vector<uint32_t> class_counts_ = std::vector<uint32_t>(6, 0);
  std::vector<LabelDecl> labels_;
  std::vector<Instruction> instructions_;
};

// A PTX module: `.version`, `.target sm_NN`, `.address_size 64`, entries.
class Module {
 public:
  Module(PtxVersion version, int target_sm) : version_(version), target_sm_(target_sm) {}
  Module(Module&&) = default;
  Module& operator=(Module&&) = default;

  Function& AddEntry(absl::string_view name);
  const std::vector<Function>& functions() const { return functions_; }
  std::vector<Function>& mutable_functions() { return functions_; }

  PtxVersion version() const { return version_; }
  void set_version(PtxVersion v) { version_ = v; }
  int target_sm() const { return target_sm_; }

 private:
  PtxVersion version_;
  int target_sm_;
  std::vector<Function> functions_;
};

// Lowest PTX ISA version that has every instruction in `module` (independent of the target).
PtxVersion InstructionsMinPtxVersion(const Module& module);

namespace ptx_internal {

// `table[value]` for a table with one entry per enumerator, in declaration order; `fallback` for a
// value no enumerator has (only a cast makes one). Backs the name tables of the IR and the printer.
template <typename T, size_t N, typename Enum>
constexpr T EnumTableEntry(const T (&table)[N], Enum value, T fallback) {
  const size_t index = static_cast<size_t>(value);
  return index < N ? table[index] : fallback;
}

}  // namespace ptx_internal

}  // namespace normgrad::kernels
