// Hand-written kernels, one per SIMT feature, executed by the interpreter and checked against
// values computed independently in C++.
#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/ptxsim/sim/sim_harness.h"

namespace normgrad::ptxsim {
namespace {

constexpr char kHeader[] = ".version 7.8\n.target sm_90\n.address_size 64\n";

// A module of one entry, `signature` (its name and parameter list), whose `body` may use the
// registers every kernel here has: %p<8>, %r<16>, %f<16>, %fd<4>, %rd<16>.
std::string Module(absl::string_view signature, absl::string_view body) {
  return absl::StrCat(kHeader, ".visible .entry ", signature, R"(
{
  .reg .pred %p<8>;
  .reg .b32 %r<16>;
  .reg .f32 %f<16>;
  .reg .f64 %fd<4>;
  .reg .b64 %rd<16>;
)",
                      body, "}\n");
}

// Stores `values` (32-bit registers) as `type` to [base], [base+stride], [base+2*stride], ...
std::string StoreEach(absl::string_view type, absl::string_view base, int stride,
                      std::initializer_list<absl::string_view> values) {
  std::string out;
  int offset = 0;
  for (absl::string_view v : values) {
    absl::StrAppend(&out, "  st.global.", type, " [", base, "+", offset, "], ", v, ";\n");
    offset += stride;
  }
  return out;
}

// A kernel `name`(a, b, c, out) in which thread %r1 reads a, b, c at its index into %f1, %f2,
// %f3, runs `body`, and stores the 32-bit `results` to out[%r1 * results.size() + k].
std::string PerLaneKernel(absl::string_view name, absl::string_view body,
                          std::initializer_list<absl::string_view> results) {
  return Module(
      absl::StrCat(name, "(.param .u64 a, .param .u64 b, .param .u64 c, .param .u64 out)"),
      absl::StrCat(R"(  ld.param.u64 %rd1, [a];
  ld.param.u64 %rd2, [b];
  ld.param.u64 %rd3, [c];
  ld.param.u64 %rd4, [out];
  mov.u32 %r1, %tid.x;
  mul.wide.u32 %rd5, %r1, 4;
  add.s64 %rd6, %rd1, %rd5;
  ld.global.f32 %f1, [%rd6];
  add.s64 %rd6, %rd2, %rd5;
  ld.global.f32 %f2, [%rd6];
  add.s64 %rd6, %rd3, %rd5;
  ld.global.f32 %f3, [%rd6];
)",
                   body, "  mul.wide.u32 %rd7, %r1, ", 4 * results.size(), R"(;
  add.s64 %rd8, %rd4, %rd7;
)",
                   StoreEach("b32", "%rd8", 4, results), "  ret;\n"));
}

// Device buffers as the kernel's u64 parameters, in order.
KernelArgs BufferArgs(std::initializer_list<const void*> buffers) {
  KernelArgs args;
  for (const void* b : buffers) args.Add(reinterpret_cast<uint64_t>(b));
  return args;
}

// The buffers of a PerLaneKernel on n threads: a, b, c of n floats, out of n * results.
struct PerLaneBuffers {
  float* a;
  float* b;
  float* c;
  float* out;
};
PerLaneBuffers AllocPerLane(SimHarness& sim, int n, int results) {
  return {sim.Alloc<float>(n), sim.Alloc<float>(n), sim.Alloc<float>(n),
          sim.Alloc<float>(n * results)};
}

// Uniform in [0, 1): a 32-bit linear congruential sequence, the same everywhere.
class UnitRandom {
 public:
  explicit UnitRandom(uint32_t seed) : state_(seed) {}
  float Next() {
    state_ = state_ * 1664525u + 1013904223u;
    return static_cast<float>(state_ >> 8) / static_cast<float>(1u << 24);
  }

 private:
  uint32_t state_;
};

