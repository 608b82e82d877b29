// The process's gRPC-free parts: its memory figures and the --preload entries.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/process/normgrad_server.h"
#include "server/process/process_memory.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

TEST(ProcessMemoryTest, HeapInUseFollowsAnAllocationAndItsRelease) {
  const ProcessMemory before = ReadProcessMemory();
  EXPECT_GT(before.resident_bytes, 0u);
  if (before.heap_in_use_bytes == 0) GTEST_SKIP() << "malloc is replaced (sanitizer build)";
  constexpr size_t kBytes = 64 << 20;
  std::vector<char> block(kBytes, 1);  // touched: resident too
  const ProcessMemory held = ReadProcessMemory();
  EXPECT_GE(held.heap_in_use_bytes, before.heap_in_use_bytes + kBytes);
  EXPECT_GE(held.resident_bytes, before.resident_bytes + kBytes / 2);
  block = {};
  block.shrink_to_fit();
  const ProcessMemory after = ReadProcessMemory();
  EXPECT_LT(after.heap_in_use_bytes, held.heap_in_use_bytes - kBytes / 2);
}

TEST(PreloadEntryTest, ParsesKernelTargetAndHiddenDim) {
  auto e = ParsePreloadEntry("batched_rms_norm_backward:sm_90:896");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->config.target_sm, 90);
  EXPECT_EQ(e->config.hidden_dim, 896u);
  EXPECT_THAT(ParsePreloadEntry("nope:sm_90").status().message(), HasSubstr("unknown kernel"));
  EXPECT_THAT(ParsePreloadEntry("batched_rms_norm_backward").status().message(),
              HasSubstr("KERNEL:TARGET[:HIDDEN_DIM]"));
  EXPECT_FALSE(ParsePreloadEntry("rms_norm_backward:sm_90:64").ok());  // warp kernel: <= 32
}

}  // namespace
}  // namespace normgrad::server
