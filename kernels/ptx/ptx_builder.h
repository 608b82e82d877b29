// A typed PTX builder, modelled on LLVM's IRBuilder: it appends Instructions to a Function of the
// IR (kernels/ptx/ptx_ir.h) at an insertion point; values are typed handles whose type comes from the
// operands (`b.Add(l, r)` emits add.<type of l>); labels and parameters are handles created once;
// predication is an RAII scope. The builder does not check what it is given: a finished module
// goes through Verify() (kernels/ptx/verifier.h), and EmitPtx() (kernels/ptx/ptx_printer.h) turns it into
// conventional PTX text.
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
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

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

  // Cache operator: every global ld/st emitted while the scope lives carries `op` (loads: .ca .cg
  // .cs .lu .cv; stores: .wb .cg .cs .wt; Verify checks the pairing). Shared and param accesses
  // and atomics are unaffected.
  class CacheScope {
   public:
    CacheScope(Builder* b, CacheOp op);
    ~CacheScope();
    CacheScope(const CacheScope&) = delete;
    CacheScope& operator=(const CacheScope&) = delete;

   private:
    Builder* b_;
    CacheOp saved_;
  };
  [[nodiscard]] CacheScope WithCache(CacheOp op) { return CacheScope(this, op); }

  // Data movement.
  Value LdParam(Param param);
  // ld.param of each parameter, in order: const auto [n, x] = b.LdParams({rows, x_ptr});
  template <size_t N>
  std::array<Value, N> LdParams(const Param (&params)[N]) {
    std::array<Value, N> values;
    for (size_t i = 0; i < N; ++i) values[i] = LdParam(params[i]);
    return values;
  }
  Value Mov(Value src);  // register copy, immediate or special register
  Value Mov(SpecialReg reg) { return Mov(Value::Special(reg)); }
  // mov.u64 %rd, name: the shared-window address of a shared array (for ld/st/atom.shared).
  Value AddressOf(SharedArray array) { return Mov(Value::SharedSymbol(array.index)); }
  void Assign(Value dst, Value src);  // mov into an existing register (loop-carried)
  Value Ld(StateSpace space, PtxType type, Address addr);
  // mov dst, fallback; @pred ld dst, [addr]: a load that yields `fallback` where pred is false.
  Value LdOr(StateSpace space, Value pred, Address addr, Value fallback);
  std::vector<Value> LdV4(StateSpace space, PtxType type, Address addr);  // ld.v4
  // ld.<type> (ld.vN for N registers) into existing registers, under `@guard` if one is given
  // (else the current predicate scope's): the registers keep their old values where it is false.
  void LdInto(StateSpace space, PtxType type, Address addr, absl::Span<const Value> dst,
              Value guard = Value());
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
  // fence.acq_rel.gpu: this thread's memory accesses before it are seen by the whole GPU before
  // its accesses after it (with an atomic, the release/acquire of a last-block-done count).
  void Fence();

  // shfl.sync.<mode>.b32 with the clamp value for a full 32-lane segment.
  Value Shfl(ShflMode mode, Value value, Value lane_or_delta, uint32_t member_mask);

  // Appends a hand-made instruction (guard from the current scope applies if it has none).
  void Append(Instruction inst);

 private:
  // The one place ld/st/atom instructions are made: `dst` registers, src = {addr.base, values...}.
  void MemoryOp(Opcode op, StateSpace space, PtxType type, Address addr,
                absl::Span<const Value> dst, absl::Span<const Value> values, Value guard = Value());
  // Appends `in` writing a fresh register of `dst_type` (returned), or the existing `dst`.
  Value Define(PtxType dst_type, Instruction in);
  void Write(Value dst, Instruction in);
  Value Binary(Opcode op, Value a, Value b, Rounding r, MulMode mode, PtxType dst_type);
  Value BitwiseBinary(Opcode op, Value a, Value b);
  // bra[.uni] target, under `@guard` / `@!guard` if one is given (else the scope's).
  void Branch(Label target, bool uniform, Value guard, bool negated);

  Function* fn_;
  size_t insert_at_;
  Value guard_;
  bool guard_negated_ = false;
  CacheOp cache_ = CacheOp::kNone;
};

}  // namespace normgrad::kernels