TEST(PtxSimt, ThreadIndexingPartialWarpsAndPredicatedStores) {
  const std::string ptx = Module("index_kernel(.param .u64 out, .param .u32 n)", R"(
  ld.param.u64 %rd1, [out];
  ld.param.u32 %r1, [n];
  mov.u32 %r2, %tid.x;
  mov.u32 %r3, %ctaid.x;
  mov.u32 %r4, %ntid.x;
  mad.lo.u32 %r5, %r3, %r4, %r2;
  setp.lt.u32 %p1, %r5, %r1;
  mul.wide.u32 %rd2, %r5, 4;
  add.s64 %rd3, %rd1, %rd2;
  mul.lo.u32 %r6, %r5, 3;
  @%p1 st.global.u32 [%rd3], %r6;
  ret;
)");
  SimHarness sim;
  uint32_t* out = sim.Alloc<uint32_t>(100);  // 120 threads run; the predicate guards the tail
  KernelArgs args = BufferArgs({out});
  args.Add(uint32_t{100});
  LaunchReport report;
  ASSERT_TRUE(sim.Run(ptx, "index_kernel", {3, 1, 1}, {40, 1, 1}, args, &report).ok());
  for (uint32_t i = 0; i < 100; ++i) EXPECT_EQ(out[i], 3 * i) << i;
  // 3 blocks x 2 warps x 12 instructions; the 20 threads past n skip the store.
  EXPECT_EQ(report.warp_instructions, 3u * 2u * 12u);
  EXPECT_EQ(report.thread_instructions, 120u * 12u - 20u);
}

TEST(PtxSimt, DivergentBranchesAndLoopsReconvergeBeforeFullMaskShuffle) {
  const std::string ptx = Module("diverge(.param .u64 out)", R"(
  ld.param.u64 %rd1, [out];
  mov.u32 %r1, %tid.x;
  and.b32 %r2, %r1, 1;
  setp.eq.u32 %p1, %r2, 0;
  @%p1 bra EVEN;
  mul.lo.u32 %r3, %r1, 100;
  bra.uni JOIN;
EVEN:
  add.u32 %r3, %r1, 7;
JOIN:
  mov.u32 %r4, 0;
  rem.u32 %r5, %r1, 5;
  mov.u32 %r6, 0;
LOOP:
  setp.ge.u32 %p2, %r6, %r5;
  @%p2 bra LOOP_END;
  add.u32 %r4, %r4, %r6;
  add.u32 %r6, %r6, 1;
  bra LOOP;
LOOP_END:
  add.u32 %r7, %r3, %r4;
  shfl.sync.bfly.b32 %r8, %r7, 1, 31, 0xffffffff;
  add.u32 %r9, %r7, %r8;
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  st.global.u32 [%rd3], %r9;
  ret;
)");
  SimHarness sim;
  uint32_t* out = sim.Alloc<uint32_t>(64);
  ASSERT_TRUE(sim.Run(ptx, "diverge", {1, 1, 1}, {64, 1, 1}, BufferArgs({out})).ok());
  auto v = [](uint32_t t) {
    uint32_t base = (t & 1) ? 100 * t : t + 7;
    for (uint32_t i = 0; i < t % 5; ++i) base += i;
    return base;
  };
  for (uint32_t t = 0; t < 64; ++t) EXPECT_EQ(out[t], v(t) + v(t ^ 1)) << t;
}

TEST(PtxSimt, ShuffleModesFollowThePtxLaneRules) {
  const std::string ptx =
      Module("shfl_modes(.param .u64 out)",
             absl::StrCat(
                 R"(
  ld.param.u64 %rd1, [out];
  mov.u32 %r1, %tid.x;
  mad.lo.u32 %r2, %r1, 10, 1;
  shfl.sync.down.b32 %r3|%p1, %r2, 3, 31, 0xffffffff;
  shfl.sync.up.b32 %r4|%p2, %r2, 2, 0, 0xffffffff;
  shfl.sync.bfly.b32 %r5, %r2, 5, 31, 0xffffffff;
  shfl.sync.idx.b32 %r6, %r2, 3, 0x101f, 0xffffffff;
  sub.u32 %r8, 31, %r1;
  shfl.sync.idx.b32 %r7, %r2, %r8, 31, -1;
  selp.u32 %r9, 1, 0, %p1;
  selp.u32 %r10, 1, 0, %p2;
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
)",
                 StoreEach("u32", "%rd3", 128, {"%r3", "%r9", "%r4", "%r10", "%r5", "%r6", "%r7"}),
                 "  ret;\n"));
  SimHarness sim;
  uint32_t* out = sim.Alloc<uint32_t>(7 * 32);
  absl::Status s = sim.Run(ptx, "shfl_modes", {1, 1, 1}, {32, 1, 1}, BufferArgs({out}));
  ASSERT_TRUE(s.ok()) << s;
  auto val = [](uint32_t t) { return t * 10 + 1; };
  for (uint32_t t = 0; t < 32; ++t) {
    EXPECT_EQ(out[t], t + 3 <= 31 ? val(t + 3) : val(t))
        << "down " << t;  // out of range: own value
    EXPECT_EQ(out[32 + t], t + 3 <= 31 ? 1u : 0u) << "down pred " << t;
    EXPECT_EQ(out[64 + t], t >= 2 ? val(t - 2) : val(t)) << "up " << t;
    EXPECT_EQ(out[96 + t], t >= 2 ? 1u : 0u) << "up pred " << t;
    EXPECT_EQ(out[128 + t], val(t ^ 5)) << "bfly " << t;
    EXPECT_EQ(out[160 + t], val((t & 16) + 3)) << "idx width 16 " << t;
    EXPECT_EQ(out[192 + t], val(31 - t)) << "idx by register " << t;
  }
}

