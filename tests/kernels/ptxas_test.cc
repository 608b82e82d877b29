// Every kernel, for a spread of configurations, emitted for sm_75, sm_80, sm_90 and sm_100 (and
// with explicit PTX versions), assembles with NVIDIA's ptxas without error. ptxas is looked up on
// PATH, then under /usr/local/cuda/bin; without it the tests are skipped with a visible reason.
// ptxas's register and spill report is printed for the record (docs/kernels.md quotes it).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
#include "kernels/ptx_builder.h"
#include "kernels/ptx_printer.h"
#include "kernels/targets.h"
#include "kernels/verifier.h"

namespace normgrad::kernels {
namespace {

bool Executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

std::optional<std::string> FindPtxas() {
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      std::string candidate = absl::StrCat(dir, "/ptxas");
      if (Executable(candidate)) return candidate;
    }
  }
  if (Executable("/usr/local/cuda/bin/ptxas")) return std::string("/usr/local/cuda/bin/ptxas");
  return std::nullopt;
}

struct PtxasResult {
  int exit_code = -1;
  std::string output;  // stdout + stderr
};

PtxasResult Assemble(const std::string& ptxas, const std::string& text, int target_sm,
                     const std::string& tag) {
  const std::string dir = ::testing::TempDir();
  const std::string base = absl::StrCat(dir, "/normgrad_ptxas_", getpid(), "_", tag);
  const std::string ptx_path = base + ".ptx";
  const std::string cubin_path = base + ".cubin";
  {
    std::ofstream f(ptx_path, std::ios::binary | std::ios::trunc);
    f << text;
  }
  const std::string cmd = absl::StrCat("'", ptxas, "' -arch=sm_", target_sm, " -v '", ptx_path,
                                       "' -o '", cubin_path, "' 2>&1");
  PtxasResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::remove(ptx_path.c_str());
  std::remove(cubin_path.c_str());
  return r;
}

// "ptxas info    : Used 32 registers, used 0 barriers, 404 bytes cmem[0]" -> "32 registers".
std::string Summary(const std::string& output) {
  std::vector<std::string> parts;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (absl::StrContains(line, "Used ") || absl::StrContains(line, "spill")) {
      parts.push_back(std::string(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1))));
    }
  }
  return absl::StrJoin(parts, " | ");
}

class PtxasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ptxas_ = FindPtxas();
    if (!ptxas_) GTEST_SKIP() << "ptxas not found on PATH or in /usr/local/cuda/bin: skipped";
  }
  std::optional<std::string> ptxas_;
};

struct Case {
  absl::string_view kernel;
  uint32_t hidden_dim;
};

TEST_F(PtxasTest, EveryKernelAssemblesForEveryMainTarget) {
  const std::vector<Case> cases = {
      {"rms_norm_backward", 1},
      {"rms_norm_backward", 7},
      {"rms_norm_backward", 32},
      {"batched_rms_norm_backward", 1},
      {"batched_rms_norm_backward", 33},
      {"batched_rms_norm_backward", 896},
      {"batched_rms_norm_backward", 4096},
      {"batched_rms_norm_backward", 8192},
  };
  for (const Case& c : cases) {
    for (int sm : {75, 80, 90, 100}) {
      const Kernel* k = FindKernel(c.kernel);
      ASSERT_NE(k, nullptr);
      absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = c.hidden_dim, .target_sm = sm});
      ASSERT_TRUE(ptx.ok()) << ptx.status();
      const PtxasResult r =
          Assemble(*ptxas_, ptx->text, sm, absl::StrCat(c.kernel, "_", c.hidden_dim, "_", sm));
      EXPECT_EQ(r.exit_code, 0) << c.kernel << " hidden_dim " << c.hidden_dim << " sm_" << sm
                                << ":\n"
                                << r.output;
      EXPECT_FALSE(absl::StrContains(r.output, "error")) << r.output;
      if (c.hidden_dim == 32 || c.hidden_dim == 896) {
        std::cout << c.kernel << " hidden_dim=" << c.hidden_dim << " sm_" << sm << " ptx "
                  << ptx->version.ToString() << ": " << Summary(r.output) << "\n";
      }
    }
  }
}

