// The retained primary context of one CUDA device, shared by the backend, its sessions, its
// staging pool and its cached modules; released when the last of them is gone. Also the device's
// health (a failure seen once is the device's for good) and the host ranges registered with the
// driver. Thread-safe.
//
//   auto ctx = std::make_shared<DeviceContext>(driver, device, context);  // after Retain
//   NORMGRAD_RETURN_IF_ERROR(ctx->MakeCurrent());          // every thread that issues work
//   NORMGRAD_RETURN_IF_ERROR(ctx->Check(ctx->api().cuMemAlloc_v2(&p, n), "cuMemAlloc"));
//   NORMGRAD_RETURN_IF_ERROR(ctx->Synchronize(stream));    // watched by CheckProgress
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "nvidia/driver_api.h"
#include "server/backend/backend.h"

namespace normgrad::server::cuda_internal {

class DeviceContext {
 public:
  // `context`: the device's primary context, retained by the caller; released by the destructor.
  DeviceContext(std::shared_ptr<const cuda::CudaDriver> driver, CUdevice device, CUcontext context);
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;
  ~DeviceContext();

  const cuda::DriverApi& api() const { return driver_->api(); }
  const cuda::CudaDriver& driver() const { return *driver_; }
  CUdevice device() const { return device_; }

  // CudaDriver::Check; an error that means the device is lost (cuda::IsDeviceLost) marks the
  // device failed and returns the failure (UNAVAILABLE, "the GPU failed ...: <call> failed: ...").
  absl::Status Check(CUresult r, absl::string_view call) const;

  // The device's failure (UNAVAILABLE) once one was seen, else OK.
  absl::Status failure() const;
  void set_failure_handler(DeviceBackend::FailureHandler handler) const;
  // Marks the device failed for good (the first reason stays) and calls the handler, once.
  void Fail(const absl::Status& reason) const;

  // cuStreamSynchronize, counted as outstanding while it waits: a wait that exceeds the device
  // watchdog's bound is a hung device (CheckProgress). The driver's wait has no timeout and
  // cannot be interrupted; the thread stays blocked.
  absl::Status Synchronize(CUstream stream) const;
  // failure(), after turning a synchronize that has waited for longer than `bound` (zero: no
  // bound) into the device's failure.
  absl::Status CheckProgress(absl::Duration bound) const;

  // Every thread that issues work calls this first (cuCtxSetCurrent).
  absl::Status MakeCurrent() const;

  // Host ranges registered with the driver (page-locked in place): copies go straight between
  // them and the device, with no staging copy.
  absl::Status RegisterHost(void* base, uint64_t bytes) const;
  void UnregisterHost(void* base) const;
  // Whether [p, p + bytes) lies inside one registered range.
  bool IsRegisteredHost(const void* p, uint64_t bytes) const;

  bool stream_ordered = false;  // set once during start-up
  uint32_t max_grid_x = 65535;  // set once during start-up

 private:
  std::shared_ptr<const cuda::CudaDriver> driver_;
  CUdevice device_;
  CUcontext context_;
  mutable std::mutex host_mu_;
  mutable std::map<uintptr_t, uint64_t> host_ranges_;  // base -> bytes; guarded by host_mu_
  mutable std::mutex health_mu_;
  mutable absl::Status failure_;                           // guarded by health_mu_
  mutable DeviceBackend::FailureHandler failure_handler_;  // guarded by health_mu_
  mutable uint64_t next_wait_id_ = 0;                      // guarded by health_mu_
  mutable std::map<uint64_t, absl::Time> waits_;  // synchronizes waiting: id -> start; health_mu_
};

}  // namespace normgrad::server::cuda_internal
