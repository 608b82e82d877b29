// The builder's contract: types come from operands, labels and registers get unique regular
// names, predication scopes nest and restore, rounding is explicit, output is deterministic.
#include "kernels/ptx/ptx_builder.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kernels/ptx/ptx_printer.h"
#include "kernels/ptx/verifier.h"

namespace normgrad::kernels {
namespace {

// An entry `k` of a PTX 7.0 / sm_80 module with a builder at its end; tests emit into it.
class PtxBuilderTest : public ::testing::Test {
 protected:
  // The text of the last emitted instruction.
  std::string Last() const { return InstructionText(f_, f_.instructions().back()); }
  // ld.param.u64 of a new parameter `x`: the base address of the memory tests.
  Value PointerParam() { return b_.LdParam(f_.AddParam(PtxType::kU64, "x")); }

  Module m_{PtxVersion{7, 0}, 80};
  Function& f_ = m_.AddEntry("k");
  Builder b_{&f_};
};

TEST_F(PtxBuilderTest, ArithmeticTakesItsTypeFromTheOperands) {
  Value u = b_.Mov(Value::U32(3));
  Value x = b_.Mov(Value::F32(1.5f));
  Value d = b_.Mov(Value::U64(8));

  Value su = b_.Add(u, Value::U32(1));
  EXPECT_EQ(su.type(), PtxType::kU32);
  EXPECT_EQ(Last(), "add.u32 %r2, %r1, 1");
  Value sx = b_.Add(x, x);
  EXPECT_EQ(sx.type(), PtxType::kF32);
  EXPECT_EQ(Last(), "add.rn.f32 %f2, %f1, %f1");  // float add states .rn: never contracted
  b_.Add(d, d);
  EXPECT_EQ(Last(), "add.u64 %rd2, %rd1, %rd1");
  b_.Mul(u, u);
  EXPECT_EQ(Last(), "mul.lo.u32 %r3, %r1, %r1");
  Value w = b_.MulWide(u, Value::U32(4));
  EXPECT_EQ(w.type(), PtxType::kU64);
  EXPECT_EQ(Last(), "mul.wide.u32 %rd3, %r1, 4");
  b_.Mad(u, u, u);
  EXPECT_EQ(Last(), "mad.lo.u32 %r4, %r1, %r1, %r1");
  b_.Fma(x, x, x);
  EXPECT_EQ(Last(), "fma.rn.f32 %f3, %f1, %f1, %f1");
  b_.Sub(x, x);
  EXPECT_EQ(Last(), "sub.rn.f32 %f4, %f1, %f1");
}

TEST_F(PtxBuilderTest, RoundingModesAreEmittedAsRequested) {
  Value x = b_.Mov(Value::F32(2.0f));
  b_.Sqrt(x, Rounding::kRn);
  EXPECT_EQ(Last(), "sqrt.rn.f32 %f2, %f1");
  b_.Sqrt(x, Rounding::kApprox);
  EXPECT_EQ(Last(), "sqrt.approx.f32 %f3, %f1");
  b_.Rsqrt(x);
  EXPECT_EQ(Last(), "rsqrt.approx.f32 %f4, %f1");
  b_.Rcp(x, Rounding::kRn);
  EXPECT_EQ(Last(), "rcp.rn.f32 %f5, %f1");
  b_.Rcp(x, Rounding::kApprox);
  EXPECT_EQ(Last(), "rcp.approx.f32 %f6, %f1");
  b_.Div(x, x, Rounding::kRn);
  EXPECT_EQ(Last(), "div.rn.f32 %f7, %f1, %f1");
  b_.Div(x, x, Rounding::kFull);
  EXPECT_EQ(Last(), "div.full.f32 %f8, %f1, %f1");
  Value u = b_.Mov(Value::U32(7));
  b_.Cvt(PtxType::kF32, u, Rounding::kRn);
  EXPECT_EQ(Last(), "cvt.rn.f32.u32 %f9, %r1");
  b_.Cvt(PtxType::kU64, u);
  EXPECT_EQ(Last(), "cvt.u64.u32 %rd1, %r1");
}

TEST_F(PtxBuilderTest, ImmediatesAreExactAndTyped) {
  b_.Mov(Value::F32(1.0f));
  EXPECT_EQ(Last(), "mov.f32 %f1, 0f3F800000");
  b_.Mov(Value::F32(-0.0f));
  EXPECT_EQ(Last(), "mov.f32 %f2, 0f80000000");
  b_.Mov(Value::F64(1.0));
  EXPECT_EQ(Last(), "mov.f64 %fd1, 0d3FF0000000000000");
  b_.Mov(Value::S32(-5));
  EXPECT_EQ(Last(), "mov.s32 %r1, -5");
  b_.Mov(Value::B32(0xffffffffu));
  EXPECT_EQ(Last(), "mov.b32 %r2, 0xffffffff");
  b_.Mov(Value::U64(1ull << 40));
  EXPECT_EQ(Last(), "mov.u64 %rd1, 1099511627776");
}

TEST_F(PtxBuilderTest, BitwiseUsesTheBitTypeAndShiftsKeepSignedness) {
  Value u = b_.Mov(Value::U32(40));
  Value a = b_.And(u, Value::U32(31));
  EXPECT_EQ(a.type(), PtxType::kU32);  // the value keeps its own type
  EXPECT_EQ(Last(), "and.b32 %r2, %r1, 31");
  b_.Shr(u, Value::U32(5));
  EXPECT_EQ(Last(), "shr.u32 %r3, %r1, 5");
  Value s = b_.Mov(Value::S32(-64));
  b_.Shr(s, Value::U32(5));
  EXPECT_EQ(Last(), "shr.s32 %r5, %r4, 5");
  Value d = b_.Mov(Value::U64(3));
  b_.Shl(d, Value::U32(2));
  EXPECT_EQ(Last(), "shl.b64 %rd2, %rd1, 2");
}

TEST_F(PtxBuilderTest, HalfPrecisionConversionsAndBitcasts) {
  Value base = PointerParam();
  Value raw = b_.Ld(StateSpace::kGlobal, PtxType::kB16, Address{base});
  EXPECT_EQ(Last(), "ld.global.b16 %rs1, [%rd1]");
  Value x = b_.CvtFrom(PtxType::kF32, PtxType::kF16, raw);
  EXPECT_EQ(Last(), "cvt.f32.f16 %f1, %rs1");
  Value h = b_.Cvt(PtxType::kBF16, x, Rounding::kRn);
  EXPECT_EQ(Last(), "cvt.rn.bf16.f32 %rs2, %f1");
  b_.StAs(StateSpace::kGlobal, PtxType::kB16, Address{base, 2}, h);
  EXPECT_EQ(Last(), "st.global.b16 [%rd1+2], %rs2");
  Value bits = b_.Mov(Value::U32(0x3f800000u));
  Value one = b_.Bitcast(PtxType::kF32, bits);
  EXPECT_EQ(one.type(), PtxType::kF32);
  EXPECT_EQ(Last(), "mov.b32 %f2, %r1");
  b_.Mov(Value::Imm(PtxType::kB16, 0));
  EXPECT_EQ(Last(), "mov.b16 %rs3, 0x0");
  b_.Ret();
  EXPECT_TRUE(Verify(m_).ok()) << Verify(m_);
}

TEST_F(PtxBuilderTest, SpecialRegistersAreReadWithMov) {
  Value t = b_.Mov(SpecialReg::kTidX);
  EXPECT_EQ(t.type(), PtxType::kU32);
  EXPECT_EQ(Last(), "mov.u32 %r1, %tid.x");
  b_.Mov(SpecialReg::kCtaidX);
  EXPECT_EQ(Last(), "mov.u32 %r2, %ctaid.x");
  b_.Mov(SpecialReg::kNtidX);
  EXPECT_EQ(Last(), "mov.u32 %r3, %ntid.x");
  b_.Mov(SpecialReg::kLaneId);
  EXPECT_EQ(Last(), "mov.u32 %r4, %laneid");
}

TEST_F(PtxBuilderTest, LabelsAreUniqueEvenWithTheSameHint) {
  Label a = b_.CreateLabel("loop");
  Label c = b_.CreateLabel("loop");
  Label odd = b_.CreateLabel("has space-and.dot");
  EXPECT_NE(f_.label_name(a.id), f_.label_name(c.id));
  EXPECT_EQ(f_.label_name(a.id), "$L_loop_0");
  EXPECT_EQ(f_.label_name(c.id), "$L_loop_1");
  EXPECT_EQ(f_.label_name(odd.id), "$L_has_space_and_dot_2");  // always a valid identifier
}

TEST_F(PtxBuilderTest, ParametersAreDeclaredOnceAndLoadedByHandle) {
  Param p = f_.AddParam(PtxType::kU64, "out_ptr");
  Param n = f_.AddParam(PtxType::kU32, "n");
  Value v = b_.LdParam(p);
  EXPECT_EQ(v.type(), PtxType::kU64);
  EXPECT_EQ(Last(), "ld.param.u64 %rd1, [out_ptr]");
  b_.LdParam(n);
  EXPECT_EQ(Last(), "ld.param.u32 %r1, [n]");
  b_.LdParam(p);  // a second load of the same handle reads the same declared parameter
  EXPECT_EQ(Last(), "ld.param.u64 %rd2, [out_ptr]");
  ASSERT_EQ(f_.params().size(), 2u);
}

TEST_F(PtxBuilderTest, PredicateScopesGuardAndRestore) {
  Value u = b_.Mov(Value::U32(1));
  Value p = b_.Setp(CmpOp::kLt, u, Value::U32(2));
  EXPECT_EQ(Last(), "setp.lt.u32 %p1, %r1, 2");
  Value q = b_.Setp(CmpOp::kGe, u, Value::U32(0));
  {
    auto outer = b_.If(p);
    b_.Add(u, u);
    EXPECT_EQ(Last(), "@%p1 add.u32 %r2, %r1, %r1");
    {
      auto inner = b_.IfNot(q);
      b_.Add(u, u);
      EXPECT_EQ(Last(), "@!%p2 add.u32 %r3, %r1, %r1");
    }
    b_.Add(u, u);
    EXPECT_EQ(Last(), "@%p1 add.u32 %r4, %r1, %r1");
  }
  b_.Add(u, u);
  EXPECT_EQ(Last(), "add.u32 %r5, %r1, %r1");
}

TEST_F(PtxBuilderTest, PredicatedLoadKeepsTheFallback) {
  Value base = PointerParam();
  Value ok = b_.Setp(CmpOp::kNe, base, Value::U64(0));
  Value x = b_.LdOr(StateSpace::kGlobal, ok, Address{base, 8}, Value::F32(0.0f));
  const auto& code = f_.instructions();
  ASSERT_GE(code.size(), 2u);
  EXPECT_EQ(InstructionText(f_, code[code.size() - 2]), "mov.f32 %f1, 0f00000000");
  EXPECT_EQ(Last(), "@%p1 ld.global.f32 %f1, [%rd1+8]");
  EXPECT_EQ(x.reg(), code.back().dst[0].reg());
}

TEST_F(PtxBuilderTest, LoadIntoExistingRegistersTakesItsOwnGuardOrTheScopes) {
  Value base = PointerParam();
  Value ok = b_.Setp(CmpOp::kNe, base, Value::U64(0));
  const Value lo = b_.Mov(Value::F32(0.0f));
  const Value hi = b_.Mov(Value::F32(0.0f));
  b_.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{base, 8}, {lo, hi}, ok);
  EXPECT_EQ(Last(), "@%p1 ld.global.v2.f32 {%f1, %f2}, [%rd1+8]");
  {
    auto guard = b_.IfNot(ok);
    b_.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{base, 4}, {hi});
    EXPECT_EQ(Last(), "@!%p1 ld.global.f32 %f2, [%rd1+4]");
  }
  b_.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{base}, {lo});
  EXPECT_EQ(Last(), "ld.global.f32 %f1, [%rd1]");
  EXPECT_EQ(f_.num_registers(), 4u);  // %rd1, %p1, %f1, %f2: the loads made none
  b_.Ret();
  EXPECT_TRUE(Verify(m_).ok()) << Verify(m_);
}

