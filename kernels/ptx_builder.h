// A typed PTX builder, modelled on LLVM's IRBuilder: a Module holds entry Functions; a Builder
// appends Instructions at an insertion point; values are typed handles whose type comes from the
// operands (`b.Add(l, r)` emits add.<type of l>); labels and parameters are handles created once;
// predication is an RAII scope. The builder does not check what it is given: a finished module
// goes through Verify() (kernels/verifier.h), and EmitPtx() turns it into conventional PTX text.
//
//   Module m(PtxVersion{7, 0}, 80);
//   Function& f = m.AddEntry("scale");
//   Param out = f.AddParam(PtxType::kU64, "out");
//   Builder b(&f);
//   Value tid = b.Mov(SpecialReg::kTidX);                       // mov.u32 %r1, %tid.x;
//   Value base = b.LdParam(out);                                // ld.param.u64 %rd1, [out];
//   Value addr = b.Add(base, b.MulWide(tid, Value::U32(4)));
//   Label done = b.CreateLabel("done");
//   b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(32)), done);    // @%p1 bra $L_done_0;
//   b.St(StateSpace::kGlobal, Address{addr}, Value::F32(1.0f));
//   b.Bind(done);
//   b.Ret();
//   std::string text = EmitPtx(m);                              // deterministic bytes
//
// Instructions are appended in call order. C++ leaves the order in which a call's arguments are
// evaluated unspecified, so pass at most one instruction-emitting argument per call (as above);
// otherwise the emitted order could differ between compilers.
#ifndef NORMGRAD_KERNELS_PTX_BUILDER_H_
#define NORMGRAD_KERNELS_PTX_BUILDER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/kernel.h"

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

// One PTX instruction. Operand layout per opcode:
//   kLdParam: dst[0]; param.                     kLd: dst[0..vec); src[0] = address base.
//   kSt: src[0] = address base, src[1..] values. kAtomAdd: dst[0]; src = {base, value}.
//   kCvt: dst type = type, source type = src_type (rounding as PTX requires).
//   kMul/kMad with kWide: type is the source type; dst is twice as wide.
//   kSetp: dst[0] pred; src = {a, b}; type = compared type.  kSelp: src = {a, b, pred}.
//   kShfl: dst[0] (+ optional dst[1] pred); src = {value, lane/delta, clamp, member mask}; type
//   b32. kBarSync: src[0] = barrier id.  kBra: label.  kLabel: label.
struct Instruction {
  Opcode op = Opcode::kMov;
  PtxType type = PtxType::kB32;
  PtxType src_type = PtxType::kB32;
  Rounding rounding = Rounding::kNone;
  MulMode mul_mode = MulMode::kNone;
  CmpOp cmp = CmpOp::kEq;
  ShflMode shfl = ShflMode::kDown;
  StateSpace space = StateSpace::kGlobal;
  bool uniform = false;  // bra.uni
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

// One instruction as emitted, without indentation or ';' ("@%p1 bra $L_exit_0"); for messages.
std::string InstructionText(const Function& function, const Instruction& inst);

// The module as PTX text. Deterministic: equal modules give equal bytes. Expects a module that
// passed Verify(); for a broken one the text is still produced but may not assemble.
std::string EmitPtx(const Module& module);

// Appends instructions to a Function at an insertion point (the end unless moved). Value-producing
// methods create a fresh register of the type the operands imply and return it.
class Builder {
 public:
  explicit Builder(Function* function)
      : fn_(function), insert_at_(function->instructions().size()) {}

  Function& function() { return *fn_; }

  // Insertion point: index into the instruction list; later instructions move down.
  void SetInsertPoint(size_t index) { insert_at_ = index; }
  size_t insert_point() const { return insert_at_; }

  // Labels.
  Label CreateLabel(absl::string_view hint) { return fn_->NewLabel(hint); }
  void Bind(Label label);

  // Predication: every instruction emitted while the scope lives carries `@pred` (or `@!pred`).
  class PredicateScope {
   public:
    PredicateScope(Builder* b, Value pred, bool negated);
    ~PredicateScope();
    PredicateScope(const PredicateScope&) = delete;
    PredicateScope& operator=(const PredicateScope&) = delete;

   private:
    Builder* b_;
    Value saved_guard_;
    bool saved_negated_;
  };
  [[nodiscard]] PredicateScope If(Value pred) { return PredicateScope(this, pred, false); }
  [[nodiscard]] PredicateScope IfNot(Value pred) { return PredicateScope(this, pred, true); }