TEST(PtxSimt, BarrierOrdersSharedMemoryAcrossWarps) {
  const std::string ptx = Module("reverse(.param .u64 in, .param .u64 out)", R"(
  .shared .align 4 .b8 buf[256];
  .extern .shared .align 16 .b8 dyn[];
  ld.param.u64 %rd1, [in];
  ld.param.u64 %rd2, [out];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ctaid.x;
  mad.lo.u32 %r3, %r2, 64, %r1;
  mul.wide.u32 %rd3, %r3, 4;
  add.s64 %rd4, %rd1, %rd3;
  ld.global.f32 %f1, [%rd4];
  mov.u64 %rd5, buf;
  mul.wide.u32 %rd6, %r1, 4;
  add.s64 %rd7, %rd5, %rd6;
  st.shared.f32 [%rd7], %f1;
  mov.u64 %rd10, dyn;
  add.s64 %rd11, %rd10, %rd6;
  add.f32 %f2, %f1, %f1;
  st.shared.f32 [%rd11], %f2;
  bar.sync 0;
  sub.u32 %r4, 63, %r1;
  mul.wide.u32 %rd8, %r4, 4;
  add.s64 %rd9, %rd5, %rd8;
  ld.shared.f32 %f1, [%rd9];
  add.s64 %rd9, %rd10, %rd8;
  ld.shared.f32 %f2, [%rd9];
  add.f32 %f1, %f1, %f2;
  add.s64 %rd4, %rd2, %rd3;
  st.global.f32 [%rd4], %f1;
  ret;
)");
  SimHarness sim;
  float* in = sim.Alloc<float>(128);
  float* out = sim.Alloc<float>(128);
  for (int i = 0; i < 128; ++i) in[i] = static_cast<float>(i) + 0.5f;
  const KernelArgs args = BufferArgs({in, out});
  absl::Status s =
      sim.Run(ptx, "reverse", {2, 1, 1}, {64, 1, 1}, args, nullptr, /*dynamic_shared=*/256);
  ASSERT_TRUE(s.ok()) << s;
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < 64; ++t) EXPECT_EQ(out[b * 64 + t], 3.0f * in[b * 64 + 63 - t]);
  }
  // Without the dynamic shared memory the same kernel reads past the block's shared memory.
  LaunchReport report;
  EXPECT_FALSE(sim.Run(ptx, "reverse", {2, 1, 1}, {64, 1, 1}, args, &report, 0).ok());
  EXPECT_EQ(report.finding, Finding::kOutOfBounds);
}

