// The interpreter's traffic model (LaunchConfig::count_traffic) on hand-written kernels whose
// sector counts are worked out by hand: a coalesced f32 copy (scalar and v4), a strided read, a
// re-read, atomics on a few words, a marked range, and counting off by default.
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/ptxsim/sim/interpreter.h"
#include "tests/ptxsim/sim/memory_map.h"
#include "tests/ptxsim/sim/parser.h"

namespace normgrad::ptxsim {
namespace {

constexpr uint32_t kThreads = 4096;  // 32 blocks of 128
constexpr uint32_t kBlock = 128;

// Kernel `name(in, out)` with i = the thread's global index, %rd3 = &in[i] and %rd4 = &out[i]
// (4-byte elements); `body` follows.
std::string Kernel(absl::string_view body) {
  return absl::StrCat(R"(.version 7.8
.target sm_90
.address_size 64
.visible .entry k(.param .u64 in, .param .u64 out)
{
  .reg .pred %p<4>;
  .reg .b32 %r<10>;
  .reg .f32 %f<10>;
  .reg .b64 %rd<10>;
  ld.param.u64 %rd1, [in];
  ld.param.u64 %rd2, [out];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ctaid.x;
  mov.u32 %r3, %ntid.x;
  mad.lo.u32 %r4, %r2, %r3, %r1;
  mul.wide.u32 %rd5, %r4, 4;
  add.s64 %rd3, %rd1, %rd5;
  add.s64 %rd4, %rd2, %rd5;
)",
                      body, "  ret;\n}\n");
}

// 256-byte-aligned buffers (as cuMemAlloc's), registered for exactly the bytes asked for.
class Buffers {
 public:
  template <typename T>
  T* Alloc(size_t n) {
    storage_.emplace_back(n * sizeof(T) + 256, 0);
    const uint64_t base = reinterpret_cast<uint64_t>(storage_.back().data());
    const uint64_t aligned = (base + 255) / 256 * 256;
    memory_.Add(aligned, n * sizeof(T));
    return reinterpret_cast<T*>(static_cast<uintptr_t>(aligned));
  }
  const MemoryMap& memory() const { return memory_; }

