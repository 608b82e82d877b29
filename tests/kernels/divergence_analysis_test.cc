// The CFG-based barrier/shuffle analysis: trueno-gpu's barrier-safety tests, ported, plus the cases
// trueno-gpu's text heuristic (a literal `bra exit` inside a loop) misses or gets wrong.
#include "kernels/ptx/divergence_analysis.h"

#include <initializer_list>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/ptx/ptx_builder.h"
#include "kernels/ptx/ptx_printer.h"
#include "kernels/rmsnorm/rms_norm_backward.h"
#include "kernels/ptx/verifier.h"
#include "tests/kernels/single_entry_module.h"

namespace normgrad::kernels {
namespace {

constexpr uint32_t kFull = 0xffffffffu;

std::vector<DivergenceFinding> Analyze(const Function& f, LaunchAssumptions a = {}) {
  absl::StatusOr<std::vector<DivergenceFinding>> r = AnalyzeDivergence(f, a);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<DivergenceFinding>{};
}

// The findings in the entry of kernel `entry` built for `hidden_dim`.
std::vector<DivergenceFinding> AnalyzeKernel(absl::string_view entry, uint32_t hidden_dim,
                                             LaunchAssumptions a = {}) {
  const auto* k = dynamic_cast<const BuiltKernel*>(FindKernel(entry));
  if (k == nullptr) {
    ADD_FAILURE() << entry << " is not a built kernel";
    return {};
  }
  absl::StatusOr<Module> m = k->Build({.hidden_dim = hidden_dim});
  if (!m.ok()) {
    ADD_FAILURE() << entry << " hidden_dim " << hidden_dim << ": " << m.status();
    return {};
  }
  return Analyze(m->functions()[0], a);
}

// The shared single entry; tests add the body.
struct Entry : SingleEntryModule {
  // Ends the body with `ret`, expects Verify to accept the entry and returns its findings.
  std::vector<DivergenceFinding> RetAndAnalyze() {
    b.Ret();
    EXPECT_TRUE(Verify(m).ok()) << Verify(m) << "\n" << EmitPtx(m);
    return Analyze(f);
  }
};

// `@skip_if bra skip; bar.sync 0; skip:`: a barrier that only the threads where `skip_if` is false
// reach.
void BarrierUnless(Builder& b, Value skip_if) {
  const Label skip = b.CreateLabel("skip");
  b.BraIf(skip_if, skip);
  b.BarSync();
  b.Bind(skip);
}

// ---- trueno-gpu's tests, ported --------------------------------------------------------------

TEST(DivergenceAnalysisTest, RmsNormBackwardIsBarrierAndShuffleSafe) {
  for (uint32_t hidden : {1u, 16u, 32u}) {
    std::vector<DivergenceFinding> findings = AnalyzeKernel("rms_norm_backward", hidden);
    EXPECT_TRUE(findings.empty()) << findings[0].message;
  }
}

TEST(DivergenceAnalysisTest, BatchedRmsNormBackwardIsBarrierAndShuffleSafe) {
  for (uint32_t hidden : {1u, 128u, 896u}) {
    std::vector<DivergenceFinding> findings = AnalyzeKernel("batched_rms_norm_backward", hidden);
    EXPECT_TRUE(findings.empty()) << findings[0].message;
  }
}

// ---- What makes the small kernel safe is the launch geometry ---------------------------------

TEST(DivergenceAnalysisTest, SmallKernelShufflesNeedWholeWarps) {
  std::vector<DivergenceFinding> findings =
      AnalyzeKernel("rms_norm_backward", 32, LaunchAssumptions{.block_x_multiple_of_32 = false});
  ASSERT_EQ(findings.size(), 6u);  // 5 shfl.down + 1 shfl.idx
  for (const DivergenceFinding& f : findings) {
    EXPECT_EQ(f.hazard, DivergenceHazard::kShuffleUnderDivergence);
    EXPECT_TRUE(absl::StrContains(f.message, "not whole warps")) << f.message;
  }
}

TEST(DivergenceAnalysisTest, SmallKernelRowTestIsWarpUniformOnlyForOneDimensionalBlocks) {
  // With 2-D blocks tid.x no longer tells the warp: the row exit becomes lane-dependent.
  std::vector<DivergenceFinding> findings =
      AnalyzeKernel("rms_norm_backward", 32, LaunchAssumptions{.one_dimensional_block = false});
  ASSERT_FALSE(findings.empty());
  EXPECT_TRUE(findings[0].after_exit) << findings[0].message;
}

TEST(DivergenceAnalysisTest, GeometryKeepsTheAssumptionsTheAnalysisUses) {
  for (const BackwardKernel* k : AllKernels()) {
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

// trueno-gpu's own small-kernel structure (global thread id, lane = gtid & 31, warp = gtid >> 5,
// `@!valid_row bra exit`, shuffles, `@!valid_lane bra exit`, store) is proven safe too: ctaid*ntid
// is a multiple of 32 when blocks are whole warps, so gtid >> 5 is warp-uniform.
TEST(DivergenceAnalysisTest, TruenoStyleGlobalWarpIndexIsWarpUniform) {
  Entry e;
  Builder& b = e.b;
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
  EXPECT_TRUE(e.RetAndAnalyze().empty());
}

// ---- Cases trueno-gpu's heuristic misses ------------------------------------------------------

TEST(DivergenceAnalysisTest, FindsBarrierInsideThreadDependentBranch) {
  Entry e;
  Value tid = e.b.Mov(SpecialReg::kTidX);
  BarrierUnless(e.b, e.b.Setp(CmpOp::kGe, tid, Value::U32(16)));  // only threads 0..15 wait
  e.b.St(StateSpace::kGlobal, Address{e.b.LdParam(e.data)}, tid);  // everyone continues here
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kBarrierUnderDivergence);
  EXPECT_FALSE(findings[0].after_exit);
  EXPECT_EQ(findings[0].instruction, 3u);
  EXPECT_TRUE(absl::StrContains(findings[0].message, "bar.sync 0")) << findings[0].message;
}

TEST(DivergenceAnalysisTest, FindsBarrierAfterExitThroughALabelNotNamedExit) {
  Entry e;
  Builder& b = e.b;
  Label early_out = b.CreateLabel("early_out");
  Value tid = b.Mov(SpecialReg::kTidX);
  b.BraIf(b.Setp(CmpOp::kGe, tid, b.LdParam(e.n)), early_out);
  Label rest = b.CreateLabel("rest");
  b.Bra(rest);
  b.Bind(early_out);
  b.Ret();  // threads with tid >= n are gone
  b.Bind(rest);
  b.BarSync();
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_TRUE(findings[0].after_exit);
  EXPECT_TRUE(absl::StrContains(findings[0].message, "exit")) << findings[0].message;
}

TEST(DivergenceAnalysisTest, FindsFullMaskShuffleAfterALaneDependentExit) {
  Entry e;
  Builder& b = e.b;
  Value tid = b.Mov(SpecialReg::kTidX);
  Value p = b.Setp(CmpOp::kGe, tid, b.LdParam(e.n));
  {
    auto g = b.If(p);
    b.Ret();  // @p ret: lanes leave one by one
  }
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  b.Shfl(ShflMode::kDown, x, Value::U32(1), kFull);
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kShuffleUnderDivergence);
  EXPECT_TRUE(findings[0].after_exit);
}

// A loop `for (i = start; i < n; i += step) bar.sync;`.
void BarrierLoop(Entry& e, Value start, uint32_t step) {
  Builder& b = e.b;
  Label loop = b.CreateLabel("loop");
  Label done = b.CreateLabel("done");
  Value i = b.Mov(start);
  Value n = b.LdParam(e.n);
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, n), done);
  b.BarSync();
  b.AddTo(i, Value::U32(step));
  b.Bra(loop);
  b.Bind(done);
}

