// IpcBufferCache: a handle of the wrong size and one the driver refuses are the client's mistakes
// (INVALID_ARGUMENT saying why), checked against the emulated driver, which refuses a handle
// exported by the opening process itself, as CUDA does.
#include "server/cuda/ipc_buffer_cache.h"

#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nvidia/driver_api.h"
#include "server/cuda/device_context.h"
#include "tests/server/cuda/test_device.h"

#ifndef NORMGRAD_EMULATED_CUDA_DRIVER
#error "NORMGRAD_EMULATED_CUDA_DRIVER must name the emulated driver library"
#endif

namespace normgrad::server::cuda_internal {
namespace {

TEST(IpcBufferCache, AHandleOfTheWrongSizeIsRefusedWithoutTheDriver) {
  IpcBufferCache cache(nullptr, 4);  // never reaches the driver
  const absl::Status s = cache.Open(std::string(63, 'x')).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "a CUDA IPC handle has 64 bytes, not 63")) << s;
}

TEST(IpcBufferCache, AHandleTheDriverRefusesIsTheClientsMistakeSayingWhy) {
  std::shared_ptr<const DeviceContext> ctx = DeviceOnDriver(NORMGRAD_EMULATED_CUDA_DRIVER);
  ASSERT_NE(ctx, nullptr);
  ASSERT_TRUE(ctx->driver().HasIpc());
  CUdeviceptr p = 0;
  ASSERT_EQ(ctx->api().cuMemAlloc_v2(&p, 4096), CUDA_SUCCESS);
  // The server never exports: the driver table lacks the call, the library has it.
  using GetHandle = CUresult (*)(CUipcMemHandle*, CUdeviceptr);
  const auto get_handle = reinterpret_cast<GetHandle>(
      dlsym(dlopen(NORMGRAD_EMULATED_CUDA_DRIVER, RTLD_NOW | RTLD_LOCAL), "cuIpcGetMemHandle"));
  ASSERT_NE(get_handle, nullptr);
  CUipcMemHandle exported;
  ASSERT_EQ(get_handle(&exported, p), CUDA_SUCCESS);
  IpcBufferCache cache(ctx, 4);
  const absl::Status own =
      cache.Open(std::string(reinterpret_cast<const char*>(exported.reserved), 64)).status();
  EXPECT_EQ(own.code(), absl::StatusCode::kInvalidArgument) << own;
  EXPECT_TRUE(absl::StrContains(own.message(), "cuIpcOpenMemHandle")) << own;
  EXPECT_TRUE(absl::StrContains(own.message(), "exported by the server's own process")) << own;
  ctx->api().cuMemFree_v2(p);
}

}  // namespace
}  // namespace normgrad::server::cuda_internal
