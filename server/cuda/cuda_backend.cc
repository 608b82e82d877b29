#include "server/cuda/cuda_backend.h"

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backward_kernel.h"
#include "kernels/rmsnorm/kernel_choice.h"
#include "base/status_macros.h"
#include "nvidia/driver_api.h"
#include "server/backend/batch_checks.h"
#include "server/cuda/cuda_session.h"
#include "server/cuda/device_context.h"
#include "server/cuda/ipc_buffer_cache.h"
#include "server/cuda/module_loader.h"
#include "server/cuda/staging_pool.h"

namespace normgrad::server {
namespace {

using cuda::CudaDriver;
using cuda_internal::CudaBackwardSession;
using cuda_internal::DeviceContext;
using cuda_internal::IpcBufferCache;
using cuda_internal::LoadedModule;
using cuda_internal::LoadModule;
using cuda_internal::StagingPool;

// A batch the CPU backend computes for this backend: its session, which takes no chunk in
// device memory (the rows would have to come back to the host first: the client sends them as
// bytes or in shared memory instead).
class HostRowsSession final : public BackwardSession {
 public:
  HostRowsSession(std::unique_ptr<BackwardSession> rows, uint32_t hidden_dim)
      : rows_(std::move(rows)), hidden_dim_(hidden_dim) {}
  absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows,
                            absl::Span<uint8_t> dx) override {
    return rows_->ProcessChunk(x, dy, rms, rows, dx);
  }
  absl::Status ProcessDeviceChunk(const DeviceRows&) override {
    return absl::FailedPreconditionError(absl::StrCat(
        "no GPU kernel takes a given rms for rows of hidden_dim = ", hidden_dim_,
        " (> 32): this server computes such chunks on the host, so send them as bytes or in "
        "shared memory, not in device memory"));
  }
  absl::Status Finish(absl::Span<uint8_t> dgamma) override { return rows_->Finish(dgamma); }
  absl::string_view KernelName() const override { return rows_->KernelName(); }
  double ComputeSeconds() const override { return rows_->ComputeSeconds(); }

 private:
  const std::unique_ptr<BackwardSession> rows_;
  const uint32_t hidden_dim_;
};

class CudaBackend : public Backend, public DeviceBackend {
 public:
  // uuid: the device's 16 bytes, empty when the driver has no CUDA IPC.
  CudaBackend(std::shared_ptr<const DeviceContext> ctx, DeviceDescription device, int target_sm,
              ModuleCacheOptions cache, uint64_t max_staging_bytes, std::string uuid,
              uint32_t max_ipc_handles, uint64_t pipeline_piece_bytes,
              std::shared_ptr<Backend> host)
      : ctx_(std::move(ctx)),
        device_(std::move(device)),
        target_sm_(target_sm),
        cache_(cache),
        staging_(std::make_shared<StagingPool>(ctx_, max_staging_bytes)),
        uuid_(std::move(uuid)),
        ipc_(ctx_, max_ipc_handles),
        pipeline_piece_bytes_(pipeline_piece_bytes),
        host_(std::move(host)) {}

  ~CudaBackend() override { cache_.Clear(); }

  absl::string_view Name() const override { return "cuda"; }
  DeviceDescription Device() const override { return device_; }

