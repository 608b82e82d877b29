// Verify() accepts both kernels and rejects each kind of broken module with a message that names
// the problem.
#include "kernels/verifier.h"

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
#include "kernels/ptx_builder.h"
#include "kernels/ptx_printer.h"
#include "kernels/rms_norm_backward.h"

namespace normgrad::kernels {
namespace {

// A tiny valid entry: out[tid] = 1.0 for tid < n. Tests break one thing in it.
struct Fixture {
  Module m{PtxVersion{7, 0}, 80};
  Function* f = nullptr;
  Param out;
  Param n;

  Fixture() {
    f = &m.AddEntry("k");
    out = f->AddParam(PtxType::kU64, "out");
    n = f->AddParam(PtxType::kU32, "n");
  }
};

void ExpectRejected(const Module& m, absl::string_view needle) {
  absl::Status s = Verify(m);
  ASSERT_FALSE(s.ok()) << "accepted a broken module:\n" << EmitPtx(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), needle)) << s.message();
}

TEST(VerifierTest, AcceptsBothKernelsForEveryTarget) {
  for (const Kernel* k : AllKernels()) {
    const auto* built = dynamic_cast<const BuiltKernel*>(k);
    ASSERT_NE(built, nullptr);
    for (int sm : {75, 80, 86, 89, 90, 100, 120}) {
      absl::StatusOr<Module> m = built->Build({.hidden_dim = 32, .target_sm = sm});
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_TRUE(Verify(*m).ok()) << k->EntryName() << " sm_" << sm << ": " << Verify(*m);
    }
  }
}

TEST(VerifierTest, RejectsReadBeforeWrite) {
  Fixture fx;
  Builder b(fx.f);
  Value never_written = fx.f->NewRegister(PtxType::kU32);
  b.Add(never_written, Value::U32(1));
  b.Ret();
  ExpectRejected(fx.m, "reads %r1 before it is written");
}

TEST(VerifierTest, RejectsAValueWrittenOnOnlyOnePath) {
  Fixture fx;
  Builder b(fx.f);
  Value tid = b.Mov(SpecialReg::kTidX);
  Value maybe = fx.f->NewRegister(PtxType::kU32);
  Label skip = b.CreateLabel("skip");
  b.BraIf(b.Setp(CmpOp::kLt, tid, Value::U32(4)), skip);
  b.Assign(maybe, Value::U32(7));
  b.Bind(skip);
  b.Add(maybe, tid);  // on the taken branch `maybe` was never written
  b.Ret();
  ExpectRejected(fx.m, "before it is written on every path");
}

TEST(VerifierTest, APredicatedWriteDoesNotDefineARegister) {
  Fixture fx;
  Builder b(fx.f);
  Value tid = b.Mov(SpecialReg::kTidX);
  Value p = b.Setp(CmpOp::kLt, tid, Value::U32(4));
  Value x = fx.f->NewRegister(PtxType::kU32);
  {
    auto g = b.If(p);
    b.Assign(x, Value::U32(1));
  }
  b.Add(x, x);
  b.Ret();
  ExpectRejected(fx.m, "before it is written");
}

TEST(VerifierTest, AcceptsALoopCarriedRegisterWrittenBeforeTheLoop) {
  Fixture fx;
  Builder b(fx.f);
  Value i = b.Mov(Value::U32(0));
  Label loop = b.CreateLabel("loop");
  Label done = b.CreateLabel("done");
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, b.LdParam(fx.n)), done);
  b.AddTo(i, Value::U32(1));
  b.Bra(loop);
  b.Bind(done);
  b.Ret();
  EXPECT_TRUE(Verify(fx.m).ok()) << Verify(fx.m);
}

TEST(VerifierTest, RejectsOperandTypeMismatch) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(1));
  Value x = b.Mov(Value::F32(1.0f));
  b.Add(u, x);  // add.u32 with an f32 operand
  b.Ret();
  ExpectRejected(fx.m, "second operand has type .f32, incompatible with .u32");
}

TEST(VerifierTest, RejectsAFloatImmediateInAnIntegerInstruction) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(1));
  b.Mul(u, Value::F32(2.0f));
  b.Ret();
  ExpectRejected(fx.m, "incompatible with .u32");
}

TEST(VerifierTest, AcceptsSameSizeIntegerAndBitTypes) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(1));
  Value s = b.Mov(Value::S32(-1));
  b.Add(u, s);                 // u32 and s32 registers mix like PTX allows
  b.And(u, Value::B32(0xff));  // and.b32 on a u32 value
  b.Ret();
  EXPECT_TRUE(Verify(fx.m).ok()) << Verify(fx.m);
}

TEST(VerifierTest, RejectsAnUnboundBranchTarget) {
  Fixture fx;
  Builder b(fx.f);
  Label nowhere = b.CreateLabel("nowhere");
  b.Bra(nowhere);
  b.Ret();
  ExpectRejected(fx.m, "not bound");
}

