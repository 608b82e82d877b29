// The builder's contract: types come from operands, labels and registers get unique regular
// names, predication scopes nest and restore, rounding is explicit, output is deterministic.
#include "kernels/ptx_builder.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kernels/ptx_printer.h"
#include "kernels/verifier.h"

namespace normgrad::kernels {
namespace {

// The text of the last emitted instruction of `f`.
std::string Last(const Function& f) { return InstructionText(f, f.instructions().back()); }

TEST(PtxBuilderTest, ArithmeticTakesItsTypeFromTheOperands) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  Value u = b.Mov(Value::U32(3));
  Value x = b.Mov(Value::F32(1.5f));
  Value d = b.Mov(Value::U64(8));

  Value su = b.Add(u, Value::U32(1));
  EXPECT_EQ(su.type(), PtxType::kU32);
  EXPECT_EQ(Last(f), "add.u32 %r2, %r1, 1");
  Value sx = b.Add(x, x);
  EXPECT_EQ(sx.type(), PtxType::kF32);
  EXPECT_EQ(Last(f), "add.rn.f32 %f2, %f1, %f1");  // float add states .rn: never contracted
  b.Add(d, d);
  EXPECT_EQ(Last(f), "add.u64 %rd2, %rd1, %rd1");
  b.Mul(u, u);
  EXPECT_EQ(Last(f), "mul.lo.u32 %r3, %r1, %r1");
  Value w = b.MulWide(u, Value::U32(4));
  EXPECT_EQ(w.type(), PtxType::kU64);
  EXPECT_EQ(Last(f), "mul.wide.u32 %rd3, %r1, 4");
  b.Mad(u, u, u);
  EXPECT_EQ(Last(f), "mad.lo.u32 %r4, %r1, %r1, %r1");
  b.Fma(x, x, x);
  EXPECT_EQ(Last(f), "fma.rn.f32 %f3, %f1, %f1, %f1");
  b.Sub(x, x);
  EXPECT_EQ(Last(f), "sub.rn.f32 %f4, %f1, %f1");
}

TEST(PtxBuilderTest, RoundingModesAreEmittedAsRequested) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  Value x = b.Mov(Value::F32(2.0f));
  b.Sqrt(x, Rounding::kRn);
  EXPECT_EQ(Last(f), "sqrt.rn.f32 %f2, %f1");
  b.Sqrt(x, Rounding::kApprox);
  EXPECT_EQ(Last(f), "sqrt.approx.f32 %f3, %f1");
  b.Rsqrt(x);
  EXPECT_EQ(Last(f), "rsqrt.approx.f32 %f4, %f1");
  b.Rcp(x, Rounding::kRn);
  EXPECT_EQ(Last(f), "rcp.rn.f32 %f5, %f1");
  b.Rcp(x, Rounding::kApprox);
  EXPECT_EQ(Last(f), "rcp.approx.f32 %f6, %f1");
  b.Div(x, x, Rounding::kRn);
  EXPECT_EQ(Last(f), "div.rn.f32 %f7, %f1, %f1");
  b.Div(x, x, Rounding::kFull);
  EXPECT_EQ(Last(f), "div.full.f32 %f8, %f1, %f1");
  Value u = b.Mov(Value::U32(7));
  b.Cvt(PtxType::kF32, u, Rounding::kRn);
  EXPECT_EQ(Last(f), "cvt.rn.f32.u32 %f9, %r1");
  b.Cvt(PtxType::kU64, u);
  EXPECT_EQ(Last(f), "cvt.u64.u32 %rd1, %r1");
}

TEST(PtxBuilderTest, ImmediatesAreExactAndTyped) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  b.Mov(Value::F32(1.0f));
  EXPECT_EQ(Last(f), "mov.f32 %f1, 0f3F800000");
  b.Mov(Value::F32(-0.0f));
  EXPECT_EQ(Last(f), "mov.f32 %f2, 0f80000000");
  b.Mov(Value::F64(1.0));
  EXPECT_EQ(Last(f), "mov.f64 %fd1, 0d3FF0000000000000");
  b.Mov(Value::S32(-5));
  EXPECT_EQ(Last(f), "mov.s32 %r1, -5");
  b.Mov(Value::B32(0xffffffffu));
  EXPECT_EQ(Last(f), "mov.b32 %r2, 0xffffffff");
  b.Mov(Value::U64(1ull << 40));
  EXPECT_EQ(Last(f), "mov.u64 %rd1, 1099511627776");
}

