// Verify() accepts both kernels and rejects each kind of broken module with a message that names
// the problem.
#include "kernels/ptx/verifier.h"

#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/ptx/ptx_builder.h"
#include "kernels/ptx/ptx_printer.h"
#include "kernels/rmsnorm/rms_norm_backward.h"
#include "tests/kernels/single_entry_module.h"

namespace normgrad::kernels {
namespace {

// A tiny valid entry `k` with parameters `data` (u64) and `n` (u32) and a builder at its end.
// Tests break one thing in it.
using Fixture = SingleEntryModule;

void ExpectRejected(const Module& m, absl::string_view needle) {
  absl::Status s = Verify(m);
  ASSERT_FALSE(s.ok()) << "accepted a broken module:\n" << EmitPtx(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), needle)) << s.message();
}

void ExpectAccepted(const Module& m) { EXPECT_TRUE(Verify(m).ok()) << Verify(m); }

TEST(VerifierTest, AcceptsBothKernelsForEveryTarget) {
  for (const BackwardKernel* k : AllKernels()) {
    const auto* built = dynamic_cast<const BuiltKernel*>(k);
    ASSERT_NE(built, nullptr);
    for (int sm : {75, 80, 86, 89, 90, 100, 120}) {
      absl::StatusOr<Module> m = built->Build({.hidden_dim = 32, .target_sm = sm});
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_TRUE(Verify(*m).ok()) << k->EntryName() << " sm_" << sm << ": " << Verify(*m);
    }
  }
}

// One broken entry per row: what `build` writes into a fresh Fixture (a `ret` follows unless the
// case is about the end of the entry), and a part of the message Verify must give.
struct BrokenEntry {
  const char* name;
  void (*build)(Fixture& fx);
  const char* needle;
  bool ends_with_ret = true;
};

