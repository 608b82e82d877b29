// normgrad-ptx, run as a program: prints the same PTX as BackwardKernel::Emit, writes -o files, lists the
// kernels, exits 2 with one line on stderr for bad arguments, and reports resource usage.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"

namespace normgrad::kernels {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

RunResult RunTool(const std::string& args) {
  const std::string dir = ::testing::TempDir();
  const std::string out_path = absl::StrCat(dir, "/normgrad_ptx_out_", getpid());
  const std::string err_path = absl::StrCat(dir, "/normgrad_ptx_err_", getpid());
  const std::string cmd =
      absl::StrCat("'", NORMGRAD_PTX_BINARY, "' ", args, " >'", out_path, "' 2>'", err_path, "'");
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadFile(out_path);
  r.err = ReadFile(err_path);
  std::remove(out_path.c_str());
  std::remove(err_path.c_str());
  return r;
}

// --resource-usage: one line instead of the PTX, with the lowest CUDA driver for its ISA, and
// without nvJitLink the reason in place of the resources.
TEST(NormgradPtxTest, ResourceUsageLineWithAndWithoutNvJitLink) {
  RunResult none = RunTool(
      "--kernel rms_norm_backward_row_resident --hidden-dim 4096 --target sm_90 --dtype bf16 "
      "--resource-usage --nvjitlink /nonexistent/libnvJitLink.so.13");
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_EQ(none.out.rfind("rms_norm_backward_row_resident dtype=bf16 target=sm_90 "
                           "ptx_version=7.8 min_cuda_driver=11.8 resources=unknown (nvJitLink "
                           "is not available",
                           0),
            0u)
      << none.out;
  EXPECT_EQ(std::count(none.out.begin(), none.out.end(), '\n'), 1);

  RunResult r = RunTool(
      "--kernel rms_norm_backward_row_resident --hidden-dim 4096 --target sm_90 --dtype bf16 "
      "--resource-usage");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  if (absl::StrContains(r.out, "resources=unknown")) GTEST_SKIP() << "no nvJitLink: " << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, " min_cuda_driver=11.8 registers=")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out,
                                " spill_store_bytes=0 spill_load_bytes=0 "
                                "shared_memory_bytes=132 local_memory_bytes=0 barriers=1\n"))
      << r.out;
}

TEST(NormgradPtxTest, PrintsTheSameBytesAsEmit) {
  RunResult r = RunTool("--kernel batched_rms_norm_backward --hidden-dim 896 --target sm_90");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  absl::StatusOr<EmittedPtx> ptx =
      FindKernel("batched_rms_norm_backward")->Emit({.hidden_dim = 896, .target_sm = 90});
  ASSERT_TRUE(ptx.ok());
  EXPECT_EQ(r.out, ptx->text);
  EXPECT_TRUE(r.err.empty()) << r.err;
}

// The variant flags print Emit's bytes for that variant (not the default's).
TEST(NormgradPtxTest, VariantFlagsPrintThatVariant) {
  NormVariant variant;
  variant.gamma_offset = 1.0f;
  variant.casting = CastingMode::kLlama;
  RunResult r = RunTool(
      "--kernel rms_norm_backward_row_resident --hidden-dim 4096 --target sm_90 --dtype bf16 "
      "--gamma-offset 1 --casting-mode llama");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  KernelConfig config{.hidden_dim = 4096, .dtype = DType::kBF16, .target_sm = 90};
  absl::StatusOr<EmittedPtx> plain = FindKernel("rms_norm_backward_row_resident")->Emit(config);
  config.variant = variant;
  absl::StatusOr<EmittedPtx> ptx = FindKernel("rms_norm_backward_row_resident")->Emit(config);
  ASSERT_TRUE(ptx.ok() && plain.ok());
  EXPECT_EQ(r.out, ptx->text);
  EXPECT_NE(r.out, plain->text);
  RunResult none = RunTool("--kernel rms_norm_backward_row_resident --hidden-dim 64 --no-gamma");
  ASSERT_EQ(none.exit_code, 0) << none.err;
  config = KernelConfig{.hidden_dim = 64};
  config.variant.has_gamma = false;
  EXPECT_EQ(none.out, FindKernel("rms_norm_backward_row_resident")->Emit(config)->text);
}

TEST(NormgradPtxTest, HonoursPtxVersionAndWritesTheOutputFile) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/normgrad_ptx_file_", getpid());
  RunResult r =
      RunTool(absl::StrCat("--kernel rms_norm_backward --hidden-dim 16 --target sm_90 "
                           "--ptx-version 8.0 -o '",
                           path, "'"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty());
  const std::string text = ReadFile(path);
  std::remove(path.c_str());
  EXPECT_TRUE(absl::StrContains(text, ".version 8.0\n.target sm_90\n")) << text;
  EXPECT_TRUE(absl::StrContains(text, ".entry rms_norm_backward"));
}

TEST(NormgradPtxTest, DefaultsToSm75) {
  RunResult r = RunTool("--kernel rms_norm_backward --hidden-dim 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, ".target sm_75\n"));
}

TEST(NormgradPtxTest, ListsKernelsWithTheirParameters) {
  RunResult r = RunTool("--list");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(
      r.out,
      "rms_norm_backward(input_ptr: u64, gamma_ptr: u64, rms_ptr: u64, grad_output_ptr: u64, "
      "grad_input_ptr: u64, num_rows: u32, hidden_dim: u32)\n"))
      << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "batched_rms_norm_backward(") &&
              absl::StrContains(r.out, "eps: f32)"))
      << r.out;
}

TEST(NormgradPtxTest, BadArgumentsExitTwoWithOneLine) {
  const struct {
    const char* args;
    const char* reason;
  } cases[] = {
      {"--kernel rms_norm_backward --hidden-dim 64", "hidden_dim 64 is outside 1..32"},
      {"--kernel nope --hidden-dim 8", "unknown kernel \"nope\""},
      {"--kernel rms_norm_backward --hidden-dim 8 --target sm_70", "sm_70 is not supported"},
      {"--kernel rms_norm_backward --hidden-dim 8 --target sm_90 --ptx-version 7.0",
       "ptx_version 7.0 is below 7.8"},
      {"--kernel rms_norm_backward --hidden-dim x", "--hidden-dim \"x\""},
      {"--kernel rms_norm_backward", "--hidden-dim is required"},
      {"--hidden-dim 8", "--kernel is required"},
      {"--kernel rms_norm_backward --hidden-dim 8 --bogus", "unknown argument \"--bogus\""},
      {"--kernel rms_norm_backward --hidden-dim", "--hidden-dim needs a value"},
      {"--kernel rms_norm_backward --hidden-dim 8 --ptx-version eight", "not MAJOR.MINOR"},
      {"--kernel rms_norm_backward --hidden-dim 8 --gamma-offset nan", "is not a finite number"},
      {"--kernel rms_norm_backward --hidden-dim 8 --casting-mode x", "casting"},
      {"--kernel rms_norm_backward_row_resident --hidden-dim 8 --no-gamma --gamma-offset 1",
       "--no-gamma takes no --gamma-offset"},
      {"--kernel rms_norm_backward --hidden-dim 8 --gamma-offset 1", "variant"},
  };
  for (const auto& c : cases) {
    RunResult r = RunTool(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args;
    EXPECT_TRUE(r.out.empty()) << c.args;
    EXPECT_TRUE(absl::StrContains(r.err, c.reason)) << c.args << " -> " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.args << " -> " << r.err;
  }
}

}  // namespace
}  // namespace normgrad::kernels