TEST(PtxBuilderTest, BitwiseUsesTheBitTypeAndShiftsKeepSignedness) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  Value u = b.Mov(Value::U32(40));
  Value a = b.And(u, Value::U32(31));
  EXPECT_EQ(a.type(), PtxType::kU32);  // the value keeps its own type
  EXPECT_EQ(Last(f), "and.b32 %r2, %r1, 31");
  b.Shr(u, Value::U32(5));
  EXPECT_EQ(Last(f), "shr.u32 %r3, %r1, 5");
  Value s = b.Mov(Value::S32(-64));
  b.Shr(s, Value::U32(5));
  EXPECT_EQ(Last(f), "shr.s32 %r5, %r4, 5");
  Value d = b.Mov(Value::U64(3));
  b.Shl(d, Value::U32(2));
  EXPECT_EQ(Last(f), "shl.b64 %rd2, %rd1, 2");
}

TEST(PtxBuilderTest, HalfPrecisionConversionsAndBitcasts) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Param p = f.AddParam(PtxType::kU64, "x");
  Builder b(&f);
  Value base = b.LdParam(p);
  Value raw = b.Ld(StateSpace::kGlobal, PtxType::kB16, Address{base});
  EXPECT_EQ(Last(f), "ld.global.b16 %rs1, [%rd1]");
  Value x = b.CvtFrom(PtxType::kF32, PtxType::kF16, raw);
  EXPECT_EQ(Last(f), "cvt.f32.f16 %f1, %rs1");
  Value h = b.Cvt(PtxType::kBF16, x, Rounding::kRn);
  EXPECT_EQ(Last(f), "cvt.rn.bf16.f32 %rs2, %f1");
  b.StAs(StateSpace::kGlobal, PtxType::kB16, Address{base, 2}, h);
  EXPECT_EQ(Last(f), "st.global.b16 [%rd1+2], %rs2");
  Value bits = b.Mov(Value::U32(0x3f800000u));
  Value one = b.Bitcast(PtxType::kF32, bits);
  EXPECT_EQ(one.type(), PtxType::kF32);
  EXPECT_EQ(Last(f), "mov.b32 %f2, %r1");
  b.Mov(Value::Imm(PtxType::kB16, 0));
  EXPECT_EQ(Last(f), "mov.b16 %rs3, 0x0");
  b.Ret();
  EXPECT_TRUE(Verify(m).ok()) << Verify(m);
}

TEST(PtxBuilderTest, SpecialRegistersAreReadWithMov) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  Value t = b.Mov(SpecialReg::kTidX);
  EXPECT_EQ(t.type(), PtxType::kU32);
  EXPECT_EQ(Last(f), "mov.u32 %r1, %tid.x");
  b.Mov(SpecialReg::kCtaidX);
  EXPECT_EQ(Last(f), "mov.u32 %r2, %ctaid.x");
  b.Mov(SpecialReg::kNtidX);
  EXPECT_EQ(Last(f), "mov.u32 %r3, %ntid.x");
  b.Mov(SpecialReg::kLaneId);
  EXPECT_EQ(Last(f), "mov.u32 %r4, %laneid");
}

TEST(PtxBuilderTest, LabelsAreUniqueEvenWithTheSameHint) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  Label a = b.CreateLabel("loop");
  Label c = b.CreateLabel("loop");
  Label odd = b.CreateLabel("has space-and.dot");
  EXPECT_NE(f.label_name(a.id), f.label_name(c.id));
  EXPECT_EQ(f.label_name(a.id), "$L_loop_0");
  EXPECT_EQ(f.label_name(c.id), "$L_loop_1");
  EXPECT_EQ(f.label_name(odd.id), "$L_has_space_and_dot_2");  // always a valid identifier
}

TEST(PtxBuilderTest, ParametersAreDeclaredOnceAndLoadedByHandle) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Param p = f.AddParam(PtxType::kU64, "out_ptr");
  Param n = f.AddParam(PtxType::kU32, "n");
  Builder b(&f);
  Value v = b.LdParam(p);
  EXPECT_EQ(v.type(), PtxType::kU64);
  EXPECT_EQ(Last(f), "ld.param.u64 %rd1, [out_ptr]");
  b.LdParam(n);
  EXPECT_EQ(Last(f), "ld.param.u32 %r1, [n]");
  b.LdParam(p);  // a second load of the same handle reads the same declared parameter
  EXPECT_EQ(Last(f), "ld.param.u64 %rd2, [out_ptr]");
  ASSERT_EQ(f.params().size(), 2u);
}