TEST(PtxSimt, AtomicsAccumulateAndReturnDistinctOldValues) {
  const std::string ptx = Module(
      "atomics(.param .u64 sum, .param .u64 counter, .param .u64 olds, .param .u64 per_block)", R"(
  .shared .align 4 .b32 count;
  ld.param.u64 %rd1, [sum];
  ld.param.u64 %rd2, [counter];
  ld.param.u64 %rd3, [olds];
  ld.param.u64 %rd4, [per_block];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ctaid.x;
  mov.u32 %r3, %ntid.x;
  mad.lo.u32 %r4, %r2, %r3, %r1;
  setp.eq.u32 %p1, %r1, 0;
  @%p1 st.shared.u32 [count], 0;
  bar.sync 0;
  cvt.rn.f32.u32 %f1, %r4;
  atom.global.add.f32 %f2, [%rd1], %f1;
  atom.global.add.u32 %r5, [%rd2], 1;
  mul.wide.u32 %rd5, %r4, 4;
  add.s64 %rd6, %rd3, %rd5;
  st.global.u32 [%rd6], %r5;
  red.shared.add.u32 [count], 2;
  bar.sync 0;
  @!%p1 bra DONE;
  ld.shared.u32 %r6, [count];
  mul.wide.u32 %rd7, %r2, 4;
  add.s64 %rd8, %rd4, %rd7;
  st.global.u32 [%rd8], %r6;
DONE:
  ret;
)");
  SimHarness sim;
  float* sum = sim.Alloc<float>(1);
  uint32_t* counter = sim.Alloc<uint32_t>(1);
  uint32_t* olds = sim.Alloc<uint32_t>(256);
  uint32_t* per_block = sim.Alloc<uint32_t>(4);
  absl::Status s =
      sim.Run(ptx, "atomics", {4, 1, 1}, {64, 1, 1}, BufferArgs({sum, counter, olds, per_block}));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(*sum, 255.0f * 256.0f / 2.0f);  // small integers: exact in any order
  EXPECT_EQ(*counter, 256u);
  std::vector<uint32_t> sorted(olds, olds + 256);
  std::sort(sorted.begin(), sorted.end());
  for (uint32_t i = 0; i < 256; ++i) EXPECT_EQ(sorted[i], i);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(per_block[b], 128u);
}

TEST(PtxSimt, VectorLoadsAndStoresMoveSixteenBytes) {
  const std::string ptx = Module("vec4(.param .u64 in, .param .u64 out)", R"(
  ld.param.u64 %rd1, [in];
  ld.param.u64 %rd2, [out];
  cvta.to.global.u64 %rd1, %rd1;
  mov.u32 %r1, %tid.x;
  mul.wide.u32 %rd3, %r1, 16;
  add.s64 %rd4, %rd1, %rd3;
  add.s64 %rd5, %rd2, %rd3;
  ld.global.nc.v4.f32 {%f1, %f2, %f3, %f4}, [%rd4];
  mul.f32 %f5, %f1, 0f40000000;
  neg.f32 %f6, %f2;
  abs.f32 %f7, %f3;
  max.f32 %f8, %f4, 0f00000000;
  st.global.v4.f32 [%rd5], {%f5, %f6, %f7, %f8};
  ret;
)");
  SimHarness sim;
  float* in = sim.Alloc<float>(128);
  float* out = sim.Alloc<float>(128);
  for (int i = 0; i < 128; ++i) in[i] = (i % 3 == 0 ? -1.0f : 1.0f) * static_cast<float>(i) * 0.25f;
  absl::Status s = sim.Run(ptx, "vec4", {1, 1, 1}, {32, 1, 1}, BufferArgs({in, out}));
  ASSERT_TRUE(s.ok()) << s;
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(out[4 * t + 0], 2.0f * in[4 * t + 0]);
    EXPECT_EQ(out[4 * t + 1], -in[4 * t + 1]);
    EXPECT_EQ(out[4 * t + 2], std::fabs(in[4 * t + 2]));
    EXPECT_EQ(out[4 * t + 3], std::max(in[4 * t + 3], 0.0f));
  }
}