TEST_F(PtxasTest, EveryKernelAssemblesForEverySupportedTargetAtItsDefaultVersion) {
  for (const Kernel* k : AllKernels()) {
    for (int sm : SupportedTargets()) {
      absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = 32, .target_sm = sm});
      ASSERT_TRUE(ptx.ok()) << ptx.status();
      const PtxasResult r =
          Assemble(*ptxas_, ptx->text, sm, absl::StrCat(k->EntryName(), "_all_", sm));
      EXPECT_EQ(r.exit_code, 0) << k->EntryName() << " sm_" << sm << " .version "
                                << ptx->version.ToString() << ":\n"
                                << r.output;
    }
  }
}

TEST_F(PtxasTest, HalfPrecisionKernelsAssemble) {
  for (const Kernel* k : AllKernels()) {
    for (DType dtype : {DType::kF16, DType::kBF16}) {
      for (int sm : {75, 80, 90, 100}) {
        const KernelConfig config{.hidden_dim = 64, .dtype = dtype, .target_sm = sm};
        if (!k->CanImplement(config).ok()) continue;  // bf16 below sm_80
        absl::StatusOr<EmittedPtx> ptx = k->Emit(config);
        ASSERT_TRUE(ptx.ok()) << ptx.status();
        const PtxasResult r = Assemble(
            *ptxas_, ptx->text, sm, absl::StrCat(k->EntryName(), "_", DTypeName(dtype), "_", sm));
        EXPECT_EQ(r.exit_code, 0) << k->EntryName() << " " << DTypeName(dtype) << " sm_" << sm
                                  << ":\n"
                                  << r.output;
      }
    }
  }
}

TEST_F(PtxasTest, AssemblesWithExplicitPtxVersions) {
  struct Versioned {
    int sm;
    PtxVersion version;
  };
  for (const Kernel* k : AllKernels()) {
    for (const Versioned& v : {Versioned{75, {7, 0}}, Versioned{80, {8, 0}}, Versioned{90, {8, 0}},
                               Versioned{100, {9, 0}}, Versioned{120, {8, 7}}}) {
      absl::StatusOr<EmittedPtx> ptx =
          k->Emit({.hidden_dim = 16, .target_sm = v.sm, .ptx_version = v.version});
      ASSERT_TRUE(ptx.ok()) << ptx.status();
      const PtxasResult r = Assemble(*ptxas_, ptx->text, v.sm,
                                     absl::StrCat(k->EntryName(), "_v", v.version.major, v.sm));
      EXPECT_EQ(r.exit_code, 0) << k->EntryName() << " sm_" << v.sm << " .version "
                                << v.version.ToString() << ":\n"
                                << r.output;
    }
  }
}

// The PTX ISA versions that exist (6.0..6.5, 7.0..7.8, 8.0..8.8, 9.0), ascending.
std::vector<PtxVersion> KnownPtxVersions() {
  std::vector<PtxVersion> out;
  for (int minor = 0; minor <= 5; ++minor) out.push_back({6, minor});
  for (int minor = 0; minor <= 8; ++minor) out.push_back({7, minor});
  for (int minor = 0; minor <= 8; ++minor) out.push_back({8, minor});
  out.push_back({9, 0});
  return out;
}

TEST_F(PtxasTest, TheDefaultVersionIsTheLowestPtxasAccepts) {
  // The version just below each target's default must be refused by ptxas itself: the table in
  // kernels/kernel.cc is the real minimum, not a guess.
  const Kernel* k = FindKernel("batched_rms_norm_backward");
  const std::vector<PtxVersion> known = KnownPtxVersions();
  for (int sm : SupportedTargets()) {
    absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = 16, .target_sm = sm});
    ASSERT_TRUE(ptx.ok());
    auto it = std::find(known.begin(), known.end(), ptx->version);
    ASSERT_NE(it, known.end()) << ptx->version.ToString();
    ASSERT_NE(it, known.begin());
    const PtxVersion lower = *(it - 1);
    std::string text = ptx->text;
    const std::string declared = absl::StrCat(".version ", ptx->version.ToString());
    text.replace(text.find(declared), declared.size(), absl::StrCat(".version ", lower.ToString()));
    const PtxasResult r = Assemble(*ptxas_, text, sm, absl::StrCat("lower_", sm));
    EXPECT_NE(r.exit_code, 0) << "sm_" << sm << " accepted .version " << lower.ToString();
  }
}