TEST(VerifierTest, RejectsALabelBoundTwice) {
  Fixture fx;
  Builder b(fx.f);
  Label l = b.CreateLabel("twice");
  b.Bind(l);
  b.Bind(l);
  b.Ret();
  ExpectRejected(fx.m, "bound twice");
}

TEST(VerifierTest, RejectsABranchToALabelNeverCreated) {
  Fixture fx;
  Builder b(fx.f);
  b.Bra(Label{42});
  b.Ret();
  ExpectRejected(fx.m, "never created");
}

TEST(VerifierTest, RejectsAnUndeclaredParameter) {
  Fixture fx;
  Builder b(fx.f);
  b.LdParam(Param{7, PtxType::kU64});
  b.Ret();
  ExpectRejected(fx.m, "parameter #7, which is not declared");
}

TEST(VerifierTest, RejectsAParameterLoadedWithTheWrongType) {
  Fixture fx;
  Builder b(fx.f);
  b.LdParam(Param{fx.n.index, PtxType::kU64});  // n is .u32
  b.Ret();
  ExpectRejected(fx.m, "declared .u32");
}

TEST(VerifierTest, RejectsDuplicateAndInvalidParameterNames) {
  {
    Fixture fx;
    fx.f->AddParam(PtxType::kU32, "n");
    Builder(fx.f).Ret();
    ExpectRejected(fx.m, "declared twice");
  }
  {
    Fixture fx;
    fx.f->AddParam(PtxType::kU32, "9lives");
    Builder(fx.f).Ret();
    ExpectRejected(fx.m, "not a PTX identifier");
  }
}

TEST(VerifierTest, RejectsFloatDivisionWithoutRounding) {
  Fixture fx;
  Builder b(fx.f);
  Value x = b.Mov(Value::F32(1.0f));
  b.Div(x, x);  // div.f32 without .rn/.approx/.full is not PTX
  b.Ret();
  ExpectRejected(fx.m, "float div needs");
}

TEST(VerifierTest, RejectsSqrtWithoutRoundingAndExactRsqrt) {
  {
    Fixture fx;
    Builder b(fx.f);
    Value x = b.Mov(Value::F32(1.0f));
    b.Sqrt(x, Rounding::kNone);
    b.Ret();
    ExpectRejected(fx.m, "needs an explicit");
  }
  {
    Fixture fx;
    Builder b(fx.f);
    Value x = b.Mov(Value::F32(1.0f));
    Value r = b.Rsqrt(x);
    fx.f->mutable_instructions().back().rounding = Rounding::kRn;  // rsqrt.rn does not exist
    (void)r;
    b.Ret();
    ExpectRejected(fx.m, "rsqrt exists only as .approx");
  }
}

TEST(VerifierTest, RejectsIntToFloatConversionWithoutRounding) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(3));
  b.Cvt(PtxType::kF32, u);
  b.Ret();
  ExpectRejected(fx.m, "cvt.f32.u32 needs");
}

TEST(VerifierTest, RejectsAnIntegerMultiplyWithoutMode) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(3));
  b.Mul(u, u);
  fx.f->mutable_instructions().back().mul_mode = MulMode::kNone;
  b.Ret();
  ExpectRejected(fx.m, "needs .lo, .hi or .wide");
}

TEST(VerifierTest, RejectsWideMultiplyOfA64BitValue) {
  Fixture fx;
  Builder b(fx.f);
  Value d = b.Mov(Value::U64(3));
  b.MulWide(d, d);
  b.Ret();
  ExpectRejected(fx.m, ".wide needs a 16- or 32-bit source type");
}

TEST(VerifierTest, RejectsANonPredicateGuard) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(1));
  {
    auto g = b.If(u);
    b.Add(u, u);
  }
  b.Ret();
  ExpectRejected(fx.m, "guard must be a .pred register");
}

TEST(VerifierTest, RejectsANon64BitAddress) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(0));
  b.Ld(StateSpace::kGlobal, PtxType::kF32, Address{u});
  b.Ret();
  ExpectRejected(fx.m, "a 64-bit integer is required");
}

TEST(VerifierTest, RejectsAMisalignedConstantOffset) {
  {
    Fixture fx;
    Builder b(fx.f);
    Value base = b.LdParam(fx.out);
    b.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{base, 8});  // a 16-byte access at +8
    b.Ret();
    ExpectRejected(fx.m, "offset 8 is not a multiple of the access size 16 bytes");
  }
  {
    Fixture fx;
    Builder b(fx.f);
    Value base = b.LdParam(fx.out);
    b.St(StateSpace::kGlobal, Address{base, 2}, Value::F32(0.0f));
    b.Ret();
    ExpectRejected(fx.m, "offset 2 is not a multiple of the access size 4 bytes");
  }
}

