// The CFG-based barrier/shuffle analysis: the seed's barrier-safety tests, ported, plus the cases
// the seed's text heuristic (a literal `bra exit` inside a loop) misses or gets wrong.
#include "kernels/divergence_analysis.h"

#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
#include "kernels/ptx_builder.h"
#include "kernels/ptx_printer.h"
#include "kernels/rms_norm_backward.h"
#include "kernels/verifier.h"

namespace normgrad::kernels {
namespace {

constexpr uint32_t kFull = 0xffffffffu;

std::vector<DivergenceFinding> Analyze(const Function& f, LaunchAssumptions a = {}) {
  absl::StatusOr<std::vector<DivergenceFinding>> r = AnalyzeDivergence(f, a);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<DivergenceFinding>{};
}

// An entry with a u64 `data` and a u32 `n` parameter; tests add the body.
struct Entry {
  Module m{PtxVersion{7, 0}, 80};
  Function* f;
  Param data;
  Param n;
  Entry() : f(&m.AddEntry("k")) {
    data = f->AddParam(PtxType::kU64, "data");
    n = f->AddParam(PtxType::kU32, "n");
  }
  void ExpectValid() { EXPECT_TRUE(Verify(m).ok()) << Verify(m) << "\n" << EmitPtx(m); }
};

// ---- The seed's tests, ported --------------------------------------------------------------

TEST(DivergenceAnalysisTest, RmsNormBackwardIsBarrierAndShuffleSafe) {
  const auto* k = dynamic_cast<const BuiltKernel*>(FindKernel("rms_norm_backward"));
  ASSERT_NE(k, nullptr);
  for (uint32_t hidden : {1u, 16u, 32u}) {
    absl::StatusOr<Module> m = k->Build({.hidden_dim = hidden});
    ASSERT_TRUE(m.ok()) << m.status();
    std::vector<DivergenceFinding> findings = Analyze(m->functions()[0]);
    EXPECT_TRUE(findings.empty()) << findings[0].message;
  }
}

TEST(DivergenceAnalysisTest, BatchedRmsNormBackwardIsBarrierAndShuffleSafe) {
  const auto* k = dynamic_cast<const BuiltKernel*>(FindKernel("batched_rms_norm_backward"));
  ASSERT_NE(k, nullptr);
  for (uint32_t hidden : {1u, 128u, 896u}) {
    absl::StatusOr<Module> m = k->Build({.hidden_dim = hidden});
    ASSERT_TRUE(m.ok()) << m.status();
    std::vector<DivergenceFinding> findings = Analyze(m->functions()[0]);
    EXPECT_TRUE(findings.empty()) << findings[0].message;
  }
}

// ---- What makes the small kernel safe is the launch geometry ---------------------------------

TEST(DivergenceAnalysisTest, SmallKernelShufflesNeedWholeWarps) {
  const auto* k = dynamic_cast<const BuiltKernel*>(FindKernel("rms_norm_backward"));
  absl::StatusOr<Module> m = k->Build({.hidden_dim = 32});
  ASSERT_TRUE(m.ok());
  std::vector<DivergenceFinding> findings =
      Analyze(m->functions()[0], LaunchAssumptions{.block_x_multiple_of_32 = false});
  ASSERT_EQ(findings.size(), 6u);  // 5 shfl.down + 1 shfl.idx
  for (const DivergenceFinding& f : findings) {
    EXPECT_EQ(f.hazard, DivergenceHazard::kShuffleUnderDivergence);
    EXPECT_TRUE(absl::StrContains(f.message, "not whole warps")) << f.message;
  }
}

TEST(DivergenceAnalysisTest, SmallKernelRowTestIsWarpUniformOnlyForOneDimensionalBlocks) {
  const auto* k = dynamic_cast<const BuiltKernel*>(FindKernel("rms_norm_backward"));
  absl::StatusOr<Module> m = k->Build({.hidden_dim = 32});
  ASSERT_TRUE(m.ok());
  // With 2-D blocks tid.x no longer tells the warp: the row exit becomes lane-dependent.
  std::vector<DivergenceFinding> findings =
      Analyze(m->functions()[0], LaunchAssumptions{.one_dimensional_block = false});
  ASSERT_FALSE(findings.empty());
  EXPECT_TRUE(findings[0].after_exit) << findings[0].message;
}

TEST(DivergenceAnalysisTest, GeometryKeepsTheAssumptionsTheAnalysisUses) {
  for (const Kernel* k : AllKernels()) {
    for (uint64_t rows : {1ull, 7ull, 8ull, 9ull, 1000ull, 1ull << 33}) {
      LaunchGeometry g = k->Geometry({.hidden_dim = 32}, rows);
      EXPECT_EQ(g.block[0] % 32, 0u) << k->EntryName();
      EXPECT_EQ(g.block[1], 1u);
      EXPECT_EQ(g.block[2], 1u);
      EXPECT_GE(g.grid[0], 1u);
      EXPECT_LE(g.grid[0], kMaxGridX);
    }
  }
}

// The seed's own small-kernel structure (global thread id, lane = gtid & 31, warp = gtid >> 5,
// `@!valid_row bra exit`, shuffles, `@!valid_lane bra exit`, store) is proven safe too: ctaid*ntid
// is a multiple of 32 when blocks are whole warps, so gtid >> 5 is warp-uniform.
TEST(DivergenceAnalysisTest, SeedStyleGlobalWarpIndexIsWarpUniform) {
  Entry e;
  Builder b(e.f);
  Label exit = b.CreateLabel("exit");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value ctaid = b.Mov(SpecialReg::kCtaidX);
  Value ntid = b.Mov(SpecialReg::kNtidX);
  Value gtid = b.Mad(ctaid, ntid, tid);
  Value lane = b.And(gtid, Value::U32(31));
  Value warp = b.Shr(gtid, Value::U32(5));
  Value n = b.LdParam(e.n);
  b.BraIfNot(b.Setp(CmpOp::kLt, warp, n), exit);
  Value valid_lane = b.Setp(CmpOp::kLt, lane, Value::U32(16));
  Value base = b.LdParam(e.data);
  Value x = b.LdOr(StateSpace::kGlobal, valid_lane,
                   Address{b.Add(base, b.MulWide(lane, Value::U32(4)))}, Value::F32(0.0f));
  Value s = b.Shfl(ShflMode::kDown, x, Value::U32(16), kFull);
  Value t = b.Shfl(ShflMode::kIdx, b.Add(x, s), Value::U32(0), kFull);
  b.BraIfNot(valid_lane, exit);
  b.St(StateSpace::kGlobal, Address{base}, t);
  b.Bind(exit);
  b.Ret();
  e.ExpectValid();
  EXPECT_TRUE(Analyze(*e.f).empty());
}

// ---- Cases the seed's heuristic misses ------------------------------------------------------

TEST(DivergenceAnalysisTest, FindsBarrierInsideThreadDependentBranch) {
  Entry e;
  Builder b(e.f);
  Label join = b.CreateLabel("join");
  Value tid = b.Mov(SpecialReg::kTidX);
  b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(16)), join);
  b.BarSync();  // only threads 0..15 get here
  b.Bind(join);
  b.St(StateSpace::kGlobal, Address{b.LdParam(e.data)}, tid);  // everyone continues here
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kBarrierUnderDivergence);
  EXPECT_FALSE(findings[0].after_exit);
  EXPECT_EQ(findings[0].instruction, 3u);
  EXPECT_TRUE(absl::StrContains(findings[0].message, "bar.sync 0")) << findings[0].message;
}

