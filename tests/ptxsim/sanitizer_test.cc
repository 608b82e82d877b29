// Deliberately broken kernels: each is reported with the right finding, and the diagnosis names
// the kernel, block, thread, line and (for memory) the address.
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/ptxsim/sim/sim_harness.h"

namespace normgrad::ptxsim {
namespace {

using ::testing::HasSubstr;

constexpr char kHeader[] = ".version 7.8\n.target sm_90\n.address_size 64\n";

// One u64 parameter `out`; `body` follows the declarations.
std::string Kernel(absl::string_view body) {
  return absl::StrCat(kHeader, R"(.visible .entry broken(.param .u64 out)
{
  .reg .pred %p<4>;
  .reg .b32 %r<10>;
  .reg .f32 %f<10>;
  .reg .b64 %rd<10>;
  ld.param.u64 %rd1, [out];
  mov.u32 %r1, %tid.x;
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
)",
                      body, "}\n");
}

// Lanes with %r1 below `split` branch around a shfl.sync.bfly of %f1 (set by `set_f1`) with
// member `mask`; all store %f2 (the shuffled or their own %f1) to out[tid]. The shuffle is on
// line 17, SMALL's mov on line 20.
std::string ShuffleOnOneSideOfABranch(absl::string_view set_f1, int split, absl::string_view mask) {
  return Kernel(absl::StrCat("  ", set_f1, "\n  setp.lt.u32 %p1, %r1, ", split, R"(;
  @%p1 bra SMALL;
  shfl.sync.bfly.b32 %f2, %f1, 1, 31, )",
                             mask, R"(;
  bra.uni JOIN;
SMALL:
  mov.f32 %f2, %f1;
JOIN:
  st.global.f32 [%rd3], %f2;
  ret;
)"));
}

struct Outcome {
  absl::Status status;
  LaunchReport report;
};

Outcome RunBroken(const std::string& ptx, uint32_t threads, size_t out_floats,
                  float** out = nullptr, uint64_t limit = uint64_t{1} << 32) {
  static SimHarness* sim = new SimHarness();
  float* buffer = sim->Alloc<float>(out_floats);
  if (out != nullptr) *out = buffer;
  KernelArgs args;
  args.Add(SimHarness::Address(buffer));
  Outcome o;
  o.status = sim->Run(ptx, "broken", {2, 1, 1}, {threads, 1, 1}, args, &o.report, 0, limit);
  return o;
}

TEST(PtxSanitizer, OutOfBoundsStoreNamesKernelBlockThreadAndAddress) {
  // 33 threads store out[tid] into a 32-float buffer: thread 32 of block 0 is out of bounds.
  float* out = nullptr;
  Outcome o = RunBroken(Kernel("  st.global.f32 [%rd3], 0f3F800000;\n  ret;\n"), 33, 32, &out);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.report.finding, Finding::kOutOfBounds);
  const uint64_t bad = SimHarness::Address(out) + 32 * 4;
  EXPECT_THAT(std::string(o.status.message()),
              HasSubstr("out-of-bounds access: global store of 4 bytes"));
  EXPECT_THAT(std::string(o.status.message()), HasSubstr(absl::StrFormat("address 0x%x", bad)));
  EXPECT_THAT(std::string(o.status.message()),
              HasSubstr("0 bytes past the end of the 128-byte allocation"));
  EXPECT_THAT(std::string(o.status.message()),
              HasSubstr("kernel 'broken', line 14, block (0,0,0), thread (32,0,0)"));
}

// A broken kernel that fails with `finding` and a diagnosis containing each of `diagnosis`.
struct BrokenKernel {
  const char* name;  // what the case proves
  std::string ptx;   // from Kernel(); the body's first line is line 14
  uint32_t threads;  // per block, two blocks
  size_t out_floats;
  Finding finding;
  std::vector<const char*> diagnosis;
};

std::vector<BrokenKernel> BrokenKernels() {
  return {
      {"MisalignedLoadIsReported",
       Kernel("  ld.global.f32 %f1, [%rd3+2];\n  st.global.f32 [%rd3], %f1;\n  ret;\n"),
       32,
       64,
       Finding::kMisaligned,
       {"is not 4-byte aligned", "thread (0,0,0)"}},
      // Lanes 16..31 branched to the exit; whether they already left or are about to, the
      // full-mask shuffle names them.
      {"ShuffleAfterDivergentExitNamesTheExitedLane",
       Kernel(R"(  setp.ge.u32 %p1, %r1, 16;
  @%p1 bra EXIT;
  mov.f32 %f1, 0f3F800000;
  shfl.sync.down.b32 %f2, %f1, 16, 31, 0xffffffff;
  st.global.f32 [%rd3], %f2;
EXIT:
  ret;
)"),
       32,
       64,
       Finding::kShuffleMask,
       {"member mask 0xffffffff names lane 16, which has diverged to an exit "
        "(the ret/exit on line 20)",
        "line 17"}},
      {"ShuffleInsideDivergentBranchNamesTheDivergedLane",
       ShuffleOnOneSideOfABranch("mov.f32 %f1, 0f3F800000;", 8, "0xffffffff"),
       32,
       64,
       Finding::kShuffleMask,
       {"names lane 0, which has diverged (it is at line 20)"}},
      {"BarrierInDivergentBranchIsReported",
       Kernel(R"(  setp.lt.u32 %p1, %r1, 40;
  @%p1 bra SKIP;
  bar.sync 0;
SKIP:
  bar.sync 0;
  st.global.f32 [%rd3], 0f00000000;
  ret;
)"),
       64,
       128,
       Finding::kBarrier,
       {"divergent barrier", "bar.sync on line 16", "bar.sync on line 18"}},
      {"BarrierSkippedByExitingThreadsIsReported",
       Kernel(R"(  setp.ge.u32 %p1, %r1, 48;
  @%p1 bra EXIT;
  bar.sync 0;
  st.global.f32 [%rd3], 0f00000000;
EXIT:
  ret;
)"),
       64,
       128,
       Finding::kBarrier,
       {"barrier not reached by all threads of the block", "thread (48,0,0)"}},
      {"UninitializedRegisterReadNamesTheRegister",
       Kernel(R"(  mov.f32 %f1, 0f3F800000;
  add.f32 %f3, %f1, %f2;
  st.global.f32 [%rd3], %f3;
  ret;
)"),
       32,
       64,
       Finding::kUninitializedRegister,
       {"register %f2 is read before any instruction wrote it", "line 15"}},
      {"RegisterWrittenOnlyUnderAPredicateIsUninitializedElsewhere",
       Kernel(R"(  setp.lt.u32 %p1, %r1, 5;
  @%p1 mov.f32 %f1, 0f3F800000;
  st.global.f32 [%rd3], %f1;
  ret;
)"),
       32,
       64,
       Finding::kUninitializedRegister,
       {"thread (5,0,0)"}},
      {"NonUniformBraUniIsReported",
       Kernel(R"(  setp.lt.u32 %p1, %r1, 3;
  @%p1 bra.uni DONE;
  st.global.f32 [%rd3], 0f00000000;
DONE:
  ret;
)"),
       32,
       64,
       Finding::kNonUniformBranch,
       {}},
  };
}

void PrintTo(const BrokenKernel& k, std::ostream* os) { *os << k.name; }

class PtxSanitizerFinding : public ::testing::TestWithParam<BrokenKernel> {};

TEST_P(PtxSanitizerFinding, IsReportedWithItsDiagnosis) {
  const BrokenKernel& k = GetParam();
  Outcome o = RunBroken(k.ptx, k.threads, k.out_floats);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.report.finding, k.finding);
  for (const char* part : k.diagnosis) {
    EXPECT_THAT(std::string(o.status.message()), HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(PtxSanitizer, PtxSanitizerFinding, ::testing::ValuesIn(BrokenKernels()),
                         [](const ::testing::TestParamInfo<BrokenKernel>& info) {
                           return std::string(info.param.name);
                         });

TEST(PtxSanitizer, PartialMaskShuffleOfConvergedLanesIsFine) {
  // The same divergent shuffle with a member mask naming exactly the lanes present is legal.
  float* out = nullptr;
  Outcome o = RunBroken(ShuffleOnOneSideOfABranch("cvt.rn.f32.u32 %f1, %r1;", 16, "0xffff0000"), 32,
                        64, &out);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(out[3], 3.0f);
  EXPECT_EQ(out[16], 17.0f);
  EXPECT_EQ(out[17], 16.0f);
}

TEST(PtxSanitizer, EndlessLoopHitsTheInstructionLimit) {
  Outcome o = RunBroken(Kernel("LOOP:\n  bra LOOP;\n"), 32, 64, nullptr, 1000);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(o.report.finding, Finding::kInstructionLimit);
}

TEST(PtxSanitizer, BadLaunchGeometryIsInvalidArgument) {
  Outcome o = RunBroken(Kernel("  ret;\n"), 2048, 64);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.report.finding, Finding::kInvalidLaunch);
}

}  // namespace
}  // namespace normgrad::ptxsim
