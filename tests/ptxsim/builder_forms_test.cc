// Every instruction form kernels/' builder can emit is accepted by the parser, and builder-made
// shared-memory code runs: the interpreter covers the builder's whole output surface, not only
// today's two kernels.
#include <string>

#include "gtest/gtest.h"
#include "kernels/ptx/ptx_builder.h"
#include "kernels/ptx/ptx_printer.h"
#include "kernels/ptx/verifier.h"
#include "tests/kernels/instruction_forms.h"
#include "tests/ptxsim/sim/sim_harness.h"

namespace normgrad::ptxsim {
namespace {

namespace k = ::normgrad::kernels;
using k::Address;
using k::Builder;
using k::CmpOp;
using k::Label;
using k::PtxType;
using k::SpecialReg;
using k::StateSpace;
using k::Value;

TEST(BuilderForms, EveryFormTheBuilderEmitsParses) {
  const k::Module m = k::EveryInstructionFormModule();
  ASSERT_TRUE(k::Verify(m).ok()) << k::Verify(m);
  const std::string text = k::EmitPtx(m);
  absl::StatusOr<Module> module = ParsePtx(text);
  ASSERT_TRUE(module.ok()) << module.status() << "\n" << text;
  const Entry* entry = module->FindEntry(k::kEveryFormEntry);
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(entry->params.size(), k::kEveryFormParams);
  EXPECT_EQ(entry->static_shared_bytes, k::kEveryFormSharedBytes);
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