TEST(PtxBuilderTest, PredicateScopesGuardAndRestore) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  Value u = b.Mov(Value::U32(1));
  Value p = b.Setp(CmpOp::kLt, u, Value::U32(2));
  EXPECT_EQ(Last(f), "setp.lt.u32 %p1, %r1, 2");
  Value q = b.Setp(CmpOp::kGe, u, Value::U32(0));
  {
    auto outer = b.If(p);
    b.Add(u, u);
    EXPECT_EQ(Last(f), "@%p1 add.u32 %r2, %r1, %r1");
    {
      auto inner = b.IfNot(q);
      b.Add(u, u);
      EXPECT_EQ(Last(f), "@!%p2 add.u32 %r3, %r1, %r1");
    }
    b.Add(u, u);
    EXPECT_EQ(Last(f), "@%p1 add.u32 %r4, %r1, %r1");
  }
  b.Add(u, u);
  EXPECT_EQ(Last(f), "add.u32 %r5, %r1, %r1");
}

TEST(PtxBuilderTest, PredicatedLoadKeepsTheFallback) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Param p = f.AddParam(PtxType::kU64, "x");
  Builder b(&f);
  Value base = b.LdParam(p);
  Value ok = b.Setp(CmpOp::kNe, base, Value::U64(0));
  Value x = b.LdOr(StateSpace::kGlobal, ok, Address{base, 8}, Value::F32(0.0f));
  const auto& code = f.instructions();
  ASSERT_GE(code.size(), 2u);
  EXPECT_EQ(InstructionText(f, code[code.size() - 2]), "mov.f32 %f1, 0f00000000");
  EXPECT_EQ(Last(f), "@%p1 ld.global.f32 %f1, [%rd1+8]");
  EXPECT_EQ(x.reg(), code.back().dst[0].reg());
}

TEST(PtxBuilderTest, VectorLoadsAndStoresUseBraces) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Param p = f.AddParam(PtxType::kU64, "x");
  Builder b(&f);
  Value base = b.LdParam(p);
  std::vector<Value> v = b.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{base, 16});
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(Last(f), "ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd1+16]");
  b.StV4(StateSpace::kGlobal, Address{base, -16}, v);
  EXPECT_EQ(Last(f), "st.global.v4.f32 [%rd1+-16], {%f1, %f2, %f3, %f4}");
}

TEST(PtxBuilderTest, ShuffleAtomicBarrierAndBranchForms) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Param p = f.AddParam(PtxType::kU64, "x");
  Builder b(&f);
  Value base = b.LdParam(p);
  Value x = b.Ld(StateSpace::kGlobal, PtxType::kF32, Address{base});
  b.Shfl(ShflMode::kDown, x, Value::U32(16), 0xffffffffu);
  EXPECT_EQ(Last(f), "shfl.sync.down.b32 %f2, %f1, 16, 31, 0xffffffff");
  b.Shfl(ShflMode::kBfly, x, Value::U32(1), 0x0000ffffu);
  EXPECT_EQ(Last(f), "shfl.sync.bfly.b32 %f3, %f1, 1, 31, 0xffff");
  b.Shfl(ShflMode::kIdx, x, Value::U32(0), 0xffffffffu);
  EXPECT_EQ(Last(f), "shfl.sync.idx.b32 %f4, %f1, 0, 31, 0xffffffff");
  b.Shfl(ShflMode::kUp, x, Value::U32(1), 0xffffffffu);
  EXPECT_EQ(Last(f), "shfl.sync.up.b32 %f5, %f1, 1, 0, 0xffffffff");
  b.AtomAdd(StateSpace::kGlobal, Address{base, 4}, x);
  EXPECT_EQ(Last(f), "atom.global.add.f32 %f6, [%rd1+4], %f1");
  b.BarSync();
  EXPECT_EQ(Last(f), "bar.sync 0");
  Label l = b.CreateLabel("end");
  b.Bra(l, /*uniform=*/true);
  EXPECT_EQ(Last(f), "bra.uni $L_end_0");
  b.Bind(l);
  EXPECT_EQ(Last(f), "$L_end_0:");
  b.Ret();
  EXPECT_EQ(Last(f), "ret");
  EXPECT_TRUE(Verify(m).ok()) << Verify(m);
}