TEST_F(PtxBuilderTest, VectorLoadsAndStoresUseBraces) {
  Value base = PointerParam();
  std::vector<Value> v = b_.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{base, 16});
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(Last(), "ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd1+16]");
  b_.StV4(StateSpace::kGlobal, Address{base, -16}, v);
  EXPECT_EQ(Last(), "st.global.v4.f32 [%rd1+-16], {%f1, %f2, %f3, %f4}");
}

TEST_F(PtxBuilderTest, ShuffleAtomicBarrierAndBranchForms) {
  Value base = PointerParam();
  Value x = b_.Ld(StateSpace::kGlobal, PtxType::kF32, Address{base});
  b_.Shfl(ShflMode::kDown, x, Value::U32(16), 0xffffffffu);
  EXPECT_EQ(Last(), "shfl.sync.down.b32 %f2, %f1, 16, 31, 0xffffffff");
  b_.Shfl(ShflMode::kBfly, x, Value::U32(1), 0x0000ffffu);
  EXPECT_EQ(Last(), "shfl.sync.bfly.b32 %f3, %f1, 1, 31, 0xffff");
  b_.Shfl(ShflMode::kIdx, x, Value::U32(0), 0xffffffffu);
  EXPECT_EQ(Last(), "shfl.sync.idx.b32 %f4, %f1, 0, 31, 0xffffffff");
  b_.Shfl(ShflMode::kUp, x, Value::U32(1), 0xffffffffu);
  EXPECT_EQ(Last(), "shfl.sync.up.b32 %f5, %f1, 1, 0, 0xffffffff");
  b_.AtomAdd(StateSpace::kGlobal, Address{base, 4}, x);
  EXPECT_EQ(Last(), "atom.global.add.f32 %f6, [%rd1+4], %f1");
  b_.BarSync();
  EXPECT_EQ(Last(), "bar.sync 0");
  Label l = b_.CreateLabel("end");
  b_.Bra(l, /*uniform=*/true);
  EXPECT_EQ(Last(), "bra.uni $L_end_0");
  b_.Bind(l);
  EXPECT_EQ(Last(), "$L_end_0:");
  b_.Ret();
  EXPECT_EQ(Last(), "ret");
  EXPECT_TRUE(Verify(m_).ok()) << Verify(m_);
}