TEST(DivergenceAnalysisTest, FindsBarrierInALoopWithThreadDependentTripCount) {
  Entry e;
  BarrierLoop(e, Value::Special(SpecialReg::kTidX), 32);
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kBarrierUnderDivergence);
}

TEST(DivergenceAnalysisTest, AcceptsBarrierInALoopWithUniformTripCount) {
  Entry e;
  BarrierLoop(e, Value::U32(0), 1);
  e.b.BarSync();
  EXPECT_TRUE(e.RetAndAnalyze().empty());
}

TEST(DivergenceAnalysisTest, AcceptsBarrierAfterADivergentBranchReconverges) {
  Entry e;
  Builder& b = e.b;
  Label join = b.CreateLabel("join");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value base = b.LdParam(e.data);
  b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(16)), join);
  b.St(StateSpace::kGlobal, Address{base}, tid);
  b.Bind(join);
  b.BarSync();  // every thread arrives here
  EXPECT_TRUE(e.RetAndAnalyze().empty());
}

TEST(DivergenceAnalysisTest, FindsBarrierUnderADivergentGuard) {
  Entry e;
  Value p = e.b.Setp(CmpOp::kLt, e.b.Mov(SpecialReg::kTidX), Value::U32(8));
  {
    auto g = e.b.If(p);
    e.b.BarSync();
  }
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_TRUE(absl::StrContains(findings[0].message, "guard")) << findings[0].message;
}

TEST(DivergenceAnalysisTest, WarpUniformBranchAllowsShufflesButNotBarriers) {
  Entry e;
  Builder& b = e.b;
  Label skip = b.CreateLabel("skip");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value warp = b.Shr(tid, Value::U32(5));
  b.BraIf(b.Setp(CmpOp::kEq, warp, Value::U32(0)), skip);  // warp 0 skips, the others do not
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  b.Shfl(ShflMode::kBfly, x, Value::U32(1), kFull);  // whole warps: fine
  b.BarSync();                                       // warp 0 never arrives: not fine
  b.Bind(skip);
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].hazard, DivergenceHazard::kBarrierUnderDivergence);
}