  // Data movement.
  Value LdParam(Param param);
  Value Mov(Value src);  // register copy, immediate or special register
  Value Mov(SpecialReg reg) { return Mov(Value::Special(reg)); }
  // mov.u64 %rd, name: the shared-window address of a shared array (for ld/st/atom.shared).
  Value AddressOf(SharedArray array) { return Mov(Value::SharedSymbol(array.index)); }
  void Assign(Value dst, Value src);  // mov into an existing register (loop-carried)
  Value Ld(StateSpace space, PtxType type, Address addr);
  // mov dst, fallback; @pred ld dst, [addr]: a load that yields `fallback` where pred is false.
  Value LdOr(StateSpace space, Value pred, Address addr, Value fallback);
  std::vector<Value> LdV4(StateSpace space, PtxType type, Address addr);  // ld.v4
  void St(StateSpace space, Address addr, Value value);
  // st.<type> with an explicit instruction type (st.global.b16 of an f16/bf16 register).
  void StAs(StateSpace space, PtxType type, Address addr, Value value);
  void StV4(StateSpace space, Address addr, absl::Span<const Value> values);
  Value AtomAdd(StateSpace space, Address addr, Value value);

  // Arithmetic; type from the first operand. Float add/sub/mul default to `.rn` (no contraction).
  Value Add(Value a, Value b, Rounding r = Rounding::kNone);
  void AddTo(Value acc, Value b, Rounding r = Rounding::kNone);  // acc = acc + b in place
  Value Sub(Value a, Value b, Rounding r = Rounding::kNone);
  Value Mul(Value a, Value b, Rounding r = Rounding::kNone);  // int: mul.lo
  Value MulHi(Value a, Value b);
  Value MulWide(Value a, Value b);           // u32*u32 -> u64
  Value Mad(Value a, Value b, Value c);      // int: mad.lo
  Value MadWide(Value a, Value b, Value c);  // u32*u32 + u64 -> u64
  Value Fma(Value a, Value b, Value c, Rounding r = Rounding::kRn);
  void FmaTo(Value acc, Value a, Value b, Rounding r = Rounding::kRn);  // acc = a*b + acc
  Value Div(Value a, Value b, Rounding r = Rounding::kNone);  // float: required (.rn/.approx/.full)
  Value Rem(Value a, Value b);
  Value Min(Value a, Value b);
  Value Max(Value a, Value b);
  Value Neg(Value a);
  Value Abs(Value a);
  Value Sqrt(Value a, Rounding r);  // .rn exact, .approx fast
  Value Rsqrt(Value a);             // rsqrt.approx only (PTX has no exact rsqrt)
  Value Rcp(Value a, Rounding r);   // .rn exact, .approx fast
  Value Cvt(PtxType to, Value a, Rounding r = Rounding::kNone);
  // cvt.<to>.<from> where the register's own type differs (cvt.f32.f16 of a .b16 register).
  Value CvtFrom(PtxType to, PtxType from, Value a, Rounding r = Rounding::kNone);
  // mov.b<N> into a register of type `to`: reinterprets the bits (u32 -> f32).
  Value Bitcast(PtxType to, Value a);

  // Bitwise; the instruction type is the bit type of the operand's size (and.b32 for a u32).
  Value And(Value a, Value b);
  Value Or(Value a, Value b);
  Value Xor(Value a, Value b);
  Value Not(Value a);
  Value Shl(Value a, Value amount);
  Value Shr(Value a, Value amount);  // logical for unsigned, arithmetic for signed

  // Comparison and selection.
  Value Setp(CmpOp op, Value a, Value b);  // returns a pred register
  Value Selp(Value a, Value b, Value pred);

  // Control flow.
  void Bra(Label target, bool uniform = false);
  void BraIf(Value pred, Label target);     // @p bra
  void BraIfNot(Value pred, Label target);  // @!p bra
  void Ret();
  void Exit();
  void BarSync(uint32_t barrier = 0);

  // shfl.sync.<mode>.b32 with the clamp value for a full 32-lane segment.
  Value Shfl(ShflMode mode, Value value, Value lane_or_delta, uint32_t member_mask);

  // Appends a hand-made instruction (guard from the current scope applies if it has none).
  void Append(Instruction inst);

 private:
  Value Binary(Opcode op, Value a, Value b, Rounding r, MulMode mode, PtxType dst_type);
  Value BitwiseBinary(Opcode op, Value a, Value b);

  Function* fn_;
  size_t insert_at_;
  Value guard_;
  bool guard_negated_ = false;
};

// The bit type of a value's size: u32 -> b32, f64 -> b64, pred -> pred.
PtxType BitTypeOf(PtxType type);

}  // namespace normgrad::kernels

#endif  // NORMGRAD_KERNELS_PTX_BUILDER_H_