TEST(PtxBuilderTest, SharedArraysAreDeclaredInTheEntryAndAddressedByMov) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  SharedArray partials = f.AddShared("partials", 128, 16);
  Builder b(&f);
  Value base = b.AddressOf(partials);
  EXPECT_EQ(base.type(), PtxType::kU64);
  EXPECT_EQ(Last(f), "mov.u64 %rd1, partials");
  Value x = b.Ld(StateSpace::kShared, PtxType::kF32, Address{base, 4});
  EXPECT_EQ(Last(f), "ld.shared.f32 %f1, [%rd1+4]");
  b.St(StateSpace::kShared, Address{base, 8}, x);
  EXPECT_EQ(Last(f), "st.shared.f32 [%rd1+8], %f1");
  b.Ret();
  ASSERT_TRUE(Verify(m).ok()) << Verify(m);
  EXPECT_TRUE(absl::StrContains(EmitPtx(m),
                                "\t.reg .f32 %f<2>;\n\t.shared .align 16 .b8 partials[128];\n\n"))
      << EmitPtx(m);
}

TEST(PtxBuilderTest, InsertionPointInsertsBeforeLaterInstructions) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  b.Mov(Value::U32(1));
  b.Ret();
  b.SetInsertPoint(1);
  b.Mov(Value::U32(2));
  ASSERT_EQ(f.instructions().size(), 3u);
  EXPECT_EQ(InstructionText(f, f.instructions()[1]), "mov.u32 %r2, 2");
  EXPECT_EQ(InstructionText(f, f.instructions()[2]), "ret");
}

TEST(PtxBuilderTest, ModuleTextHasTheConventionalLayout) {
  Module m(PtxVersion{8, 0}, 90);
  Function& f = m.AddEntry("scale");
  Param out = f.AddParam(PtxType::kU64, "out");
  Param n = f.AddParam(PtxType::kU32, "n");
  Builder b(&f);
  Value tid = b.Mov(SpecialReg::kTidX);
  Label done = b.CreateLabel("done");
  b.BraIf(b.Setp(CmpOp::kGe, tid, b.LdParam(n)), done);
  Value base = b.LdParam(out);
  Value addr = b.Add(base, b.MulWide(tid, Value::U32(4)));
  b.St(StateSpace::kGlobal, Address{addr}, Value::F32(1.0f));
  b.Bind(done);
  b.Ret();
  ASSERT_TRUE(Verify(m).ok()) << Verify(m);

  const std::string text = EmitPtx(m);
  EXPECT_EQ(text,
            "//\n// Generated by normgrad-ptx/1\n//\n\n"
            ".version 8.0\n.target sm_90\n.address_size 64\n\n"
            ".visible .entry scale(\n\t.param .u64 out,\n\t.param .u32 n\n)\n{\n"
            "\t.reg .pred %p<2>;\n\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<4>;\n\n"
            "\tmov.u32 %r1, %tid.x;\n"
            "\tld.param.u32 %r2, [n];\n"
            "\tsetp.ge.u32 %p1, %r1, %r2;\n"
            "\t@%p1 bra $L_done_0;\n"
            "\tld.param.u64 %rd1, [out];\n"
            "\tmul.wide.u32 %rd2, %r1, 4;\n"
            "\tadd.u64 %rd3, %rd1, %rd2;\n"
            "\tst.global.f32 [%rd3], 0f3F800000;\n"
            "$L_done_0:\n"
            "\tret;\n"
            "}\n");
  EXPECT_EQ(text, EmitPtx(m));  // same module, same bytes
}

TEST(PtxBuilderTest, RegisterDeclarationsCoverEveryUsedIndex) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder b(&f);
  for (int i = 0; i < 10; ++i) b.Mov(Value::U32(static_cast<uint32_t>(i)));
  b.Ret();
  const std::string text = EmitPtx(m);
  EXPECT_TRUE(absl::StrContains(text, ".reg .b32 %r<11>;")) << text;  // %r1..%r10
  EXPECT_TRUE(absl::StrContains(text, "mov.u32 %r10, 9;"));
  EXPECT_FALSE(absl::StrContains(text, ".reg .f32"));  // unused classes are not declared
}

TEST(PtxBuilderTest, MinimumVersionForInstructionsIsShflSyncs) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("k");
  Builder(&f).Ret();
  EXPECT_EQ(InstructionsMinPtxVersion(m), (PtxVersion{6, 0}));
}

}  // namespace
}  // namespace normgrad::kernels