TEST(DivergenceAnalysisTest, FindsBarrierAfterExitThroughALabelNotNamedExit) {
  Entry e;
  Builder b(e.f);
  Label early_out = b.CreateLabel("early_out");
  Value tid = b.Mov(SpecialReg::kTidX);
  b.BraIf(b.Setp(CmpOp::kGe, tid, b.LdParam(e.n)), early_out);
  Label rest = b.CreateLabel("rest");
  b.Bra(rest);
  b.Bind(early_out);
  b.Ret();  // threads with tid >= n are gone
  b.Bind(rest);
  b.BarSync();
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_TRUE(findings[0].after_exit);
  EXPECT_TRUE(absl::StrContains(findings[0].message, "exit")) << findings[0].message;
}

TEST(DivergenceAnalysisTest, FindsFullMaskShuffleAfterALaneDependentExit) {
  Entry e;
  Builder b(e.f);
  Value tid = b.Mov(SpecialReg::kTidX);
  Value p = b.Setp(CmpOp::kGe, tid, b.LdParam(e.n));
  {
    auto g = b.If(p);
    b.Ret();  // @p ret: lanes leave one by one
  }
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  b.Shfl(ShflMode::kDown, x, Value::U32(1), kFull);
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kShuffleUnderDivergence);
  EXPECT_TRUE(findings[0].after_exit);
}