 private:
  MemoryMap memory_;
  std::deque<std::vector<uint8_t>> storage_;
};

uint64_t Address(const void* p) { return reinterpret_cast<uint64_t>(p); }

// Launches `ptx` over `threads` threads with in/out; the launch's traffic.
TrafficReport CountLaunch(const std::string& ptx, const Buffers& buffers, const void* in,
                          const void* out, uint32_t threads = kThreads, bool count = true,
                          std::vector<MemoryRange> marked = {}) {
  absl::StatusOr<Module> module = ParsePtx(ptx);
  EXPECT_TRUE(module.ok()) << module.status();
  if (!module.ok()) return {};
  uint64_t in_address = Address(in), out_address = Address(out);
  void* params[] = {&in_address, &out_address};
  LaunchConfig config;
  config.grid = {threads / kBlock, 1, 1};
  config.block = {kBlock, 1, 1};
  config.count_traffic = count;
  config.traffic_marked = std::move(marked);
  LaunchReport report;
  absl::Status s = Launch(*module->FindEntry("k"), config, params, buffers.memory(), &report);
  EXPECT_TRUE(s.ok()) << s;
  return report.traffic;
}

const std::string& CopyKernel() {
  static const std::string* k =
      new std::string(Kernel("  ld.global.f32 %f1, [%rd3];\n  st.global.f32 [%rd4], %f1;\n"));
  return *k;
}

TEST(PtxTraffic, CoalescedF32CopyMovesEightBytesPerElementAtFullEfficiency) {
  Buffers b;
  float* in = b.Alloc<float>(kThreads);
  float* out = b.Alloc<float>(kThreads);
  for (uint32_t i = 0; i < kThreads; ++i) in[i] = static_cast<float>(i);
  const TrafficReport t = CountLaunch(CopyKernel(), b, in, out);
  EXPECT_EQ(out[kThreads - 1], static_cast<float>(kThreads - 1));
  EXPECT_EQ(t.read_bytes, kThreads * 4);
  EXPECT_EQ(t.written_bytes, kThreads * 4);
  EXPECT_EQ(static_cast<double>(t.read_bytes + t.written_bytes) / kThreads, 8.0);
  EXPECT_EQ(t.accesses, 2 * kThreads / 32);  // one load and one store per warp
  EXPECT_EQ(t.requested_sector_bytes, 2 * kThreads * 4);
  EXPECT_EQ(t.useful_bytes, 2 * kThreads * 4);
  EXPECT_EQ(t.SectorEfficiency(), 1.0);
  EXPECT_EQ(t.marked_read_bytes + t.marked_written_bytes, 0u);
}

TEST(PtxTraffic, VectorCopyCountsSixteenBytesPerLane) {
  // A quarter of the threads, each ld/st.v4.f32 of 16 bytes: the same bytes, a quarter of the
  // accesses; a warp's 512 bytes are 16 sectors.
  Buffers b;
  float* in = b.Alloc<float>(kThreads);
  float* out = b.Alloc<float>(kThreads);
  const std::string ptx = Kernel(R"(  mul.wide.u32 %rd5, %r4, 16;
  add.s64 %rd6, %rd1, %rd5;
  add.s64 %rd7, %rd2, %rd5;
  ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd6];
  st.global.v4.f32 [%rd7], {%f1, %f2, %f3, %f4};
)");
  const TrafficReport t = CountLaunch(ptx, b, in, out, kThreads / 4);
  EXPECT_EQ(t.read_bytes, kThreads * 4);
  EXPECT_EQ(t.written_bytes, kThreads * 4);
  EXPECT_EQ(t.accesses, 2 * kThreads / 4 / 32);
  EXPECT_EQ(t.requested_sector_bytes, 2 * kThreads * 4);
  EXPECT_EQ(t.SectorEfficiency(), 1.0);
}

TEST(PtxTraffic, StridedReadUsesOneSectorPerLane) {
  // Lane i reads in[8 i]: each 4-byte read is alone in its 32-byte sector. Per warp: loads
  // request 32 sectors (1024 bytes) for 128 useful bytes, the store 4 sectors for 128.
  Buffers b;
  float* in = b.Alloc<float>(kThreads * 8);
  float* out = b.Alloc<float>(kThreads);
  const std::string ptx = Kernel(R"(  mul.wide.u32 %rd5, %r4, 32;
  add.s64 %rd6, %rd1, %rd5;
  ld.global.f32 %f1, [%rd6];
  st.global.f32 [%rd4], %f1;
)");
  const TrafficReport t = CountLaunch(ptx, b, in, out);
  const uint64_t warps = kThreads / 32;
  EXPECT_EQ(t.requested_sector_bytes, warps * (1024 + 128));
  EXPECT_EQ(t.useful_bytes, warps * (128 + 128));
  EXPECT_DOUBLE_EQ(t.SectorEfficiency(), 256.0 / 1152.0);  // 0.2222
  EXPECT_EQ(t.read_bytes, kThreads * 32);                  // every sector of `in`, once
  EXPECT_EQ(t.written_bytes, kThreads * 4);
}

TEST(PtxTraffic, ReReadCountsDistinctSectorsOnceAndRequestsTwice) {
  Buffers b;
  float* in = b.Alloc<float>(kThreads);
  float* out = b.Alloc<float>(kThreads);
  const std::string ptx = Kernel(R"(  ld.global.f32 %f1, [%rd3];
  ld.global.f32 %f2, [%rd3];
  add.f32 %f3, %f1, %f2;
  st.global.f32 [%rd4], %f3;
)");
  const TrafficReport t = CountLaunch(ptx, b, in, out);
  EXPECT_EQ(t.read_bytes, kThreads * 4);                                 // distinct: once
  EXPECT_EQ(t.requested_sector_bytes, 2 * kThreads * 4 + kThreads * 4);  // requested: twice
  EXPECT_EQ(t.written_bytes, kThreads * 4);
  EXPECT_EQ(t.SectorEfficiency(), 1.0);
}

TEST(PtxTraffic, AtomicCountsAsReadAndWriteOfItsSector) {
  // Every thread adds 1 to out[i % 8] with atom.global.add.u32: 8 words, one sector. Per warp:
  // one sector read and written (2 x 32 requested bytes), the 32 bytes asked for both times.
  Buffers b;
  uint32_t* in = b.Alloc<uint32_t>(1);
  uint32_t* counters = b.Alloc<uint32_t>(8);
  const std::string ptx = Kernel(R"(  and.b32 %r5, %r4, 7;
  mul.wide.u32 %rd5, %r5, 4;
  add.s64 %rd6, %rd2, %rd5;
  atom.global.add.u32 %r6, [%rd6], 1;
)");
  const TrafficReport t = CountLaunch(ptx, b, in, counters);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(counters[i], kThreads / 8);
  const uint64_t warps = kThreads / 32;
  EXPECT_EQ(t.read_bytes, 32u);
  EXPECT_EQ(t.written_bytes, 32u);
  EXPECT_EQ(t.accesses, 2 * warps);
  EXPECT_EQ(t.requested_sector_bytes, 2 * warps * 32);
  EXPECT_EQ(t.useful_bytes, 2 * warps * 32);  // 32 lanes on 8 words: 32 distinct bytes
}

TEST(PtxTraffic, MarkedRangeIsReportedApart) {
  // The copy with the second half of `out` marked: half the written sectors, none read.
  Buffers b;
  float* in = b.Alloc<float>(kThreads);
  float* out = b.Alloc<float>(kThreads);
  const TrafficReport t = CountLaunch(CopyKernel(), b, in, out, kThreads, true,
                                      {{Address(out + kThreads / 2), kThreads * 2}});
  EXPECT_EQ(t.marked_written_bytes, kThreads * 2);
  EXPECT_EQ(t.marked_read_bytes, 0u);
  EXPECT_EQ(t.written_bytes, kThreads * 4);
}

TEST(PtxTraffic, OffUnlessAsked) {
  Buffers b;
  float* in = b.Alloc<float>(kThreads);
  float* out = b.Alloc<float>(kThreads);
  const TrafficReport t = CountLaunch(CopyKernel(), b, in, out, kThreads, /*count=*/false);
  EXPECT_EQ(t.accesses + t.requested_sector_bytes + t.read_bytes + t.written_bytes, 0u);
}

}  // namespace
}  // namespace normgrad::ptxsim
