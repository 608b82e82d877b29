#include "server/backend_factory/backend_factory.h"

#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/cpu/cpu_backend.h"
#if NORMGRAD_HAVE_CUDA_BACKEND
#include "server/cuda/cuda_backend.h"
#endif

namespace normgrad::server {

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "auto") return BackendKind::kAuto;
  if (lower == "cuda") return BackendKind::kCuda;
  if (lower == "cpu") return BackendKind::kCpu;
  return absl::InvalidArgumentError(
      absl::StrCat("backend must be auto, cuda or cpu; got \"", text, "\""));
}

namespace {

std::unique_ptr<Backend> MakeCpu(const BackendOptions& options) {
  CpuBackendOptions cpu;
  cpu.threads = options.cpu_threads;
  return NewCpuBackend(cpu);
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCuda(const BackendOptions& options) {
#if NORMGRAD_HAVE_CUDA_BACKEND
  CudaBackendOptions cuda;
  cuda.driver_library = options.cuda_driver_library;
  cuda.device_ordinal = options.device_ordinal;
  cuda.cache.max_entries = options.cache_max_entries;
  cuda.cache.max_bytes = options.cache_max_bytes;
  cuda.max_staging_bytes = options.max_staging_bytes;
  cuda.max_ipc_handles = options.max_ipc_handles;
  if (options.cuda_pipeline_piece_bytes != 0) {
    cuda.pipeline_piece_bytes = options.cuda_pipeline_piece_bytes;
  }
  cuda.host = MakeCpu(options);  // the batches no GPU kernel takes: the one CPU path
  return NewCudaBackend(cuda);
#else
  return absl::FailedPreconditionError(
      "this build has no CUDA backend (cuda.h was not found when it was configured)");
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options) {
  switch (options.kind) {
    case BackendKind::kCpu:
      return MakeCpu(options);
    case BackendKind::kCuda: {
      absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCuda(options);
      if (!cuda.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("backend=cuda: no usable GPU: ", cuda.status().message()));
      }
      return cuda;
    }
    case BackendKind::kAuto:
      break;
  }
  absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCuda(options);
  if (cuda.ok()) {
    const DeviceDescription device = (*cuda)->Device();
    std::fprintf(stderr, "normgrad: backend=cuda (auto: %s, sm_%d%d, driver %s)\n",
                 device.name.c_str(), device.compute_capability_major,
                 device.compute_capability_minor, device.driver_version.c_str());
    return cuda;
  }
  std::unique_ptr<Backend> cpu = MakeCpu(options);
  std::fprintf(stderr, "normgrad: backend=cpu (auto: %s)\n",
               std::string(cuda.status().message()).c_str());
  return cpu;
}

}  // namespace normgrad::server
