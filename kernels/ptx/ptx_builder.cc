#include "kernels/ptx/ptx_builder.h"

#include <cstddef>
#include <utility>
#include <vector>

namespace normgrad::kernels {
namespace {

// The destination type of mul.wide / mad.wide of `type`.
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

// Float add/sub/mul without an explicit rounding get `.rn`: exact IEEE, never contracted.
Rounding DefaultFloatRounding(PtxType t, Rounding r) {
  return (IsFloat(t) && r == Rounding::kNone) ? Rounding::kRn : r;
}

// `op[.mode][.rounding].type` reading `src`; the destination is added by Define or Write.
Instruction Op(Opcode op, PtxType type, std::vector<Value> src, Rounding r = Rounding::kNone,
               MulMode mode = MulMode::kNone) {
  Instruction in;
  in.op = op;
  in.type = type;
  in.rounding = r;
  in.mul_mode = mode;
  in.src = std::move(src);
  return in;
}

}  // namespace

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

Value Builder::Define(PtxType dst_type, Instruction in) {
  const Value d = fn_->NewRegister(dst_type);
  Write(d, std::move(in));
  return d;
}

void Builder::Write(Value dst, Instruction in) {
  in.dst = {dst};
  Append(std::move(in));
}

void Builder::Bind(Label label) {
  Instruction in;
  in.op = Opcode::kLabel;
  in.label = label.id;
  Append(std::move(in));
}

// ---------------------------------------------------------------------------------------------
// Data movement

Value Builder::LdParam(Param param) {
  Instruction in = Op(Opcode::kLdParam, param.type, {});
  in.space = StateSpace::kParam;
  in.param = param.index;
  return Define(param.type, std::move(in));
}

Value Builder::Mov(Value src) { return Define(src.type(), Op(Opcode::kMov, src.type(), {src})); }

void Builder::Assign(Value dst, Value src) { Write(dst, Op(Opcode::kMov, dst.type(), {src})); }

void Builder::MemoryOp(Opcode op, StateSpace space, PtxType type, Address addr,
                       absl::Span<const Value> dst, absl::Span<const Value> values, Value guard) {
  Instruction in = Op(op, type, {addr.base});
  in.src.insert(in.src.end(), values.begin(), values.end());
  in.dst.assign(dst.begin(), dst.end());
  in.space = space;
  in.offset = addr.offset;
  in.guard = guard;
  if (space == StateSpace::kGlobal && (op == Opcode::kLd || op == Opcode::kSt)) in.cache = cache_;
  Append(std::move(in));
}

Builder::CacheScope::CacheScope(Builder* b, CacheOp op) : b_(b), saved_(b->cache_) {
  b_->cache_ = op;
}
Builder::CacheScope::~CacheScope() { b_->cache_ = saved_; }

Value Builder::Ld(StateSpace space, PtxType type, Address addr) {
  const Value d = fn_->NewRegister(type);
  MemoryOp(Opcode::kLd, space, type, addr, {d}, {});
  return d;
}

Value Builder::LdOr(StateSpace space, Value pred, Address addr, Value fallback) {
  const Value d = Mov(fallback);
  MemoryOp(Opcode::kLd, space, fallback.type(), addr, {d}, {}, pred);
  return d;
}

std::vector<Value> Builder::LdV4(StateSpace space, PtxType type, Address addr) {
  std::vector<Value> d;
  for (int i = 0; i < 4; ++i) d.push_back(fn_->NewRegister(type));
  MemoryOp(Opcode::kLd, space, type, addr, d, {});
  return d;
}

void Builder::LdInto(StateSpace space, PtxType type, Address addr, absl::Span<const Value> dst,
                     Value guard) {
  MemoryOp(Opcode::kLd, space, type, addr, dst, {}, guard);
}

void Builder::St(StateSpace space, Address addr, Value value) {
  MemoryOp(Opcode::kSt, space, value.type(), addr, {}, {value});
}

void Builder::StAs(StateSpace space, PtxType type, Address addr, Value value) {
  MemoryOp(Opcode::kSt, space, type, addr, {}, {value});
}

void Builder::StV4(StateSpace space, Address addr, absl::Span<const Value> values) {
  const PtxType type = values.empty() ? PtxType::kF32 : values[0].type();
  MemoryOp(Opcode::kSt, space, type, addr, {}, values);
}

Value Builder::AtomAdd(StateSpace space, Address addr, Value value) {
  const Value d = fn_->NewRegister(value.type());
  MemoryOp(Opcode::kAtomAdd, space, value.type(), addr, {d}, {value});
  return d;
}

// ---------------------------------------------------------------------------------------------
// Arithmetic

Value Builder::Binary(Opcode op, Value a, Value b, Rounding r, MulMode mode, PtxType dst_type) {
  return Define(dst_type, Op(op, a.type(), {a, b}, r, mode));
}

Value Builder::Add(Value a, Value b, Rounding r) {
  return Binary(Opcode::kAdd, a, b, DefaultFloatRounding(a.type(), r), MulMode::kNone, a.type());
}

void Builder::AddTo(Value acc, Value b, Rounding r) {
  Write(acc, Op(Opcode::kAdd, acc.type(), {acc, b}, DefaultFloatRounding(acc.type(), r)));
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
  const bool is_float = IsFloat(a.type());
  return Define(a.type(),
                Op(Opcode::kMad, a.type(), {a, b, c}, is_float ? Rounding::kRn : Rounding::kNone,
                   is_float ? MulMode::kNone : MulMode::kLo));
}

Value Builder::MadWide(Value a, Value b, Value c) {
  return Define(WideTypeOf(a.type()),
                Op(Opcode::kMad, a.type(), {a, b, c}, Rounding::kNone, MulMode::kWide));
}

Value Builder::Fma(Value a, Value b, Value c, Rounding r) {
  return Define(a.type(), Op(Opcode::kFma, a.type(), {a, b, c}, r));
}

void Builder::FmaTo(Value acc, Value a, Value b, Rounding r) {
  Write(acc, Op(Opcode::kFma, acc.type(), {a, b, acc}, r));
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

Value Builder::Neg(Value a) { return Define(a.type(), Op(Opcode::kNeg, a.type(), {a})); }
Value Builder::Abs(Value a) { return Define(a.type(), Op(Opcode::kAbs, a.type(), {a})); }
Value Builder::Sqrt(Value a, Rounding r) {
  return Define(a.type(), Op(Opcode::kSqrt, a.type(), {a}, r));
}
Value Builder::Rsqrt(Value a) {
  return Define(a.type(), Op(Opcode::kRsqrt, a.type(), {a}, Rounding::kApprox));
}
Value Builder::Rcp(Value a, Rounding r) {
  return Define(a.type(), Op(Opcode::kRcp, a.type(), {a}, r));
}

Value Builder::Cvt(PtxType to, Value a, Rounding r) { return CvtFrom(to, a.type(), a, r); }

Value Builder::CvtFrom(PtxType to, PtxType from, Value a, Rounding r) {
  Instruction in = Op(Opcode::kCvt, to, {a}, r);
  in.src_type = from;
  return Define(to, std::move(in));
}

Value Builder::Bitcast(PtxType to, Value a) {
  return Define(to, Op(Opcode::kMov, BitTypeOf(to), {a}));
}

// ---------------------------------------------------------------------------------------------
// Bitwise, comparison, selection

Value Builder::BitwiseBinary(Opcode op, Value a, Value b) {
  return Define(a.type(), Op(op, BitTypeOf(a.type()), {a, b}));
}

Value Builder::And(Value a, Value b) { return BitwiseBinary(Opcode::kAnd, a, b); }
Value Builder::Or(Value a, Value b) { return BitwiseBinary(Opcode::kOr, a, b); }
Value Builder::Xor(Value a, Value b) { return BitwiseBinary(Opcode::kXor, a, b); }
Value Builder::Not(Value a) { return Define(a.type(), Op(Opcode::kNot, BitTypeOf(a.type()), {a})); }
Value Builder::Shl(Value a, Value amount) { return BitwiseBinary(Opcode::kShl, a, amount); }
Value Builder::Shr(Value a, Value amount) {
  // shr.u32 is logical, shr.s32 arithmetic: keep the operand's own type.
  return Binary(Opcode::kShr, a, amount, Rounding::kNone, MulMode::kNone, a.type());
}

Value Builder::Setp(CmpOp op, Value a, Value b) {
  Instruction in = Op(Opcode::kSetp, a.type(), {a, b});
  in.cmp = op;
  return Define(PtxType::kPred, std::move(in));
}

Value Builder::Selp(Value a, Value b, Value pred) {
  return Define(a.type(), Op(Opcode::kSelp, a.type(), {a, b, pred}));
}

// ---------------------------------------------------------------------------------------------
// Control flow, barriers, shuffles

void Builder::Branch(Label target, bool uniform, Value guard, bool negated) {
  Instruction in;
  in.op = Opcode::kBra;
  in.label = target.id;
  in.uniform = uniform;
  in.guard = guard;
  in.guard_negated = negated;
  Append(std::move(in));
}

void Builder::Bra(Label target, bool uniform) { Branch(target, uniform, Value(), false); }
void Builder::BraIf(Value pred, Label target) { Branch(target, false, pred, false); }
void Builder::BraIfNot(Value pred, Label target) { Branch(target, false, pred, true); }

void Builder::Ret() { Append(Op(Opcode::kRet, PtxType::kB32, {})); }
void Builder::Exit() { Append(Op(Opcode::kExit, PtxType::kB32, {})); }
void Builder::BarSync(uint32_t barrier) {
  Append(Op(Opcode::kBarSync, PtxType::kB32, {Value::U32(barrier)}));
}

void Builder::Fence() { Append(Op(Opcode::kFence, PtxType::kB32, {})); }

Value Builder::Shfl(ShflMode mode, Value value, Value lane_or_delta, uint32_t member_mask) {
  // c = ((32 - width) << 8) | clamp; a full 32-lane segment clamps at 31 (up: at 0).
  const uint32_t clamp = mode == ShflMode::kUp ? 0 : 31;
  Instruction in = Op(Opcode::kShfl, PtxType::kB32,
                      {value, lane_or_delta, Value::U32(clamp), Value::B32(member_mask)});
  in.shfl = mode;
  return Define(value.type(), std::move(in));
}

}  // namespace normgrad::kernels
