// A DeviceContext on a stand-in driver library, for the tests of the CUDA backend's rooms: device
// 0's primary context retained and current. The scripted driver
// (tests/server/backend/scripted_cuda_driver.cc) counts what it holds; the emulated one
// (tests/ptxsim) implements CUDA IPC.
//
//   std::shared_ptr<const DeviceContext> ctx = DeviceOnDriver(NORMGRAD_SCRIPTED_CUDA_DRIVER);
//   size_t held = ScriptedCounter<size_t>("device_bytes");
#pragma once

#include <dlfcn.h>

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "nvidia/driver_api.h"
#include "server/cuda/device_context.h"

namespace normgrad::server::cuda_internal {

inline std::shared_ptr<const DeviceContext> DeviceOnDriver(const char* library) {
  absl::StatusOr<std::shared_ptr<const cuda::CudaDriver>> driver = cuda::CudaDriver::Load(library);
  EXPECT_TRUE(driver.ok()) << driver.status();
  if (!driver.ok()) return nullptr;
  const cuda::DriverApi& api = (*driver)->api();
  CUdevice device = 0;
  CUcontext context = nullptr;
  EXPECT_EQ(api.cuInit(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDeviceGet(&device, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDevicePrimaryCtxRetain(&context, device), CUDA_SUCCESS);
  auto ctx = std::make_shared<DeviceContext>(*driver, device, context);
  EXPECT_TRUE(ctx->MakeCurrent().ok());
  return ctx;
}

#ifdef NORMGRAD_SCRIPTED_CUDA_DRIVER
inline std::shared_ptr<const DeviceContext> ScriptedDevice() {
  return DeviceOnDriver(NORMGRAD_SCRIPTED_CUDA_DRIVER);
}

// A counter the scripted driver exports (normgrad_scripted_cuda_<name>).
template <typename T>
T ScriptedCounter(const std::string& name) {
  void* handle = dlopen(NORMGRAD_SCRIPTED_CUDA_DRIVER, RTLD_NOW | RTLD_LOCAL);
  auto fn = reinterpret_cast<T (*)()>(dlsym(handle, ("normgrad_scripted_cuda_" + name).c_str()));
  return fn != nullptr ? fn() : T{};
}
#endif

}  // namespace normgrad::server::cuda_internal