TEST_F(PtxBuilderTest, SharedArraysAreDeclaredInTheEntryAndAddressedByMov) {
  SharedArray partials = f_.AddShared("partials", 128, 16);
  Value base = b_.AddressOf(partials);
  EXPECT_EQ(base.type(), PtxType::kU64);
  EXPECT_EQ(Last(), "mov.u64 %rd1, partials");
  Value x = b_.Ld(StateSpace::kShared, PtxType::kF32, Address{base, 4});
  EXPECT_EQ(Last(), "ld.shared.f32 %f1, [%rd1+4]");
  b_.St(StateSpace::kShared, Address{base, 8}, x);
  EXPECT_EQ(Last(), "st.shared.f32 [%rd1+8], %f1");
  b_.Ret();
  ASSERT_TRUE(Verify(m_).ok()) << Verify(m_);
  EXPECT_TRUE(absl::StrContains(EmitPtx(m_),
                                "\t.reg .f32 %f<2>;\n\t.shared .align 16 .b8 partials[128];\n\n"))
      << EmitPtx(m_);
}

TEST_F(PtxBuilderTest, InsertionPointInsertsBeforeLaterInstructions) {
  b_.Mov(Value::U32(1));
  b_.Ret();
  b_.SetInsertPoint(1);
  b_.Mov(Value::U32(2));
  ASSERT_EQ(f_.instructions().size(), 3u);
  EXPECT_EQ(InstructionText(f_, f_.instructions()[1]), "mov.u32 %r2, 2");
  EXPECT_EQ(InstructionText(f_, f_.instructions()[2]), "ret");
}

