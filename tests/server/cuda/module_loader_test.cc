// LoadModule and CudaLauncher: emitted PTX loaded with its entry and parameters (unloaded with
// the last holder), a JIT failure as INTERNAL carrying the JIT log, and a kernel's Run through a
// launcher of that module on a stream: the kernel's zero fill, then its launch, in stream order.
#include "server/cuda/module_loader.h"

#include <stdlib.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/backward_kernel.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "server/cuda/cuda_launcher.h"
#include "tests/server/cuda/test_device.h"

namespace normgrad::server::cuda_internal {
namespace {

kernels::EmittedPtx Emitted(const char* kernel, uint32_t hidden) {
  absl::StatusOr<kernels::EmittedPtx> ptx =
      kernels::FindKernel(kernel)->Emit({.hidden_dim = hidden, .target_sm = 90});
  EXPECT_TRUE(ptx.ok()) << ptx.status();
  return ptx.ok() ? *ptx : kernels::EmittedPtx{};
}

TEST(LoadModule, LoadsTheEntryWithItsParametersAndUnloadsWithTheLastHolder) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  const int live_before = ScriptedCounter<int>("live_modules");
  const kernels::EmittedPtx ptx = Emitted("batched_rms_norm_backward", 64);
  {
    absl::StatusOr<std::shared_ptr<const LoadedModule>> m = LoadModule(ctx, ptx);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ((*m)->entry, "batched_rms_norm_backward");
    EXPECT_NE((*m)->function, nullptr);
    EXPECT_EQ((*m)->params.size(), ptx.params.size());
    EXPECT_EQ(ScriptedCounter<int>("live_modules"), live_before + 1);
  }
  EXPECT_EQ(ScriptedCounter<int>("live_modules"), live_before);
}

TEST(LoadModule, AJitFailureIsInternalWithTheLog) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  setenv("NORMGRAD_SCRIPTED_CUDA", "jit_error", 1);
  absl::StatusOr<std::shared_ptr<const LoadedModule>> m =
      LoadModule(ctx, Emitted("rms_norm_backward", 32));
  unsetenv("NORMGRAD_SCRIPTED_CUDA");
  ASSERT_EQ(m.status().code(), absl::StatusCode::kInternal) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "cuModuleLoadDataEx(rms_norm_backward"));
  EXPECT_TRUE(absl::StrContains(m.status().message(), "JIT log: ptxas application ptx input"));
}

TEST(CudaLauncher, RunsAKernelsFillAndLaunchesOnItsStream) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  const kernels::BackwardKernel& batched = *kernels::FindKernel("batched_rms_norm_backward");
  const kernels::KernelConfig config{.hidden_dim = 4, .target_sm = 90};
  absl::StatusOr<std::shared_ptr<const LoadedModule>> m = LoadModule(ctx, *batched.Emit(config));
  ASSERT_TRUE(m.ok()) << m.status();
  CUstream stream = nullptr;
  ASSERT_EQ(ctx->api().cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  // The scripted driver's device memory is host memory.
  const uint32_t rows = 3, h = 4;
  std::vector<float> x(rows * h, 1.0f), dy(rows * h, 1.0f), dx(rows * h), gamma(h, 1.0f);
  std::vector<float> dgamma(h, 123.0f);  // not zero: the kernel's Run zeroes it first
  auto at = [](auto& v) { return reinterpret_cast<uint64_t>(v.data()); };
  kernels::BackwardArgs args;
  args.x = at(x);
  args.dy = at(dy);
  args.dx = at(dx);
  args.gamma = at(gamma);
  args.dgamma = at(dgamma);
  args.rows = rows;
  args.hidden_dim = h;
  args.eps = 1e-5f;
  const int launches_before = ScriptedCounter<int>("launches");
  CudaLauncher launcher(**m, stream);
  EXPECT_EQ(launcher.Params().size(), batched.Params().size());
  ASSERT_TRUE(batched.Run(config, args, launcher).ok());
  ASSERT_TRUE(ctx->Synchronize(stream).ok());
  EXPECT_EQ(ScriptedCounter<int>("launches"), launches_before + 1);
  // x = dy = gamma = 1: rms = 1, dgamma_i = sum_r dy * x / rms = rows (not 123 + rows).
  for (float g : dgamma) EXPECT_NEAR(g, 3.0f, 1e-4f);
  ctx->api().cuStreamDestroy_v2(stream);
}

}  // namespace
}  // namespace normgrad::server::cuda_internal