TEST(VerifierTest, RejectsAStaleRegisterHandle) {
  Fixture fx;
  Builder b(fx.f);
  b.Mov(Value::U32(0));
  b.Add(Value::Register(0, PtxType::kF32), Value::F32(1.0f));  // register 0 is .u32
  b.Ret();
  ExpectRejected(fx.m, "register %r1 is .u32");
}

TEST(VerifierTest, RejectsARegisterThatDoesNotExist) {
  Fixture fx;
  Builder b(fx.f);
  b.Mov(Value::Register(99, PtxType::kU32));
  b.Ret();
  ExpectRejected(fx.m, "does not exist");
}

TEST(VerifierTest, RejectsAnImmediateDestination) {
  Fixture fx;
  Builder b(fx.f);
  b.Assign(Value::U32(5), Value::U32(6));
  b.Ret();
  ExpectRejected(fx.m, "destination must be a register");
}

TEST(VerifierTest, RejectsAShuffleOfA64BitValue) {
  Fixture fx;
  Builder b(fx.f);
  Value d = b.Mov(Value::U64(1));
  b.Shfl(ShflMode::kDown, d, Value::U32(1), 0xffffffffu);
  b.Ret();
  ExpectRejected(fx.m, "has type .u64, incompatible with .b32");
}

TEST(VerifierTest, RejectsOrderedComparisonOfBitTypes) {
  Fixture fx;
  Builder b(fx.f);
  Value r = b.Mov(Value::B32(1));
  b.Setp(CmpOp::kLt, r, Value::B32(2));
  b.Ret();
  ExpectRejected(fx.m, "eq/ne only");
}

TEST(VerifierTest, RejectsBadSharedArrays) {
  {
    Fixture fx;
    fx.f->AddShared("n", 16);  // clashes with the parameter n
    Builder(fx.f).Ret();
    ExpectRejected(fx.m, "already used");
  }
  {
    Fixture fx;
    fx.f->AddShared("buf", 16, 3);
    Builder(fx.f).Ret();
    ExpectRejected(fx.m, "power-of-two alignment");
  }
  {
    Fixture fx;
    fx.f->AddShared("a", 32 * 1024);
    fx.f->AddShared("b", 32 * 1024);
    Builder(fx.f).Ret();
    ExpectRejected(fx.m, "65536 bytes of static shared memory exceed 49152");
  }
  {
    Fixture fx;
    SharedArray buf = fx.f->AddShared("buf", 16);
    Builder b(fx.f);
    Value x = b.Mov(Value::U64(0));
    b.Add(x, Value::SharedSymbol(buf.index));  // symbols are only for mov
    b.Ret();
    ExpectRejected(fx.m, "read with mov.u64");
  }
  {
    Fixture fx;
    Builder b(fx.f);
    b.Mov(Value::SharedSymbol(3));
    b.Ret();
    ExpectRejected(fx.m, "shared array #3, which is not declared");
  }
}

TEST(VerifierTest, RejectsFallingOffTheEnd) {
  Fixture fx;
  Builder b(fx.f);
  b.Mov(Value::U32(0));
  ExpectRejected(fx.m, "without ret or exit");
}

TEST(VerifierTest, RejectsAVersionBelowTheTargetsMinimum) {
  Module m(PtxVersion{7, 0}, 90);  // sm_90 needs 7.8
  Builder(&m.AddEntry("k")).Ret();
  ExpectRejected(m, "below 7.8");
}

TEST(VerifierTest, RejectsAnUnsupportedTarget) {
  Module m(PtxVersion{7, 0}, 70);  // CUDA 13's ptxas no longer assembles sm_70
  Builder(&m.AddEntry("k")).Ret();
  ExpectRejected(m, "sm_70 is not supported");
}

TEST(VerifierTest, RejectsBf16BelowSm80) {
  Module m(PtxVersion{7, 0}, 75);
  Builder b(&m.AddEntry("k"));
  b.Cvt(PtxType::kBF16, b.Mov(Value::F32(1.0f)), Rounding::kRn);
  b.Ret();
  ExpectRejected(m, "needs sm_80 or newer");
}

TEST(VerifierTest, RejectsDuplicateEntries) {
  Module m(PtxVersion{7, 0}, 80);
  Builder(&m.AddEntry("k")).Ret();
  Builder(&m.AddEntry("k")).Ret();
  ExpectRejected(m, "declared twice");
}

TEST(VerifierTest, MessageNamesTheInstructionIndexAndText) {
  Fixture fx;
  Builder b(fx.f);
  Value u = b.Mov(Value::U32(1));
  Value x = b.Mov(Value::F32(1.0f));
  b.Sub(u, x);
  b.Ret();
  absl::Status s = Verify(fx.m);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "entry k, instruction 2 (sub.u32 %r2, %r1, %f1)"))
      << s.message();
}

}  // namespace
}  // namespace normgrad::kernels
