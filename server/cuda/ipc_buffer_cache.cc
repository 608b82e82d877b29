#include "server/cuda/ipc_buffer_cache.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace normgrad::server::cuda_internal {

absl::StatusOr<std::shared_ptr<const DeviceBuffer>> IpcBufferCache::Open(absl::string_view handle) {
  if (handle.size() != sizeof(CUipcMemHandle)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle has ", sizeof(CUipcMemHandle),
                                                   " bytes, not ", handle.size()));
  }
  std::lock_guard<std::mutex> lock(mu_);  // one open at a time: the driver's count stays 1
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    if (it->first == handle) {
      lru_.splice(lru_.begin(), lru_, it);
      return lru_.front().second;
    }
  }
  NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
  CUipcMemHandle h;
  std::memcpy(h.reserved, handle.data(), sizeof(h.reserved));
  CUdeviceptr base = 0;
  const CUresult r =
      ctx_->api().cuIpcOpenMemHandle_v2(&base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_INVALID_VALUE ||
      r == CUDA_ERROR_INVALID_DEVICE || r == CUDA_ERROR_INVALID_CONTEXT ||
      r == CUDA_ERROR_MAP_FAILED) {
    // The client's mistake, not the server's: name the driver's reason.
    return absl::InvalidArgumentError(absl::StrCat(
        ctx_->driver().Check(r, "cuIpcOpenMemHandle").message(),
        " (the buffer was freed or its process exited, it is on another GPU, or the handle "
        "was exported by the server's own process)"));
  }
  NORMGRAD_RETURN_IF_ERROR(ctx_->Check(r, "cuIpcOpenMemHandle"));
  size_t bytes = 0;
  CUdeviceptr range_base = 0;
  if (absl::Status s = ctx_->Check(ctx_->api().cuMemGetAddressRange_v2(&range_base, &bytes, base),
                                   "cuMemGetAddressRange");
      !s.ok()) {
    ctx_->api().cuIpcCloseMemHandle(base);
    return s;
  }
  auto opened =
      std::shared_ptr<DeviceBuffer>(new DeviceBuffer{base, bytes}, [ctx = ctx_](DeviceBuffer* b) {
        if (ctx->MakeCurrent().ok()) {
          ctx->api().cuIpcCloseMemHandle(b->address);
        }
        delete b;
      });
  lru_.emplace_front(std::string(handle), opened);
  while (lru_.size() > max_open_) lru_.pop_back();
  return std::shared_ptr<const DeviceBuffer>(std::move(opened));
}

}  // namespace normgrad::server::cuda_internal