  absl::StatusOr<std::unique_ptr<BackwardSession>> StartBackward(
      const kernels::BackwardRequest& spec, absl::Span<const uint8_t> gamma) override {
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckBatch(spec, gamma.size()));
    const kernels::BackwardRequest& request = spec;
    // sm_count sizes the row-resident kernel's persistent grid.
    const kernels::BackwardDevice device{target_sm_, device_.sm_count};
    NORMGRAD_ASSIGN_OR_RETURN(const kernels::BackwardKernel* kernel,
                              kernels::ChooseBackwardKernel(request, device));
    if (kernel == nullptr) return StartOnHost(spec, gamma);
    const kernels::KernelConfig config = kernels::ConfigFor(request, device);
    NORMGRAD_RETURN_IF_ERROR(CheckRunsOnThisGpu(*kernel, config));
    NORMGRAD_ASSIGN_OR_RETURN(kernels::BackwardPlan plan,
                              kernels::BackwardPlan::Create(*kernel, config));
    NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const LoadedModule> module,
                              GetModule(*kernel, config));
    return std::unique_ptr<BackwardSession>(std::make_unique<CudaBackwardSession>(
        ctx_, spec, std::move(plan), std::move(module),
        std::vector<uint8_t>(gamma.begin(), gamma.end()), staging_, pipeline_piece_bytes_));
  }

  absl::Status Preload(const kernels::BackwardKernel& kernel,
                       const kernels::KernelConfig& config) override {
    kernels::KernelConfig for_device = config;
    for_device.target_sm = target_sm_;  // modules are compiled for this backend's GPU
    for_device.sm_count = device_.sm_count;
    return GetModule(kernel, for_device).status();
  }

  ModuleCacheStats CacheStats() const override { return cache_.Stats(); }

  DeviceBackend* device() override { return this; }

  absl::Status RegisterHostMemory(void* base, uint64_t bytes) override {
    return ctx_->RegisterHost(base, bytes);
  }
  void UnregisterHostMemory(void* base) override { ctx_->UnregisterHost(base); }

  std::string DeviceUuid() const override { return uuid_; }
  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> OpenIpcBuffer(
      absl::string_view handle) override {
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    if (uuid_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(ctx_->driver().path(), " has no CUDA IPC (cuIpcOpenMemHandle)"));
    }
    return ipc_.Open(handle);
  }

  void SetFailureHandler(FailureHandler handler) override {
    ctx_->set_failure_handler(std::move(handler));
  }
  absl::Status CheckDevice(absl::Duration bound) override { return ctx_->CheckProgress(bound); }

 private:
  // A batch no GPU kernel takes (a given rms with rows too wide for every kernel that reads
  // one): the CPU backend's session, the one CPU path, takes it whole.
  absl::StatusOr<std::unique_ptr<BackwardSession>> StartOnHost(
      const kernels::BackwardRequest& spec, absl::Span<const uint8_t> gamma) {
    if (host_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no GPU kernel takes this batch (hidden_dim = ", spec.hidden_dim,
          ", a given rms) and this backend has no CPU path"));
    }
    NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<BackwardSession> rows,
                              host_->StartBackward(spec, gamma));
    return std::unique_ptr<BackwardSession>(
        std::make_unique<HostRowsSession>(std::move(rows), spec.hidden_dim));
  }

  // CanImplement's status, except FAILED_PRECONDITION when the request is fine but this GPU
  // cannot run the kernel (bf16 below sm_80, say).
  absl::Status CheckRunsOnThisGpu(const kernels::BackwardKernel& kernel,
                                  const kernels::KernelConfig& config) const {
    absl::Status s = kernel.CanImplement(config);
    if (s.ok()) return s;
    kernels::KernelConfig elsewhere = config;
    elsewhere.target_sm = kernels::kProbeTargetSm;
    if (kernel.CanImplement(elsewhere).ok()) {
      return absl::FailedPreconditionError(absl::StrCat("GPU ", device_.name, " (sm_", target_sm_,
                                                        ") cannot run ", kernel.EntryName(), ": ",
                                                        s.message()));
    }
    return s;
  }

  absl::StatusOr<std::shared_ptr<const LoadedModule>> GetModule(
      const kernels::BackwardKernel& kernel, const kernels::KernelConfig& config) {
    NORMGRAD_RETURN_IF_ERROR(CheckRunsOnThisGpu(kernel, config));
    return cache_.GetOrCompile(
        kernel.ConfigKey(config), [&]() -> absl::StatusOr<ModuleCache<LoadedModule>::Compiled> {
          NORMGRAD_ASSIGN_OR_RETURN(const kernels::EmittedPtx ptx, kernel.Emit(config));
          NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const LoadedModule> loaded,
                                    LoadModule(ctx_, ptx));
          return ModuleCache<LoadedModule>::Compiled{std::move(loaded), ptx.text.size()};
        });
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const DeviceDescription device_;
  const int target_sm_;
  ModuleCache<LoadedModule> cache_;
  const std::shared_ptr<StagingPool> staging_;  // shared with the sessions
  const std::string uuid_;
  IpcBufferCache ipc_;
  const uint64_t pipeline_piece_bytes_;
  const std::shared_ptr<Backend> host_;  // the one CPU path (CudaBackendOptions::host)
};