TEST(DivergenceAnalysisTest, BlockUniformBranchAllowsBarriers) {
  Entry e;
  Value block = e.b.Mov(SpecialReg::kCtaidX);
  BarrierUnless(e.b, e.b.Setp(CmpOp::kGe, block, e.b.LdParam(e.n)));
  EXPECT_TRUE(e.RetAndAnalyze().empty());
}

TEST(DivergenceAnalysisTest, ValueJoinedAfterDivergenceIsDivergent) {
  // x = 0; if (tid < 16) x = 1; (join) if (x == 1) bar.sync  -- x differs per thread.
  Entry e;
  Builder& b = e.b;
  Label join = b.CreateLabel("join");
  Value tid = b.Mov(SpecialReg::kTidX);
  Value x = b.Mov(Value::U32(0));
  b.BraIf(b.Setp(CmpOp::kGe, tid, Value::U32(16)), join);
  b.Assign(x, Value::U32(1));
  b.Bind(join);
  BarrierUnless(b, b.Setp(CmpOp::kNe, x, Value::U32(1)));
  EXPECT_EQ(e.RetAndAnalyze().size(), 1u);
}

TEST(DivergenceAnalysisTest, BroadcastAndUniformLoadsAreUniformEnough) {
  Entry e;
  Builder& b = e.b;
  Value tid = b.Mov(SpecialReg::kTidX);
  Value base = b.LdParam(e.data);
  // A load from a block-uniform address is block-uniform: a barrier under it is fine.
  Value flag = b.Ld(StateSpace::kGlobal, PtxType::kU32, Address{base});
  BarrierUnless(b, b.Setp(CmpOp::kEq, flag, Value::U32(0)));
  // shfl.idx from lane 0 is warp-uniform: a full-mask shuffle under it is fine.
  Label skip = b.CreateLabel("skip2");
  Value mine = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  Value lane0 = b.Shfl(ShflMode::kIdx, mine, Value::U32(0), kFull);
  b.BraIf(b.Setp(CmpOp::kGt, lane0, Value::F32(0.0f)), skip);
  b.Shfl(ShflMode::kDown, mine, Value::U32(1), kFull);
  b.Bind(skip);
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  EXPECT_TRUE(findings.empty()) << findings[0].message;
}

TEST(DivergenceAnalysisTest, ThreadIndexedLoadIsDivergent) {
  Entry e;
  Builder& b = e.b;
  Value tid = b.Mov(SpecialReg::kTidX);
  Value base = b.LdParam(e.data);
  Value v =
      b.Ld(StateSpace::kGlobal, PtxType::kU32, Address{b.Add(base, b.MulWide(tid, Value::U32(4)))});
  BarrierUnless(b, b.Setp(CmpOp::kEq, v, Value::U32(0)));
  EXPECT_EQ(e.RetAndAnalyze().size(), 1u);
}

TEST(DivergenceAnalysisTest, PartialMaskShuffleUnderDivergenceIsNotReported) {
  Entry e;
  Builder& b = e.b;
  Label skip = b.CreateLabel("skip");
  Value tid = b.Mov(SpecialReg::kTidX);
  b.BraIf(b.Setp(CmpOp::kGe, b.And(tid, Value::U32(31)), Value::U32(16)), skip);
  Value x = b.Cvt(PtxType::kF32, tid, Rounding::kRn);
  b.Shfl(ShflMode::kDown, x, Value::U32(1), 0x0000ffffu);  // names only the lanes that are here
  b.Bind(skip);
  EXPECT_TRUE(e.RetAndAnalyze().empty());
}

// The block reduction a multi-warp kernel needs: each warp's lane 0 writes its partial to shared
// memory, every thread passes bar.sync, warp 0 reads the partials and shuffles them.
TEST(DivergenceAnalysisTest, AcceptsASharedMemoryBlockReduction) {
  Entry e;
  Builder& b = e.b;
  SharedArray partials = e.f.AddShared("partials", 32 * 4, 16);
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
  std::vector<DivergenceFinding> findings = e.RetAndAnalyze();
  EXPECT_TRUE(findings.empty()) << findings[0].message;
}

TEST(DivergenceAnalysisTest, CheckDivergenceReportsFailedPrecondition) {
  Entry e;
  Value tid = e.b.Mov(SpecialReg::kTidX);
  BarrierUnless(e.b, e.b.Setp(CmpOp::kGe, tid, Value::U32(16)));
  e.b.Ret();
  absl::Status s = CheckDivergence(e.m, LaunchAssumptions{});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "entry k, instruction 3 (bar.sync 0)")) << s;
}

}  // namespace
}  // namespace normgrad::kernels