const BrokenEntry kBrokenEntries[] = {
    // Definite assignment.
    {"ReadBeforeWrite",
     [](Fixture& fx) { fx.b.Add(fx.f.NewRegister(PtxType::kU32), Value::U32(1)); },
     "reads %r1 before it is written"},
    {"AValueWrittenOnOnlyOnePath",
     [](Fixture& fx) {
       Value tid = fx.b.Mov(SpecialReg::kTidX);
       Value maybe = fx.f.NewRegister(PtxType::kU32);
       Label skip = fx.b.CreateLabel("skip");
       fx.b.BraIf(fx.b.Setp(CmpOp::kLt, tid, Value::U32(4)), skip);
       fx.b.Assign(maybe, Value::U32(7));
       fx.b.Bind(skip);
       fx.b.Add(maybe, tid);  // on the taken branch `maybe` was never written
     },
     "before it is written on every path"},
    {"APredicatedWriteThatDefinesNothing",
     [](Fixture& fx) {
       Value p = fx.b.Setp(CmpOp::kLt, fx.b.Mov(SpecialReg::kTidX), Value::U32(4));
       Value x = fx.f.NewRegister(PtxType::kU32);
       {
         auto g = fx.b.If(p);
         fx.b.Assign(x, Value::U32(1));
       }
       fx.b.Add(x, x);
     },
     "before it is written"},
    // Operand types.
    {"OperandTypeMismatch",
     [](Fixture& fx) {
       Value u = fx.b.Mov(Value::U32(1));
       fx.b.Add(u, fx.b.Mov(Value::F32(1.0f)));  // add.u32 with an f32 operand
     },
     "second operand has type .f32, incompatible with .u32"},
    {"AFloatImmediateInAnIntegerInstruction",
     [](Fixture& fx) { fx.b.Mul(fx.b.Mov(Value::U32(1)), Value::F32(2.0f)); },
     "incompatible with .u32"},
    {"AShuffleOfA64BitValue",
     [](Fixture& fx) {
       fx.b.Shfl(ShflMode::kDown, fx.b.Mov(Value::U64(1)), Value::U32(1), 0xffffffffu);
     },
     "has type .u64, incompatible with .b32"},
    {"OrderedComparisonOfBitTypes",
     [](Fixture& fx) { fx.b.Setp(CmpOp::kLt, fx.b.Mov(Value::B32(1)), Value::B32(2)); },
     "eq/ne only"},
    // Labels and parameters.
    {"AnUnboundBranchTarget", [](Fixture& fx) { fx.b.Bra(fx.b.CreateLabel("nowhere")); },
     "not bound"},
    {"ALabelBoundTwice",
     [](Fixture& fx) {
       Label l = fx.b.CreateLabel("twice");
       fx.b.Bind(l);
       fx.b.Bind(l);
     },
     "bound twice"},
    {"ABranchToALabelNeverCreated", [](Fixture& fx) { fx.b.Bra(Label{42}); }, "never created"},
    {"AnUndeclaredParameter",
     [](Fixture& fx) {
       fx.b.LdParam(Param{7, PtxType::kU64});
     },
     "parameter #7, which is not declared"},
    {"AParameterLoadedWithTheWrongType",
     [](Fixture& fx) {
       fx.b.LdParam(Param{fx.n.index, PtxType::kU64});
     },  // n is .u32
     "declared .u32"},
    {"ADuplicateParameterName", [](Fixture& fx) { fx.f.AddParam(PtxType::kU32, "n"); },
     "declared twice"},
    {"AnInvalidParameterName", [](Fixture& fx) { fx.f.AddParam(PtxType::kU32, "9lives"); },
     "not a PTX identifier"},
    // Rounding and multiply modes.
    {"FloatDivisionWithoutRounding",
     [](Fixture& fx) {
       Value x = fx.b.Mov(Value::F32(1.0f));
       fx.b.Div(x, x);  // div.f32 without .rn/.approx/.full is not PTX
     },
     "float div needs"},
    {"SqrtWithoutRounding",
     [](Fixture& fx) { fx.b.Sqrt(fx.b.Mov(Value::F32(1.0f)), Rounding::kNone); },
     "needs an explicit"},
    {"ExactRsqrt",
     [](Fixture& fx) {
       fx.b.Rsqrt(fx.b.Mov(Value::F32(1.0f)));
       fx.f.mutable_instructions().back().rounding = Rounding::kRn;  // rsqrt.rn does not exist
     },
     "rsqrt exists only as .approx"},
    {"IntToFloatConversionWithoutRounding",
     [](Fixture& fx) { fx.b.Cvt(PtxType::kF32, fx.b.Mov(Value::U32(3))); }, "cvt.f32.u32 needs"},
    {"AnIntegerMultiplyWithoutMode",
     [](Fixture& fx) {
       Value u = fx.b.Mov(Value::U32(3));
       fx.b.Mul(u, u);
       fx.f.mutable_instructions().back().mul_mode = MulMode::kNone;
     },
     "needs .lo, .hi or .wide"},
    {"WideMultiplyOfA64BitValue",
     [](Fixture& fx) {
       Value d = fx.b.Mov(Value::U64(3));
       fx.b.MulWide(d, d);
     },
     ".wide needs a 16- or 32-bit source type"},
    // Guards, addresses, register handles.
    {"ANonPredicateGuard",
     [](Fixture& fx) {
       Value u = fx.b.Mov(Value::U32(1));
       auto g = fx.b.If(u);
       fx.b.Add(u, u);
     },
     "guard must be a .pred register"},
    {"ANon64BitAddress",
     [](Fixture& fx) {
       fx.b.Ld(StateSpace::kGlobal, PtxType::kF32, Address{fx.b.Mov(Value::U32(0))});
     },
     "a 64-bit integer is required"},
    {"AMisalignedVectorOffset",
     [](Fixture& fx) {  // a 16-byte access at +8
       fx.b.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{fx.b.LdParam(fx.data), 8});
     },
     "offset 8 is not a multiple of the access size 16 bytes"},
    {"AMisalignedScalarOffset",
     [](Fixture& fx) {
       fx.b.St(StateSpace::kGlobal, Address{fx.b.LdParam(fx.data), 2}, Value::F32(0.0f));
     },
     "offset 2 is not a multiple of the access size 4 bytes"},
    {"AStaleRegisterHandle",
     [](Fixture& fx) {
       fx.b.Mov(Value::U32(0));
       fx.b.Add(Value::Register(0, PtxType::kF32), Value::F32(1.0f));  // register 0 is .u32
     },
     "register %r1 is .u32"},
    {"ARegisterThatDoesNotExist", [](Fixture& fx) { fx.b.Mov(Value::Register(99, PtxType::kU32)); },
     "does not exist"},
    {"AnImmediateDestination", [](Fixture& fx) { fx.b.Assign(Value::U32(5), Value::U32(6)); },
     "destination must be a register"},
    // Cache operators.
    {"AStoreCacheOperatorOnALoad",
     [](Fixture& fx) {
       auto hint = fx.b.WithCache(CacheOp::kWt);
       fx.b.Ld(StateSpace::kGlobal, PtxType::kF32, Address{fx.b.LdParam(fx.data)});
     },
     "ld has no cache operator .wt"},
    {"ALoadCacheOperatorOnAStore",
     [](Fixture& fx) {
       const Value data = fx.b.LdParam(fx.data);
       auto hint = fx.b.WithCache(CacheOp::kLu);
       fx.b.St(StateSpace::kGlobal, Address{data}, Value::F32(0.0f));
     },
     "st has no cache operator .lu"},
    {"ACacheOperatorOnSharedMemory",
     [](Fixture& fx) {
       SharedArray buf = fx.f.AddShared("buf", 16);
       Instruction in;
       in.op = Opcode::kSt;
       in.type = PtxType::kF32;
       in.space = StateSpace::kShared;
       in.cache = CacheOp::kCs;
       in.src = {fx.b.AddressOf(buf), Value::F32(0.0f)};
       fx.b.Append(in);
     },
     "applies to .global accesses only"},
    // Shared arrays.
    {"ASharedArrayNamedLikeAParameter", [](Fixture& fx) { fx.f.AddShared("n", 16); },
     "already used"},
    {"ASharedArrayWithABadAlignment", [](Fixture& fx) { fx.f.AddShared("buf", 16, 3); },
     "power-of-two alignment"},
    {"TooMuchStaticSharedMemory",
     [](Fixture& fx) {
       fx.f.AddShared("a", 32 * 1024);
       fx.f.AddShared("b", 32 * 1024);
     },
     "65536 bytes of static shared memory exceed 49152"},
    {"ASharedSymbolOutsideMov",
     [](Fixture& fx) {
       SharedArray buf = fx.f.AddShared("buf", 16);
       fx.b.Add(fx.b.Mov(Value::U64(0)), Value::SharedSymbol(buf.index));  // only for mov
     },
     "read with mov.u64"},
    {"AnUndeclaredSharedArray", [](Fixture& fx) { fx.b.Mov(Value::SharedSymbol(3)); },
     "shared array #3, which is not declared"},
    // The end of the entry.
    {"FallingOffTheEnd", [](Fixture& fx) { fx.b.Mov(Value::U32(0)); }, "without ret or exit",
     /*ends_with_ret=*/false},
};

