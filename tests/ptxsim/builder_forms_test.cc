// Every instruction form kernels/' builder can emit is accepted by the parser, and builder-made
// shared-memory code runs: the interpreter covers the builder's whole output surface, not only
// today's two kernels.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/ptx_builder.h"
#include "kernels/ptx_printer.h"
#include "kernels/verifier.h"
#include "tests/ptxsim/sim_harness.h"

namespace normgrad::ptxsim {
namespace {

namespace k = ::normgrad::kernels;
using k::Address;
using k::Builder;
using k::CmpOp;
using k::Label;
using k::PtxType;
using k::Rounding;
using k::SpecialReg;
using k::StateSpace;
using k::Value;

TEST(BuilderForms, EveryFormTheBuilderEmitsParses) {
  k::Module m(k::PtxVersion{7, 8}, 90);
  k::Function& f = m.AddEntry("all_forms");
  const k::Param p64 = f.AddParam(PtxType::kU64, "ptr");
  const k::Param p32 = f.AddParam(PtxType::kU32, "n");
  const k::Param pf = f.AddParam(PtxType::kF32, "scale");
  const k::SharedArray smem = f.AddShared("smem", 256);
  Builder b(&f);
  const Label done = b.CreateLabel("done");
  const Label uni = b.CreateLabel("uni");
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
  const Value a1 = b.And(u9, Value::U32(255));
  const Value a2 = b.Or(a1, Value::B32(0x100));
  const Value a3 = b.Xor(a2, u8);
  const Value a4 = b.Not(a3);
  const Value a5 = b.Shl(a4, Value::U32(2));
  const Value a6 = b.Shr(a5, Value::U32(3));
  const Value d4 = b.Shl(d3, Value::U32(2));
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
  for (CmpOp op : {CmpOp::kEq, CmpOp::kNe, CmpOp::kLt, CmpOp::kLe, CmpOp::kGt, CmpOp::kGe}) {
    b.Setp(op, acc, x);
    b.Setp(op, s3, s);
  }
  const Value pick = b.Selp(acc, x, b.Setp(CmpOp::kEq, a6, Value::U32(0)));
  const Value sh1 = b.Shfl(k::ShflMode::kDown, pick, Value::U32(16), 0xffffffffu);
  const Value sh2 = b.Shfl(k::ShflMode::kUp, sh1, Value::U32(1), 0xffffffffu);
  const Value sh3 = b.Shfl(k::ShflMode::kBfly, sh2, Value::U32(2), 0xffffffffu);
  const Value sh4 = b.Shfl(k::ShflMode::kIdx, sh3, Value::U32(0), 0xffffffffu);
  b.AtomAdd(StateSpace::kGlobal, Address{ptr, 8}, sh4);
  b.AtomAdd(StateSpace::kGlobal, Address{ptr, 12}, u9);
  const Value base = b.AddressOf(smem);
  b.St(StateSpace::kShared, Address{base, 4}, sh4);
  b.AtomAdd(StateSpace::kShared, Address{base, 8}, u9);
  b.BarSync(0);
  const Value back = b.Ld(StateSpace::kShared, PtxType::kF32, Address{base, 4});
  b.St(StateSpace::kGlobal, Address{b.Add(ptr, d4), -4}, back);
  b.StV4(StateSpace::kGlobal, Address{ptr, 32}, v4);
  b.St(StateSpace::kGlobal, Address{ptr}, b.Cvt(PtxType::kU32, d2));
  b.BraIf(ok, done);
  b.Bra(uni, /*uniform=*/true);
  b.Bind(uni);
  {
    auto guard = b.IfNot(ok);
    b.Exit();
  }
  b.Bind(done);
  b.Ret();
  ASSERT_TRUE(k::Verify(m).ok()) << k::Verify(m);
  const std::string text = k::EmitPtx(m);
  absl::StatusOr<Module> module = ParsePtx(text);
  ASSERT_TRUE(module.ok()) << module.status() << "\n" << text;
  const Entry* entry = module->FindEntry("all_forms");
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(entry->params.size(), 3u);
  EXPECT_EQ(entry->static_shared_bytes, 256u);
}

// A builder-made block reduction through shared memory: each thread stores tid + 1, a barrier,
// then thread 0 adds all of them with shared loads and writes the sum.
TEST(BuilderForms, BuilderSharedMemoryReductionRuns) {
  k::Module m(k::PtxVersion{7, 8}, 90);
  k::Function& f = m.AddEntry("block_sum");
  const k::Param out = f.AddParam(PtxType::kU64, "out");
  const k::SharedArray smem = f.AddShared("partials", 4 * 128, 4);
  Builder b(&f);
  const Value tid = b.Mov(SpecialReg::kTidX);
  const Value ntid = b.Mov(SpecialReg::kNtidX);
  const Value base = b.AddressOf(smem);
  const Value offset = b.MulWide(tid, Value::U32(4));
  const Value slot = b.Add(base, offset);
  b.St(StateSpace::kShared, Address{slot}, b.Add(tid, Value::U32(1)));
  b.BarSync(0);
  const Label done = b.CreateLabel("done");
  b.BraIf(b.Setp(CmpOp::kNe, tid, Value::U32(0)), done);
  const Value sum = b.Mov(Value::U32(0));
  const Value i = b.Mov(Value::U32(0));
  const Label loop = b.CreateLabel("loop");
  const Label end = b.CreateLabel("end");
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, ntid), end);
  const Value at = b.Add(base, b.MulWide(i, Value::U32(4)));
  b.AddTo(sum, b.Ld(StateSpace::kShared, PtxType::kU32, Address{at}));
  b.AddTo(i, Value::U32(1));
  b.Bra(loop);
  b.Bind(end);
  b.St(StateSpace::kGlobal, Address{b.LdParam(out)}, sum);
  b.Bind(done);
  b.Ret();
  ASSERT_TRUE(k::Verify(m).ok()) << k::Verify(m);
  SimHarness sim;
  uint32_t* result = sim.Alloc<uint32_t>(1);
  KernelArgs args;
  args.Add(SimHarness::Address(result));
  absl::Status s = sim.Run(k::EmitPtx(m), "block_sum", {1, 1, 1}, {128, 1, 1}, args);
  ASSERT_TRUE(s.ok()) << s << "\n" << k::EmitPtx(m);
  EXPECT_EQ(*result, 128u * 129u / 2u);
}

}  // namespace
}  // namespace normgrad::ptxsim