TEST(DivergenceAnalysisTest, FindsBarrierInALoopWithThreadDependentTripCount) {
  Entry e;
  Builder b(e.f);
  Label loop = b.CreateLabel("loop");
  Label done = b.CreateLabel("done");
  Value i = b.Mov(SpecialReg::kTidX);
  Value n = b.LdParam(e.n);
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, n), done);
  b.BarSync();
  b.AddTo(i, Value::U32(32));
  b.Bra(loop);
  b.Bind(done);
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kBarrierUnderDivergence);
}

TEST(DivergenceAnalysisTest, AcceptsBarrierInALoopWithUniformTripCount) {
  Entry e;
  Builder b(e.f);
  Label loop = b.CreateLabel("loop");
  Label done = b.CreateLabel("done");
  Value i = b.Mov(Value::U32(0));
  Value n = b.LdParam(e.n);
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, n), done);
  b.BarSync();
  b.AddTo(i, Value::U32(1));
  b.Bra(loop);
  b.Bind(done);
  b.BarSync();
  b.Ret();
  e.ExpectValid();
  EXPECT_TRUE(Analyze(*e.f).empty());
}

TEST(DivergenceAnalysisTest, AcceptsBarrierAfterADivergentBranchReconverges) {
  Entry e;
  Builder b(e.f);
  Label join = b.CreateLabel("join");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value base = b.LdParam(e.data);
  b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(16)), join);
  b.St(StateSpace::kGlobal, Address{base}, tid);
  b.Bind(join);
  b.BarSync();  // every thread arrives here
  b.Ret();
  e.ExpectValid();
  EXPECT_TRUE(Analyze(*e.f).empty());
}

TEST(DivergenceAnalysisTest, FindsBarrierUnderADivergentGuard) {
  Entry e;
  Builder b(e.f);
  Value tid = b.Mov(SpecialReg::kTidX);
  Value p = b.Setp(CmpOp::kLt, tid, Value::U32(8));
  {
    auto g = b.If(p);
    b.BarSync();
  }
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_TRUE(absl::StrContains(findings[0].message, "guard")) << findings[0].message;
}

TEST(DivergenceAnalysisTest, WarpUniformBranchAllowsShufflesButNotBarriers) {
  Entry e;
  Builder b(e.f);
  Label skip = b.CreateLabel("skip");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value warp = b.Shr(tid, Value::U32(5));
  b.BraIf(b.Setp(CmpOp::kEq, warp, Value::U32(0)), skip);  // warp 0 skips, the others do not
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  b.Shfl(ShflMode::kBfly, x, Value::U32(1), kFull);  // whole warps: fine
  b.BarSync();                                       // warp 0 never arrives: not fine
  b.Bind(skip);
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kBarrierUnderDivergence);
}

TEST(DivergenceAnalysisTest, BlockUniformBranchAllowsBarriers) {
  Entry e;
  Builder b(e.f);
  Label skip = b.CreateLabel("skip");
  Value block = b.Mov(SpecialReg::kCtaidX);
  b.BraIf(b.Setp(CmpOp::kGe, block, b.LdParam(e.n)), skip);
  b.BarSync();
  b.Bind(skip);
  b.Ret();
  e.ExpectValid();
  EXPECT_TRUE(Analyze(*e.f).empty());
}

TEST(DivergenceAnalysisTest, ValueJoinedAfterDivergenceIsDivergent) {
  // x = 0; if (tid < 16) x = 1; (join) if (x == 1) bar.sync  -- x differs per thread.
  Entry e;
  Builder b(e.f);
  Label join = b.CreateLabel("join");
  Label skip = b.CreateLabel("skip");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value x = b.Mov(Value::U32(0));
  b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(16)), join);
  b.Assign(x, Value::U32(1));
  b.Bind(join);
  b.BraIf(b.Setp(CmpOp::kNe, x, Value::U32(1)), skip);
  b.BarSync();
  b.Bind(skip);
  b.Ret();
  e.ExpectValid();
  EXPECT_EQ(Analyze(*e.f).size(), 1u);
}

