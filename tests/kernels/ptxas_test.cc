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
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/ptx/ptx_printer.h"
#include "kernels/ptx/targets.h"
#include "kernels/ptx/verifier.h"
#include "tests/common/shell_command.h"
#include "tests/kernels/instruction_forms.h"

namespace normgrad::kernels {
namespace {

using ::normgrad::testing::CommandOutput;

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

CommandOutput Assemble(const std::string& ptxas, const std::string& text, int target_sm,
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
  const CommandOutput r = testing::RunShellCommand(cmd);
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
      const BackwardKernel* k = FindKernel(c.kernel);
      ASSERT_NE(k, nullptr);
      absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = c.hidden_dim, .target_sm = sm});
      ASSERT_TRUE(ptx.ok()) << ptx.status();
      const CommandOutput r =
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
  for (const BackwardKernel* k : AllKernels()) {
    for (int sm : SupportedTargets()) {
      absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = 32, .target_sm = sm});
      ASSERT_TRUE(ptx.ok()) << ptx.status();
      const CommandOutput r =
          Assemble(*ptxas_, ptx->text, sm, absl::StrCat(k->EntryName(), "_all_", sm));
      EXPECT_EQ(r.exit_code, 0) << k->EntryName() << " sm_" << sm << " .version "
                                << ptx->version.ToString() << ":\n"
                                << r.output;
    }
  }
}

TEST_F(PtxasTest, HalfPrecisionKernelsAssemble) {
  for (const BackwardKernel* k : AllKernels()) {
    for (DType dtype : {DType::kF16, DType::kBF16}) {
      for (int sm : {75, 80, 90, 100}) {
        const KernelConfig config{.hidden_dim = 64, .dtype = dtype, .target_sm = sm};
        if (!k->CanImplement(config).ok()) continue;  // bf16 below sm_80
        absl::StatusOr<EmittedPtx> ptx = k->Emit(config);
        ASSERT_TRUE(ptx.ok()) << ptx.status();
        const CommandOutput r = Assemble(
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
  for (const BackwardKernel* k : AllKernels()) {
    for (const Versioned& v : {Versioned{75, {7, 0}}, Versioned{80, {8, 0}}, Versioned{90, {8, 0}},
                               Versioned{100, {9, 0}}, Versioned{120, {8, 7}}}) {
      absl::StatusOr<EmittedPtx> ptx =
          k->Emit({.hidden_dim = 16, .target_sm = v.sm, .ptx_version = v.version});
      ASSERT_TRUE(ptx.ok()) << ptx.status();
      const CommandOutput r = Assemble(*ptxas_, ptx->text, v.sm,
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
  // kernels/ptx/targets.cc is the real minimum, not a guess.
  const BackwardKernel* k = FindKernel("batched_rms_norm_backward");
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
    const CommandOutput r = Assemble(*ptxas_, text, sm, absl::StrCat("lower_", sm));
    EXPECT_NE(r.exit_code, 0) << "sm_" << sm << " accepted .version " << lower.ToString();
  }
}

// Every instruction form the builder can emit (tests/kernels/instruction_forms.h) in one verified
// module: ptxas must accept all of it, so Verify() never lets through what ptxas refuses.
TEST_F(PtxasTest, EveryBuilderFormAssembles) {
  const Module m = EveryInstructionFormModule();
  ASSERT_TRUE(Verify(m).ok()) << Verify(m);
  const std::string text = EmitPtx(m);
  const CommandOutput r = Assemble(*ptxas_, text, kEveryFormTargetSm, "all_forms");
  EXPECT_EQ(r.exit_code, 0) << r.output << "\n" << text;
}

TEST_F(PtxasTest, HarnessReportsARejectedModule) {
  // The check above would be worthless if a rejection went unnoticed.
  absl::StatusOr<EmittedPtx> ptx = FindKernel("rms_norm_backward")->Emit({.hidden_dim = 32});
  ASSERT_TRUE(ptx.ok());
  std::string broken = ptx->text;
  broken.replace(broken.find("ret;"), 4, "bogus.instruction;");
  const CommandOutput r = Assemble(*ptxas_, broken, 75, "broken");
  EXPECT_NE(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace normgrad::kernels
