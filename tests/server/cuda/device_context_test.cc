// DeviceContext: a lost device fails for good (once, with the first reason, the handler called
// once); with no synchronize waiting, the watchdog sees progress.
#include "server/cuda/device_context.h"

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/server/cuda/test_device.h"

namespace normgrad::server::cuda_internal {
namespace {

TEST(DeviceContext, ALostDeviceFailsForGoodAndCallsTheHandlerOnce) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  int calls = 0;
  ctx->set_failure_handler([&](const absl::Status& s) {
    ++calls;
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  });
  // An ordinary error is the call's alone.
  EXPECT_NE(ctx->Check(CUDA_ERROR_INVALID_VALUE, "cuFoo").code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(ctx->failure().ok());
  const absl::Status lost = ctx->Check(CUDA_ERROR_ILLEGAL_ADDRESS, "cuLaunchKernel(k)");
  EXPECT_EQ(lost.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(lost.message(), "the GPU failed")) << lost;
  EXPECT_TRUE(absl::StrContains(lost.message(), "cuLaunchKernel(k)")) << lost;
  // The first reason stays; the handler is not called again.
  ctx->Fail(absl::InternalError("later"));
  EXPECT_EQ(ctx->failure(), lost);
  EXPECT_EQ(ctx->CheckProgress(absl::Seconds(1)), lost);
  EXPECT_EQ(calls, 1);
}

TEST(DeviceContext, NoWaitingSynchronizeIsProgress) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  EXPECT_TRUE(ctx->CheckProgress(absl::Nanoseconds(1)).ok());
  EXPECT_TRUE(ctx->CheckProgress(absl::ZeroDuration()).ok());
}

}  // namespace
}  // namespace normgrad::server::cuda_internal