class VerifierRejectsTest : public ::testing::TestWithParam<BrokenEntry> {};

TEST_P(VerifierRejectsTest, WithAMessageNamingTheProblem) {
  Fixture fx;
  GetParam().build(fx);
  if (GetParam().ends_with_ret) fx.b.Ret();
  ExpectRejected(fx.m, GetParam().needle);
}

INSTANTIATE_TEST_SUITE_P(BrokenEntries, VerifierRejectsTest, ::testing::ValuesIn(kBrokenEntries),
                         [](const ::testing::TestParamInfo<BrokenEntry>& info) {
                           return std::string(info.param.name);
                         });

TEST(VerifierTest, AcceptsALoopCarriedRegisterWrittenBeforeTheLoop) {
  Fixture fx;
  Builder& b = fx.b;
  Value i = b.Mov(Value::U32(0));
  Label loop = b.CreateLabel("loop");
  Label done = b.CreateLabel("done");
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, b.LdParam(fx.n)), done);
  b.AddTo(i, Value::U32(1));
  b.Bra(loop);
  b.Bind(done);
  b.Ret();
  ExpectAccepted(fx.m);
}

TEST(VerifierTest, AcceptsSameSizeIntegerAndBitTypes) {
  Fixture fx;
  Value u = fx.b.Mov(Value::U32(1));
  Value s = fx.b.Mov(Value::S32(-1));
  fx.b.Add(u, s);                 // u32 and s32 registers mix like PTX allows
  fx.b.And(u, Value::B32(0xff));  // and.b32 on a u32 value
  fx.b.Ret();
  ExpectAccepted(fx.m);
}

// Module-level checks: the target, the version, bf16, entry names.
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

// The entry `k` of nothing but `ret`, declared with `.maxntid max_threads` and `.minnctapersm
// min_blocks_per_sm` (0: not declared).
Module EntryWithLaunchBounds(uint32_t max_threads, uint32_t min_blocks_per_sm) {
  Fixture fx;
  fx.b.Ret();
  fx.f.set_max_threads(max_threads);
  fx.f.set_min_blocks_per_sm(min_blocks_per_sm);
  return std::move(fx.m);
}

TEST(VerifierTest, RejectsAMaxntidAboveTheDevicesBlockLimit) {
  ExpectAccepted(EntryWithLaunchBounds(1024, 0));
  ExpectRejected(EntryWithLaunchBounds(1025, 0), "entry k: .maxntid 1025 exceeds 1024");
}

TEST(VerifierTest, RejectsMinBlocksPerSmWithoutMaxntidOrAboveTheThreadsAnSmKeeps) {
  ExpectRejected(EntryWithLaunchBounds(0, 2),
                 "entry k: .minnctapersm 2 with .maxntid 0 needs a .maxntid");
  ExpectAccepted(EntryWithLaunchBounds(512, 2));
  ExpectRejected(EntryWithLaunchBounds(512, 3), ".minnctapersm 3 with .maxntid 512");
}

TEST(VerifierTest, MessageNamesTheInstructionIndexAndText) {
  Fixture fx;
  Value u = fx.b.Mov(Value::U32(1));
  Value x = fx.b.Mov(Value::F32(1.0f));
  fx.b.Sub(u, x);
  fx.b.Ret();
  absl::Status s = Verify(fx.m);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "entry k, instruction 2 (sub.u32 %r2, %r1, %f1)"))
      << s.message();
}

}  // namespace
}  // namespace normgrad::kernels