TEST_F(PtxBuilderTest, ModuleTextHasTheConventionalLayout) {
  Module m(PtxVersion{8, 0}, 90);
  Function& f = m.AddEntry("scale");
  Param out = f.AddParam(PtxType::kU64, "out");
  Param n = f.AddParam(PtxType::kU32, "n");
  f.set_max_threads(256);
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
            "//\n// Generated by normgrad-ptx/3\n//\n\n"
            ".version 8.0\n.target sm_90\n.address_size 64\n\n"
            ".visible .entry scale(\n\t.param .u64 out,\n\t.param .u32 n\n)\n"
            ".maxntid 256, 1, 1\n{\n"
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

  // Without a declared block size there is no directive.
  f.set_max_threads(0);
  EXPECT_FALSE(absl::StrContains(EmitPtx(m), ".maxntid")) << EmitPtx(m);
}

TEST_F(PtxBuilderTest, RegisterDeclarationsCoverEveryUsedIndex) {
  for (int i = 0; i < 10; ++i) b_.Mov(Value::U32(static_cast<uint32_t>(i)));
  b_.Ret();
  const std::string text = EmitPtx(m_);
  EXPECT_TRUE(absl::StrContains(text, ".reg .b32 %r<11>;")) << text;  // %r1..%r10
  EXPECT_TRUE(absl::StrContains(text, "mov.u32 %r10, 9;"));
  EXPECT_FALSE(absl::StrContains(text, ".reg .f32"));  // unused classes are not declared
}

TEST_F(PtxBuilderTest, MinimumVersionForInstructionsIsShflSyncs) {
  b_.Ret();
  EXPECT_EQ(InstructionsMinPtxVersion(m_), (PtxVersion{6, 0}));
}

}  // namespace
}  // namespace normgrad::kernels