// f32 arithmetic with the instruction's rounding: .rn results are bit-exact IEEE; fma rounds
// once; .approx stays within PTX's documented bound.
TEST(PtxSimt, FloatArithmeticRoundsLikeTheInstructionSays) {
  const std::string ptx =
      PerLaneKernel("fp", R"(  div.rn.f32 %f4, %f1, %f2;
  sqrt.rn.f32 %f5, %f1;
  rcp.rn.f32 %f6, %f2;
  fma.rn.f32 %f7, %f1, %f2, %f3;
  mul.rn.f32 %f8, %f1, %f2;
  add.rn.f32 %f8, %f8, %f3;
  rsqrt.approx.f32 %f9, %f1;
  div.full.f32 %f10, %f1, %f2;
  cvt.rni.s32.f32 %r2, %f4;
  cvt.rn.f32.s32 %f11, %r2;
  sub.f32 %f12, %f1, %f2;
)",
                    {"%f4", "%f5", "%f6", "%f7", "%f8", "%f9", "%f10", "%r2", "%f11", "%f12"});
  SimHarness sim;
  constexpr int kN = 64;
  const auto [a, b, c, out] = AllocPerLane(sim, kN, 10);
  UnitRandom random(12345);
  for (int i = 0; i < kN; ++i) {
    a[i] = 0.5f + 100.0f * random.Next();
    b[i] = 0.25f + 3.0f * random.Next();
    c[i] = -a[i] * b[i] + random.Next() * 1e-3f;
  }
  // A case where fma (one rounding) and mul+add (two) differ.
  // a*b = 1 + 2^-11 + 2^-24 rounds (tie to even) to 1 + 2^-11, so mul+add gives 0.
  a[0] = 1.0f + std::ldexp(1.0f, -12);
  b[0] = 1.0f + std::ldexp(1.0f, -12);
  c[0] = -(1.0f + std::ldexp(1.0f, -11));
  absl::Status s = sim.Run(ptx, "fp", {1, 1, 1}, {kN, 1, 1}, BufferArgs({a, b, c, out}));
  ASSERT_TRUE(s.ok()) << s;
  for (int i = 0; i < kN; ++i) {
    const float* o = out + 10 * i;
    EXPECT_EQ(o[0], a[i] / b[i]) << i;
    EXPECT_EQ(o[1], std::sqrt(a[i])) << i;
    EXPECT_EQ(o[2], 1.0f / b[i]) << i;
    EXPECT_EQ(o[3], std::fma(a[i], b[i], c[i])) << i;
    const float product = a[i] * b[i];
    EXPECT_EQ(o[4], product + c[i]) << i;
    const double exact_rsqrt = 1.0 / std::sqrt(static_cast<double>(a[i]));
    EXPECT_LE(std::fabs(o[5] - exact_rsqrt) / exact_rsqrt, std::ldexp(1.0, -22)) << i;
    EXPECT_LE(std::fabs(o[6] - static_cast<double>(a[i]) / b[i]),
              2 * std::ldexp(std::fabs(a[i] / b[i]), -23))
        << i;  // div.full: 2 ulp
    int32_t rounded;
    std::memcpy(&rounded, &o[7], 4);
    EXPECT_EQ(rounded, static_cast<int32_t>(std::nearbyint(a[i] / b[i]))) << i;
    EXPECT_EQ(o[8], static_cast<float>(rounded)) << i;
    EXPECT_EQ(o[9], a[i] - b[i]) << i;
  }
  EXPECT_NE(out[3], out[4]) << "fma must round once, mul+add twice";
  EXPECT_EQ(out[3], std::ldexp(1.0f, -24));
  EXPECT_EQ(out[4], 0.0f);
}

