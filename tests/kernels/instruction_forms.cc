#include "tests/kernels/instruction_forms.h"

#include <vector>

#include "kernels/ptx/ptx_builder.h"

namespace normgrad::kernels {

Module EveryInstructionFormModule() {
  Module m(PtxVersion{7, 0}, kEveryFormTargetSm);
  Function& f = m.AddEntry(kEveryFormEntry);
  f.set_max_threads(256);  // launch bounds: .maxntid 256, 1, 1 and .minnctapersm 2
  f.set_min_blocks_per_sm(2);
  const Param p64 = f.AddParam(PtxType::kU64, "ptr");
  const Param p32 = f.AddParam(PtxType::kU32, "n");
  const Param pf = f.AddParam(PtxType::kF32, "scale");
  const SharedArray smem = f.AddShared("smem", kEveryFormSharedBytes);
  Builder b(&f);
  const Label done = b.CreateLabel("done");
  const Label uni = b.CreateLabel("uni");
  // Parameters, special registers, immediates, loads.
  const Value ptr = b.LdParam(p64);
  const Value n = b.LdParam(p32);
  const Value scale = b.LdParam(pf);
  const Value tid = b.Mov(SpecialReg::kTidX);
  for (SpecialReg r : {SpecialReg::kTidY, SpecialReg::kTidZ, SpecialReg::kNtidX, SpecialReg::kNtidY,
                       SpecialReg::kNtidZ, SpecialReg::kCtaidX, SpecialReg::kCtaidY,
                       SpecialReg::kCtaidZ, SpecialReg::kNctaidX, SpecialReg::kNctaidY,
                       SpecialReg::kNctaidZ, SpecialReg::kLaneId, SpecialReg::kWarpId}) {
    b.Mov(r);
  }
  const Value s = b.Mov(Value::S32(-3));
  const Value d = b.Mov(Value::U64(16));
  const Value x = b.Ld(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 4});
  const std::vector<Value> v4 = b.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 16});
  const Value xd = b.Cvt(PtxType::kF64, x);
  const Value ok = b.Setp(CmpOp::kLt, tid, n);
  const Value guarded = b.LdOr(StateSpace::kGlobal, ok, Address{ptr}, Value::F32(0.0f));
  b.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 48}, v4, ok);  // @p ld.v4 into v4
  b.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 64}, {v4[0], v4[1]});  // ld.v2
  // Integer arithmetic.
  const Value u1 = b.Add(tid, n);
  const Value u2 = b.Sub(u1, Value::U32(1));
  const Value u3 = b.Mul(u2, u1);
  const Value u4 = b.MulHi(u3, u2);
  const Value u5 = b.Mad(u4, u3, u2);
  const Value w1 = b.MulWide(u5, Value::U32(8));
  const Value w2 = b.MadWide(u5, u4, w1);
  const Value u6 = b.Div(u5, Value::U32(3));
  const Value u7 = b.Rem(u6, Value::U32(5));
  const Value u8 = b.Min(u7, u6);
  const Value u9 = b.Max(u8, u5);
  const Value s1 = b.Neg(s);
  const Value s2 = b.Abs(s1);
  const Value s3 = b.Shr(s2, Value::U32(1));
  const Value d1 = b.Add(d, w2);
  const Value d2 = b.Mul(d1, d);
  const Value d3 = b.Cvt(PtxType::kU64, u9);
  // Bitwise.
  const Value a1 = b.And(u9, Value::U32(255));
  const Value a2 = b.Or(a1, Value::B32(0x100));
  const Value a3 = b.Xor(a2, u8);
  const Value a4 = b.Not(a3);
  const Value a5 = b.Shl(a4, Value::U32(2));
  const Value a6 = b.Shr(a5, Value::U32(3));
  const Value d4 = b.Shl(d3, Value::U32(2));
  // Float arithmetic with every rounding form each instruction has.
  Value acc = b.Add(x, scale);
  for (Rounding r : {Rounding::kNone, Rounding::kRn, Rounding::kRz, Rounding::kRm, Rounding::kRp}) {
    acc = b.Add(acc, v4[0], r);
    acc = b.Sub(acc, v4[1], r);
    acc = b.Mul(acc, v4[2], r);
    if (r != Rounding::kNone) {
      acc = b.Fma(acc, v4[3], x, r);
      acc = b.Div(acc, scale, r);
      acc = b.Sqrt(acc, r);
      acc = b.Rcp(acc, r);
      acc = b.Add(acc, b.Cvt(PtxType::kF32, a6, r));
      acc = b.Add(acc, b.Cvt(PtxType::kF32, xd, r));
    }
  }
  acc = b.Div(acc, scale, Rounding::kApprox);
  acc = b.Div(acc, scale, Rounding::kFull);
  acc = b.Sqrt(acc, Rounding::kApprox);
  acc = b.Rsqrt(acc);
  acc = b.Rcp(acc, Rounding::kApprox);
  acc = b.Min(acc, guarded);
  acc = b.Max(acc, x);
  acc = b.Neg(acc);
  acc = b.Abs(acc);
  acc = b.Add(acc, b.Cvt(PtxType::kF32, s3, Rounding::kRn));
  acc = b.Add(acc, b.Cvt(PtxType::kF32, b.Fma(xd, xd, xd), Rounding::kRn));
  b.Assign(acc, b.Mov(acc));  // register to register
  b.AddTo(acc, x);
  b.FmaTo(acc, x, scale);
  acc = b.Add(acc, b.Bitcast(PtxType::kF32, a6));
  // 16-bit element types: loads, conversions, bit casts, stores.
  const Value raw = b.Ld(StateSpace::kGlobal, PtxType::kB16, Address{ptr, 2});
  acc = b.Add(acc, b.CvtFrom(PtxType::kF32, PtxType::kF16, raw));
  const Value half = b.Cvt(PtxType::kF16, acc, Rounding::kRn);
  const Value bf16 = b.Cvt(PtxType::kBF16, acc, Rounding::kRn);
  b.StAs(StateSpace::kGlobal, PtxType::kB16, Address{ptr, 2}, half);
  b.StAs(StateSpace::kGlobal, PtxType::kB16, Address{ptr, 6}, bf16);
  const Value u16 = b.LdOr(StateSpace::kGlobal, ok, Address{ptr, 8}, Value::Imm(PtxType::kU16, 0));
  const Value wide16 = b.Cvt(PtxType::kU32, b.Bitcast(PtxType::kU16, half));
  const Value joined = b.Or(b.Cvt(PtxType::kU32, u16), b.Shl(wide16, Value::U32(16)));
  // Comparison, selection, shuffles.
  for (CmpOp op : {CmpOp::kEq, CmpOp::kNe, CmpOp::kLt, CmpOp::kLe, CmpOp::kGt, CmpOp::kGe}) {
    b.Setp(op, acc, x);
    b.Setp(op, s3, s);
  }
  const Value pick = b.Selp(acc, x, b.Setp(CmpOp::kEq, a6, Value::U32(0)));
  const Value sh1 = b.Shfl(ShflMode::kDown, pick, Value::U32(16), 0xffffffffu);
  const Value sh2 = b.Shfl(ShflMode::kUp, sh1, Value::U32(1), 0xffffffffu);
  const Value sh3 = b.Shfl(ShflMode::kBfly, sh2, Value::U32(2), 0xffffffffu);
  const Value sh4 = b.Shfl(ShflMode::kIdx, sh3, Value::U32(0), 0xffffffffu);
  // Atomics and stores, global and shared, scalar and .v4; a barrier.
  b.AtomAdd(StateSpace::kGlobal, Address{ptr, 8}, sh4);
  b.AtomAdd(StateSpace::kGlobal, Address{ptr, 12}, u9);
  const Value base = b.AddressOf(smem);
  b.St(StateSpace::kShared, Address{base, 4}, sh4);
  b.AtomAdd(StateSpace::kShared, Address{base, 8}, joined);
  b.BarSync(0);
  const Value back = b.Ld(StateSpace::kShared, PtxType::kF32, Address{base, 4});
  b.AtomAdd(StateSpace::kShared, Address{base, 12}, back);
  b.StV4(StateSpace::kShared, Address{base, 16}, v4);
  b.St(StateSpace::kGlobal, Address{b.Add(ptr, d4), -4}, back);
  b.StV4(StateSpace::kGlobal, Address{ptr, 32}, v4);
  b.St(StateSpace::kGlobal, Address{ptr}, b.Cvt(PtxType::kU32, d2));
  // Cache operators on global loads and stores, and a GPU-scope fence.
  for (CacheOp op : {CacheOp::kCa, CacheOp::kCg, CacheOp::kCs, CacheOp::kLu, CacheOp::kCv}) {
    auto hint = b.WithCache(op);
    b.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 80}, v4);
  }
  for (CacheOp op : {CacheOp::kWb, CacheOp::kCg, CacheOp::kCs, CacheOp::kWt}) {
    auto hint = b.WithCache(op);
    b.StV4(StateSpace::kGlobal, Address{ptr, 96}, v4);
  }
  b.Fence();
  // Control flow.
  b.BraIf(ok, done);
  b.Bra(uni, /*uniform=*/true);
  b.Bind(uni);
  {
    auto guard = b.IfNot(ok);
    b.Exit();
  }
  b.BraIfNot(ok, done);
  b.Bind(done);
  b.Ret();
  return m;
}

}  // namespace normgrad::kernels
