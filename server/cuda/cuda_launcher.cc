#include "server/cuda/cuda_launcher.h"

#include "absl/strings/str_cat.h"

namespace normgrad::server::cuda_internal {

absl::Status CudaLauncher::Launch(const kernels::LaunchGeometry& g, void** args) {
  const DeviceContext& ctx = *module_.ctx;
  return ctx.Check(
      ctx.api().cuLaunchKernel(module_.function, g.grid[0], g.grid[1], g.grid[2], g.block[0],
                               g.block[1], g.block[2], g.shared_bytes, stream_, args, nullptr),
      absl::StrCat("cuLaunchKernel(", module_.entry, ")"));
}

absl::Status CudaLauncher::ZeroFill(uint64_t address, uint64_t bytes) {
  const DeviceContext& ctx = *module_.ctx;
  return ctx.Check(ctx.api().cuMemsetD32Async(address, 0, bytes / sizeof(uint32_t), stream_),
                   absl::StrCat("cuMemsetD32Async(", module_.entry, ")"));
}

}  // namespace normgrad::server::cuda_internal