// Every instruction form the builder can emit (docs/kernels.md lists them) in one verified
// module: ptxas must accept all of it, so Verify() never lets through what ptxas refuses.
TEST_F(PtxasTest, EveryBuilderFormAssembles) {
  Module m(PtxVersion{7, 0}, 80);
  Function& f = m.AddEntry("all_forms");
  const Param p64 = f.AddParam(PtxType::kU64, "ptr");
  const Param p32 = f.AddParam(PtxType::kU32, "n");
  const Param pf = f.AddParam(PtxType::kF32, "scale");
  Builder b(&f);
  const Label done = b.CreateLabel("done");
  const Label uni = b.CreateLabel("uni");
  const Value ptr = b.LdParam(p64);
  const Value n = b.LdParam(p32);
  const Value scale = b.LdParam(pf);
  const Value tid = b.Mov(SpecialReg::kTidX);
  for (SpecialReg r : {SpecialReg::kTidY, SpecialReg::kNtidX, SpecialReg::kCtaidX,
                       SpecialReg::kNctaidX, SpecialReg::kLaneId, SpecialReg::kWarpId}) {
    b.Mov(r);
  }
  const Value s = b.Mov(Value::S32(-3));
  const Value d = b.Mov(Value::U64(16));
  const Value x = b.Ld(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 4});
  const std::vector<Value> v4 = b.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{ptr, 16});
  const Value xd = b.Cvt(PtxType::kF64, x);
  const Value ok = b.Setp(CmpOp::kLt, tid, n);
  const Value guarded = b.LdOr(StateSpace::kGlobal, ok, Address{ptr}, Value::F32(0.0f));
  // Integer arithmetic.
  const Value u1 = b.Add(tid, n);
  const Value u2 = b.Sub(u1, Value::U32(1));
  const Value u3 = b.Mul(u2, u1);
  const Value u4 = b.MulHi(u3, u2);
  const Value u5 = b.Mad(u4, u3, u2);
  const Value w1 = b.MulWide(u5, Value::U32(8));
  const Value w2 = b.MadWide(u5, u4, w1);
  const Value u6 = b.Div(u5, Value::U32(3));
  const Value u7 = b.Rem(u6, Value::U32(5));
  const Value u8 = b.Min(u7, u6);
  const Value u9 = b.Max(u8, u5);
  const Value s1 = b.Neg(s);
  const Value s2 = b.Abs(s1);
  const Value s3 = b.Shr(s2, Value::U32(1));
  const Value d1 = b.Add(d, w2);
  const Value d2 = b.Mul(d1, d);
  const Value d3 = b.Cvt(PtxType::kU64, u9);
  // Bitwise.
  const Value a1 = b.And(u9, Value::U32(255));
  const Value a2 = b.Or(a1, Value::B32(0x100));
  const Value a3 = b.Xor(a2, u8);
  const Value a4 = b.Not(a3);
  const Value a5 = b.Shl(a4, Value::U32(2));
  const Value a6 = b.Shr(a5, Value::U32(3));
  const Value d4 = b.Shl(d3, Value::U32(2));
  // Float arithmetic with each rounding form.
  const Value f1 = b.Add(x, scale);
  const Value f2 = b.Sub(f1, v4[0]);
  const Value f3 = b.Mul(f2, v4[1]);
  const Value f4 = b.Fma(f3, v4[2], v4[3]);
  const Value f5 = b.Div(f4, scale, Rounding::kRn);
  const Value f6 = b.Div(f5, scale, Rounding::kApprox);
  const Value f7 = b.Div(f6, scale, Rounding::kFull);
  const Value f8 = b.Sqrt(f7, Rounding::kRn);
  const Value f9 = b.Sqrt(f8, Rounding::kApprox);
  const Value f10 = b.Rsqrt(f9);
  const Value f11 = b.Rcp(f10, Rounding::kRn);
  const Value f12 = b.Rcp(f11, Rounding::kApprox);
  const Value f13 = b.Min(f12, guarded);
  const Value f14 = b.Max(f13, x);
  const Value f15 = b.Neg(f14);
  const Value f16 = b.Abs(f15);
  const Value f17 = b.Cvt(PtxType::kF32, a6, Rounding::kRn);
  const Value f18 = b.Cvt(PtxType::kF32, s3, Rounding::kRz);
  const Value f19 = b.Cvt(PtxType::kF32, b.Fma(xd, xd, xd), Rounding::kRn);
  const Value f20 = b.Add(b.Add(f16, f17), b.Add(f18, f19));
  // Comparison, selection, shuffles, atomics, stores.
  for (CmpOp op : {CmpOp::kEq, CmpOp::kNe, CmpOp::kLt, CmpOp::kLe, CmpOp::kGt, CmpOp::kGe}) {
    b.Setp(op, f20, x);
  }
  const Value pick = b.Selp(f20, x, b.Setp(CmpOp::kEq, a6, Value::U32(0)));
  const Value sh1 = b.Shfl(ShflMode::kDown, pick, Value::U32(16), 0xffffffffu);
  const Value sh2 = b.Shfl(ShflMode::kUp, sh1, Value::U32(1), 0xffffffffu);
  const Value sh3 = b.Shfl(ShflMode::kBfly, sh2, Value::U32(2), 0xffffffffu);
  const Value sh4 = b.Shfl(ShflMode::kIdx, sh3, Value::U32(0), 0xffffffffu);
  b.AtomAdd(StateSpace::kGlobal, Address{ptr, 8}, sh4);
  b.AtomAdd(StateSpace::kGlobal, Address{ptr, 12}, u9);
  const Value smem = b.AddressOf(f.AddShared("scratch", 256, 16));
  b.St(StateSpace::kShared, Address{smem, 4}, sh4);
  b.BarSync(0);
  const Value from_shared = b.Ld(StateSpace::kShared, PtxType::kF32, Address{smem, 8});
  b.AtomAdd(StateSpace::kShared, Address{smem, 12}, from_shared);
  b.StV4(StateSpace::kShared, Address{smem, 16}, v4);
  b.St(StateSpace::kGlobal, Address{b.Add(ptr, d4), -4}, sh4);
  b.StV4(StateSpace::kGlobal, Address{ptr, 32}, v4);
  b.St(StateSpace::kGlobal, Address{ptr}, b.Cvt(PtxType::kU32, d2));
  b.BraIf(ok, done);
  b.Bra(uni, /*uniform=*/true);
  b.Bind(uni);
  {
    auto guard = b.IfNot(ok);
    b.Exit();
  }
  b.Bind(done);
  b.Ret();
  ASSERT_TRUE(Verify(m).ok()) << Verify(m);
  const std::string text = EmitPtx(m);
  const PtxasResult r = Assemble(*ptxas_, text, 80, "all_forms");
  EXPECT_EQ(r.exit_code, 0) << r.output << "\n" << text;
}

TEST_F(PtxasTest, HarnessReportsARejectedModule) {
  // The check above would be worthless if a rejection went unnoticed.
  absl::StatusOr<EmittedPtx> ptx = FindKernel("rms_norm_backward")->Emit({.hidden_dim = 32});
  ASSERT_TRUE(ptx.ok());
  std::string broken = ptx->text;
  broken.replace(broken.find("ret;"), 4, "bogus.instruction;");
  const PtxasResult r = Assemble(*ptxas_, broken, 75, "broken");
  EXPECT_NE(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace normgrad::kernels
