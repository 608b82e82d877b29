// Where a backward kernel's launches go on a GPU: one loaded module and one stream, a value made
// for each run (kernels::BackwardKernel::Run), so the stream is never state of its owner.
//
//   CudaLauncher launcher(*module, stream);
//   NORMGRAD_RETURN_IF_ERROR(plan.Run(args, launcher));   // cuLaunchKernel on `stream`
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backward_kernel.h"
#include "nvidia/driver_api.h"
#include "server/cuda/module_loader.h"

namespace normgrad::server::cuda_internal {

class CudaLauncher : public kernels::KernelLauncher {
 public:
  // `module` outlives the launcher.
  CudaLauncher(const LoadedModule& module, CUstream stream) : module_(module), stream_(stream) {}

  absl::Span<const kernels::KernelParam> Params() const override { return module_.params; }
  uint32_t MaxGridX() const override { return module_.ctx->max_grid_x; }
  // cuLaunchKernel of the module's function on the stream.
  absl::Status Launch(const kernels::LaunchGeometry& geometry, void** args) override;
  // cuMemsetD32Async on the stream.
  absl::Status ZeroFill(uint64_t address, uint64_t bytes) override;

 private:
  const LoadedModule& module_;
  const CUstream stream_;
};

}  // namespace normgrad::server::cuda_internal