// .rz/.rm/.rp on f32 arithmetic and conversions, against the host FPU in the same rounding
// mode (this test is compiled with -frounding-math).
TEST(PtxSimt, DirectedRoundingMatchesTheHostFpuInThatMode) {
  const std::string with_mode =
      PerLaneKernel("directed", R"(  add.MODE.f32 %f4, %f1, %f2;
  sub.MODE.f32 %f5, %f1, %f3;
  mul.MODE.f32 %f6, %f1, %f2;
  div.MODE.f32 %f7, %f1, %f2;
  abs.f32 %f15, %f1;
  sqrt.MODE.f32 %f8, %f15;
  fma.MODE.f32 %f9, %f1, %f2, %f3;
  rcp.MODE.f32 %f10, %f2;
  mul.lo.u32 %r2, %r1, 98765431;
  cvt.MODE.f32.s32 %f11, %r2;
  cvt.f64.f32 %fd1, %f1;
  mul.rn.f64 %fd1, %fd1, 0d3FF0000000000001;
  cvt.MODE.f32.f64 %f12, %fd1;
)",
                    {"%f4", "%f5", "%f6", "%f7", "%f8", "%f9", "%f10", "%f11", "%f12"});
  struct Mode {
    const char* name;
    int fe;
  };
  for (const Mode& mode : {Mode{"rz", FE_TOWARDZERO}, Mode{"rm", FE_DOWNWARD},
                           Mode{"rp", FE_UPWARD}, Mode{"rn", FE_TONEAREST}}) {
    std::string ptx = with_mode;
    for (size_t at = ptx.find("MODE"); at != std::string::npos; at = ptx.find("MODE")) {
      ptx.replace(at, 4, mode.name);
    }
    SimHarness sim;
    constexpr int kN = 64;
    const auto [a, b, c, out] = AllocPerLane(sim, kN, 9);
    UnitRandom random(99);
    for (int i = 0; i < kN; ++i) {
      a[i] = (i % 2 ? -1.0f : 1.0f) * std::ldexp(0.5f + random.Next(), static_cast<int>(i % 9) - 4);
      b[i] = (i % 3 ? 1.0f : -1.0f) * (0.1f + 3.0f * random.Next());
      c[i] = (i % 5 ? -1.0f : 1.0f) * random.Next() * 1e-3f;
    }
    absl::Status s = sim.Run(ptx, "directed", {1, 1, 1}, {kN, 1, 1}, BufferArgs({a, b, c, out}));
    ASSERT_TRUE(s.ok()) << s;
    for (int i = 0; i < kN; ++i) {
      volatile float va = a[i], vb = b[i], vc = c[i];
      const int32_t as_int = static_cast<int32_t>(static_cast<uint32_t>(i) * 98765431u);
      const double wide = static_cast<double>(a[i]) * (1.0 + std::ldexp(1.0, -52));
      std::fesetround(mode.fe);
      const float want[9] = {va + vb,
                             va - vc,
                             va * vb,
                             va / vb,
                             std::sqrt(std::fabs(va)),
                             std::fma(va, vb, vc),
                             1.0f / vb,
                             static_cast<float>(as_int),
                             static_cast<float>(wide)};
      std::fesetround(FE_TONEAREST);
      for (int k = 0; k < 9; ++k) {
        EXPECT_EQ(out[9 * i + k], want[k]) << mode.name << " lane " << i << " result " << k;
      }
    }
  }
}

TEST(PtxSimt, IntegerCompareConvertAndSelect) {
  const std::string ptx = absl::StrCat(kHeader, R"(
.visible .entry ints(.param .u64 out)
{
  .reg .pred %p<4>;
  .reg .b32 %r<12>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [out];
  mov.u32 %r1, -5;
  mov.u32 %r2, 3;
  setp.lt.s32 %p1, %r1, %r2;
  setp.lt.u32 %p2, %r1, %r2;
  selp.b32 %r3, 1, 0, %p1;
  selp.b32 %r4, 1, 0, %p2;
  shr.s32 %r5, %r1, 1;
  shr.u32 %r6, %r1, 28;
  shl.b32 %r7, %r2, 33;
  mov.u32 %r8, 16777217;
  cvt.rn.f32.u32 %f1, %r8;
  st.global.u32 [%rd1], %r3;
  st.global.u32 [%rd1+4], %r4;
  st.global.u32 [%rd1+8], %r5;
  st.global.u32 [%rd1+12], %r6;
  st.global.u32 [%rd1+16], %r7;
  st.global.f32 [%rd1+20], %f1;
  mul.hi.u32 %r9, %r1, %r2;
  st.global.u32 [%rd1+24], %r9;
  ret;
}
)");
  // %f1 is not declared above on purpose: the parser must say so.
  SimHarness sim;
  uint32_t* out = sim.Alloc<uint32_t>(7);
  const KernelArgs args = BufferArgs({out});
  absl::Status s = sim.Run(ptx, "ints", {1, 1, 1}, {1, 1, 1}, args);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("undeclared register '%f1'"));

  std::string fixed = ptx;
  fixed.replace(fixed.find(".reg .b64"), 0, ".reg .f32 %f<2>;\n  ");
  s = sim.Run(fixed, "ints", {1, 1, 1}, {1, 1, 1}, args);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out[0], 1u);                        // -5 < 3 signed
  EXPECT_EQ(out[1], 0u);                        // 0xfffffffb > 3 unsigned
  EXPECT_EQ(static_cast<int32_t>(out[2]), -3);  // arithmetic shift
  EXPECT_EQ(out[3], 0xfu);                      // logical shift
  EXPECT_EQ(out[4], 0u);                        // shift >= width clamps
  float f;
  std::memcpy(&f, &out[5], 4);
  EXPECT_EQ(f, 16777216.0f);  // round to nearest even
  EXPECT_EQ(out[6], static_cast<uint32_t>((uint64_t{0xfffffffbu} * 3) >> 32));
}

}  // namespace
}  // namespace normgrad::ptxsim
