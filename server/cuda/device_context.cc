#include "server/cuda/device_context.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"

namespace normgrad::server::cuda_internal {

DeviceContext::DeviceContext(std::shared_ptr<const cuda::CudaDriver> driver, CUdevice device,
                             CUcontext context)
    : driver_(std::move(driver)), device_(device), context_(context) {}

DeviceContext::~DeviceContext() { api().cuDevicePrimaryCtxRelease_v2(device_); }

absl::Status DeviceContext::Check(CUresult r, absl::string_view call) const {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  absl::Status s = driver_->Check(r, call);
  if (!cuda::IsDeviceLost(r)) return s;
  Fail(s);
  return failure();
}

absl::Status DeviceContext::failure() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  return failure_;
}

void DeviceContext::set_failure_handler(DeviceBackend::FailureHandler handler) const {
  std::lock_guard<std::mutex> lock(health_mu_);
  failure_handler_ = std::move(handler);
}

void DeviceContext::Fail(const absl::Status& reason) const {
  DeviceBackend::FailureHandler handler;
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    if (!failure_.ok()) return;
    failure_ = absl::UnavailableError(
        absl::StrCat("the GPU failed and this server cannot use it any more: ", reason.message()));
    status = failure_;
    handler = failure_handler_;
  }
  if (handler) handler(status);
}

absl::Status DeviceContext::Synchronize(CUstream stream) const {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    id = next_wait_id_++;
    waits_[id] = absl::Now();
  }
  const CUresult r = api().cuStreamSynchronize(stream);
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    waits_.erase(id);
  }
  return Check(r, "cuStreamSynchronize");
}

absl::Status DeviceContext::CheckProgress(absl::Duration bound) const {
  absl::Duration longest = absl::ZeroDuration();
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    if (!failure_.ok() || bound <= absl::ZeroDuration()) return failure_;
    const absl::Time now = absl::Now();
    for (const auto& [id, since] : waits_) longest = std::max(longest, now - since);
  }
  if (longest > bound) {
    Fail(absl::DeadlineExceededError(absl::StrCat(
        "cuStreamSynchronize has not returned for ", absl::FormatDuration(longest),
        ", more than the device timeout of ", absl::FormatDuration(bound), " (the GPU is hung)")));
  }
  return failure();
}

absl::Status DeviceContext::MakeCurrent() const {
  return Check(api().cuCtxSetCurrent(context_), "cuCtxSetCurrent");
}

absl::Status DeviceContext::RegisterHost(void* base, uint64_t bytes) const {
  if (api().cuMemHostRegister_v2 == nullptr || api().cuMemHostUnregister == nullptr) {
    return absl::UnimplementedError("the driver has no cuMemHostRegister");
  }
  NORMGRAD_RETURN_IF_ERROR(MakeCurrent());
  NORMGRAD_RETURN_IF_ERROR(Check(
      api().cuMemHostRegister_v2(base, bytes, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister"));
  std::lock_guard<std::mutex> lock(host_mu_);
  host_ranges_[reinterpret_cast<uintptr_t>(base)] = bytes;
  return absl::OkStatus();
}

void DeviceContext::UnregisterHost(void* base) const {
  {
    std::lock_guard<std::mutex> lock(host_mu_);
    if (host_ranges_.erase(reinterpret_cast<uintptr_t>(base)) == 0) return;
  }
  if (MakeCurrent().ok()) (void)api().cuMemHostUnregister(base);
}

bool DeviceContext::IsRegisteredHost(const void* p, uint64_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(host_mu_);
  auto it = host_ranges_.upper_bound(a);
  if (it == host_ranges_.begin()) return false;
  --it;
  return a - it->first <= it->second && bytes <= it->second - (a - it->first);
}

}  // namespace normgrad::server::cuda_internal