TEST(DivergenceAnalysisTest, BroadcastAndUniformLoadsAreUniformEnough) {
  Entry e;
  Builder b(e.f);
  Label skip = b.CreateLabel("skip");
  Label skip2 = b.CreateLabel("skip2");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value base = b.LdParam(e.data);
  // A load from a block-uniform address is block-uniform: a barrier under it is fine.
  Value flag = b.Ld(StateSpace::kGlobal, PtxType::kU32, Address{base});
  b.BraIf(b.Setp(CmpOp::kEq, flag, Value::U32(0)), skip);
  b.BarSync();
  b.Bind(skip);
  // shfl.idx from lane 0 is warp-uniform: a full-mask shuffle under it is fine.
  Value mine = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  Value lane0 = b.Shfl(ShflMode::kIdx, mine, Value::U32(0), kFull);
  b.BraIf(b.Setp(CmpOp::kGt, lane0, Value::F32(0.0f)), skip2);
  b.Shfl(ShflMode::kDown, mine, Value::U32(1), kFull);
  b.Bind(skip2);
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  EXPECT_TRUE(findings.empty()) << findings[0].message;
}

TEST(DivergenceAnalysisTest, ThreadIndexedLoadIsDivergent) {
  Entry e;
  Builder b(e.f);
  Label skip = b.CreateLabel("skip");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value base = b.LdParam(e.data);
  Value v =
      b.Ld(StateSpace::kGlobal, PtxType::kU32, Address{b.Add(base, b.MulWide(tid, Value::U32(4)))});
  b.BraIf(b.Setp(CmpOp::kEq, v, Value::U32(0)), skip);
  b.BarSync();
  b.Bind(skip);
  b.Ret();
  e.ExpectValid();
  EXPECT_EQ(Analyze(*e.f).size(), 1u);
}

TEST(DivergenceAnalysisTest, PartialMaskShuffleUnderDivergenceIsNotReported) {
  Entry e;
  Builder b(e.f);
  Label skip = b.CreateLabel("skip");
  Value tid = b.Mov(SpecialReg::kTidX);
  b.BraIf(b.Setp(CmpOp::kGe, b.And(tid, Value::U32(31)), Value::U32(16)), skip);
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  b.Shfl(ShflMode::kDown, x, Value::U32(1), 0x0000ffffu);  // names only the lanes that are here
  b.Bind(skip);
  b.Ret();
  e.ExpectValid();
  EXPECT_TRUE(Analyze(*e.f).empty());
}

// The block reduction a multi-warp kernel needs: each warp's lane 0 writes its partial to shared
// memory, every thread passes bar.sync, warp 0 reads the partials and shuffles them.
TEST(DivergenceAnalysisTest, AcceptsASharedMemoryBlockReduction) {
  Entry e;
  SharedArray partials = e.f->AddShared("partials", 32 * 4, 16);
  Builder b(e.f);
  Label not_lane0 = b.CreateLabel("not_lane0");
  Label done = b.CreateLabel("done");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value lane = b.And(tid, Value::U32(31));
  Value warp = b.Shr(tid, Value::U32(5));
  Value smem = b.AddressOf(partials);
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  Value sum = b.Shfl(ShflMode::kIdx, x, Value::U32(0), kFull);
  b.BraIf(b.Setp(CmpOp::kNe, lane, Value::U32(0)), not_lane0);
  b.St(StateSpace::kShared, Address{b.Add(smem, b.MulWide(warp, Value::U32(4)))}, sum);
  b.Bind(not_lane0);
  b.BarSync();  // every thread: the divergent store above has reconverged
  b.BraIf(b.Setp(CmpOp::kNe, warp, Value::U32(0)), done);
  Value mine = b.Ld(StateSpace::kShared, PtxType::kF32,
                    Address{b.Add(smem, b.MulWide(lane, Value::U32(4)))});
  b.Shfl(ShflMode::kDown, mine, Value::U32(16), kFull);  // warp 0 is whole here
  b.Bind(done);
  b.Ret();
  e.ExpectValid();
  std::vector<DivergenceFinding> findings = Analyze(*e.f);
  EXPECT_TRUE(findings.empty()) << findings[0].message;
}

TEST(DivergenceAnalysisTest, CheckDivergenceReportsFailedPrecondition) {
  Entry e;
  Builder b(e.f);
  Label join = b.CreateLabel("join");
  Value tid = b.Mov(SpecialReg::kTidX);
  b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(16)), join);
  b.BarSync();
  b.Bind(join);
  b.Ret();
  absl::Status s = CheckDivergence(e.m, LaunchAssumptions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "entry k, instruction 3 (bar.sync 0)")) << s;
}

}  // namespace
}  // namespace normgrad::kernels
