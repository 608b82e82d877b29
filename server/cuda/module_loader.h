// Emitted PTX loaded into a device's context (cuModuleLoadDataEx, the driver's JIT), with its
// kernel entry and parameter list; what the backend's module cache holds.
//
//   NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const LoadedModule> m, LoadModule(ctx, ptx));
//   CudaLauncher launcher(*m, stream);   // server/cuda/cuda_launcher.h
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kernel_config.h"
#include "nvidia/driver_api.h"
#include "server/cuda/device_context.h"

namespace normgrad::server::cuda_internal {

// A module loaded into the device's context, with its kernel entry. Unloaded when the cache has
// evicted it and no session holds it any more.
struct LoadedModule {
  std::shared_ptr<const DeviceContext> ctx;
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  std::string entry;
  std::vector<kernels::KernelParam> params;

  ~LoadedModule();
};

// cuModuleLoadDataEx with the JIT error log captured, then the entry's function. A failure
// carries the log: FAILED_PRECONDITION when the PTX is newer than the driver or there is no code
// for this GPU, UNAVAILABLE when the device failed, INTERNAL for anything else the JIT refused.
absl::StatusOr<std::shared_ptr<const LoadedModule>> LoadModule(
    const std::shared_ptr<const DeviceContext>& ctx, const kernels::EmittedPtx& ptx);

}  // namespace normgrad::server::cuda_internal