// Device set-up on a loaded driver (see cuda_backend.h); any failure means no usable GPU.
absl::StatusOr<std::unique_ptr<Backend>> OpenDevice(std::shared_ptr<const CudaDriver> driver,
                                                    const CudaBackendOptions& options) {
  const cuda::DriverApi& api = driver->api();
  NORMGRAD_RETURN_IF_ERROR(driver->Check(api.cuInit(0), "cuInit"));
  int driver_version = 0;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDriverGetVersion(&driver_version), "cuDriverGetVersion"));
  int count = 0;
  NORMGRAD_RETURN_IF_ERROR(driver->Check(api.cuDeviceGetCount(&count), "cuDeviceGetCount"));
  if (count < 1) return absl::FailedPreconditionError("no CUDA device");
  if (options.device_ordinal < 0 || options.device_ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat("device ordinal ", options.device_ordinal,
                                                      " out of range (", count, " devices)"));
  }
  CUdevice device = 0;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDeviceGet(&device, options.device_ordinal), "cuDeviceGet"));
  DeviceDescription d;
  char name[256] = {};
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName"));
  d.name = name;
  int major = 0, minor = 0, sms = 0, max_grid_x = 0, pools = 0;
  for (auto [attribute, out, label] :
       {std::tuple{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &major,
                   "compute capability major"},
        std::tuple{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &minor,
                   "compute capability minor"},
        std::tuple{CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &sms, "multiprocessor count"},
        std::tuple{CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, &max_grid_x, "max grid dim x"}}) {
    NORMGRAD_RETURN_IF_ERROR(driver->Check(api.cuDeviceGetAttribute(out, attribute, device),
                                           absl::StrCat("cuDeviceGetAttribute(", label, ")")));
  }
  size_t total = 0;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDeviceTotalMem_v2(&total, device), "cuDeviceTotalMem"));
  d.compute_capability_major = major;
  d.compute_capability_minor = minor;
  d.total_memory_bytes = total;
  d.driver_version = cuda::DriverVersionString(driver_version);
  d.max_ptx_version = cuda::MaxPtxVersionForDriver(driver_version);
  d.sm_count = static_cast<uint32_t>(sms);

  CUcontext context = nullptr;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain"));
  auto ctx = std::make_shared<DeviceContext>(driver, device, context);
  ctx->max_grid_x = max_grid_x > 0 ? static_cast<uint32_t>(max_grid_x) : 65535u;
  NORMGRAD_RETURN_IF_ERROR(ctx->MakeCurrent());

  // Stream-ordered allocation with a raised release threshold, when the driver and device
  // have memory pools; otherwise plain cuMemAlloc.
  if (driver->HasStreamOrderedAllocation() &&
      api.cuDeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, device) ==
          CUDA_SUCCESS &&
      pools != 0) {
    CUmemoryPool pool = nullptr;
    cuuint64_t threshold = std::numeric_limits<cuuint64_t>::max();
    ctx->stream_ordered = api.cuDeviceGetDefaultMemPool(&pool, device) == CUDA_SUCCESS &&
                          api.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                                    &threshold) == CUDA_SUCCESS;
  }
  std::string uuid;
  CUuuid id;
  if (driver->HasIpc() && api.cuDeviceGetUuid_v2(&id, device) == CUDA_SUCCESS) {
    uuid.assign(id.bytes, sizeof(id.bytes));
  }
  return std::unique_ptr<Backend>(new CudaBackend(
      std::move(ctx), std::move(d), major * 10 + minor, options.cache, options.max_staging_bytes,
      std::move(uuid), options.max_ipc_handles, options.pipeline_piece_bytes, options.host));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options) {
  const std::string path = cuda::ResolveDriverLibrary(options.driver_library);
  NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const CudaDriver> driver, CudaDriver::Load(path));
  absl::StatusOr<std::unique_ptr<Backend>> backend = OpenDevice(std::move(driver), options);
  if (!backend.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", backend.status().message()));
  }
  return backend;
}

}  // namespace normgrad::server
