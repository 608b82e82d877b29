// Loading nvJitLink: a missing library is one clear FAILED_PRECONDITION. The assembler's report
// (ptxas -v's lines) parsed from logs as ptxas writes them, and from nvJitLink's own info log
// when this machine has the library.
#include "nvidia/nvjitlink.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

TEST(NvJitLinkTest, MissingLibraryIsFailedPreconditionNamingThePath) {
  auto jit = NvJitLink::Load("/nonexistent/libnvJitLink.so");
  ASSERT_FALSE(jit.ok());
  EXPECT_EQ(jit.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(jit.status().message(), HasSubstr("/nonexistent/libnvJitLink.so"));
  EXPECT_THAT(jit.status().message(), HasSubstr("--nvjitlink"));
}

// ptxas -v (CUDA 13.0) on two kernels: one uses shared memory, the other does not (ptxas then
// leaves "smem" out) and spills; nvJitLink's info log has the same lines, then its own summary.
constexpr char kTwoEntries[] =
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'rms_norm_backward_row_resident' for 'sm_90'\n"
    "ptxas info    : Function properties for rms_norm_backward_row_resident\n"
    "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 72 registers, used 1 barriers, 64 bytes smem\n"
    "ptxas info    : Compile time = 581.908 ms\n"
    "ptxas info    : Compiling entry function 'spilling' for 'sm_80'\n"
    "ptxas info    : Function properties for spilling\n"
    "    48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads\n"
    "ptxas info    : Used 255 registers, used 0 barriers, 404 bytes cmem[0]\n"
    // nvJitLink's link summary after ptxas's lines: the driver's reserve is in its smem.
    "info    : 0 bytes gmem\n"
    "info    : Function properties for 'spilling':\n"
    "info    : used 255 registers, used 0 barriers, 48 stack, 1024 bytes smem, 588 bytes "
    "cmem[0], 0 bytes lmem\n";

TEST(AssemblerReportTest, ReadsEachEntrysOwnLines) {
  absl::StatusOr<AssemblerReport> rr =
      ParseAssemblerReport(kTwoEntries, "rms_norm_backward_row_resident");
  ASSERT_TRUE(rr.ok()) << rr.status();
  EXPECT_EQ(rr->registers, 72u);
  EXPECT_EQ(rr->barriers, 1u);
  EXPECT_EQ(rr->shared_memory_bytes, 64u);
  EXPECT_EQ(rr->stack_frame_bytes, 0u);
  EXPECT_EQ(rr->constant_memory_bytes, 0u);

  absl::StatusOr<AssemblerReport> spill = ParseAssemblerReport(kTwoEntries, "spilling");
  ASSERT_TRUE(spill.ok()) << spill.status();
  EXPECT_EQ(spill->registers, 255u);
  EXPECT_EQ(spill->stack_frame_bytes, 48u);
  EXPECT_EQ(spill->spill_store_bytes, 40u);
  EXPECT_EQ(spill->spill_load_bytes, 36u);
  EXPECT_EQ(spill->shared_memory_bytes, 0u);
  EXPECT_EQ(spill->constant_memory_bytes, 404u);
}

TEST(AssemblerReportTest, AMissingEntryOrRegisterLineIsNamed) {
  absl::StatusOr<AssemblerReport> r = ParseAssemblerReport(kTwoEntries, "other");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("'other'"));
  r = ParseAssemblerReport(
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n",
      "k");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("Used N registers"));
}

// nvJitLink's info log with -verbose has the same lines: a kernel with 256 bytes of shared
// memory and a barrier.
TEST(AssemblerReportTest, NvJitLinksInfoLogHasTheReport) {
  auto jit = NvJitLink::Load("");
  if (!jit.ok()) GTEST_SKIP() << "no nvJitLink on this machine";
  constexpr char kPtx[] =
      ".version 7.8\n.target sm_90\n.address_size 64\n"
      ".visible .entry staged(.param .u64 out)\n{\n"
      "  .reg .b32 %r<3>;\n  .reg .b64 %rd<3>;\n"
      "  .shared .align 4 .b8 buf[256];\n"
      "  mov.u32 %r1, %tid.x;\n  shl.b32 %r2, %r1, 2;\n"
      "  st.shared.u32 [buf], %r1;\n  bar.sync 0;\n"
      "  ld.shared.u32 %r1, [buf+4];\n"
      "  ld.param.u64 %rd1, [out];\n  cvta.to.global.u64 %rd2, %rd1;\n"
      "  st.global.u32 [%rd2], %r1;\n  ret;\n}\n";
  absl::StatusOr<NvJitLink::Assembled> a = (*jit)->Assemble(kPtx, 90);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->cubin.substr(0, 4), "\x7f" "ELF");
  absl::StatusOr<AssemblerReport> r = ParseAssemblerReport(a->info_log, "staged");
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << a->info_log;
  EXPECT_GT(r->registers, 0u);
  EXPECT_EQ(r->shared_memory_bytes, 256u);
  EXPECT_EQ(r->barriers, 1u);
  EXPECT_EQ(r->spill_store_bytes, 0u);
}

}  // namespace
}  // namespace normgrad::server
