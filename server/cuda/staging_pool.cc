#include "server/cuda/staging_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "base/status_macros.h"

namespace normgrad::server::cuda_internal {

StagingPool::~StagingPool() {
  for (std::unique_ptr<StagingSlot>& slot : idle_) Free(*slot);
}

absl::StatusOr<std::unique_ptr<StagingSlot>> StagingPool::Acquire(size_t host_bytes,
                                                                  size_t device_bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      const StagingSlot& s = **it;
      if (s.host_bytes < host_bytes || s.device_bytes < device_bytes) continue;
      if (best == idle_.end() ||
          s.host_bytes + s.device_bytes < (*best)->host_bytes + (*best)->device_bytes) {
        best = it;
      }
    }
    if (best != idle_.end()) {
      std::unique_ptr<StagingSlot> slot = std::move(*best);
      idle_.erase(best);
      ++lent_;
      return slot;
    }
    // No idle slot fits: free idle ones (smallest first: they fit fewer chunks) until the
    // new slot fits under the bound.
    std::sort(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
      return a->host_bytes + a->device_bytes > b->host_bytes + b->device_bytes;
    });
    while (!idle_.empty() && !FitsLocked(host_bytes, device_bytes)) {
      std::unique_ptr<StagingSlot> slot = std::move(idle_.back());
      idle_.pop_back();
      host_held_ -= slot->host_bytes;
      device_held_ -= slot->device_bytes;
      Free(*slot);
    }
    if (FitsLocked(host_bytes, device_bytes) || lent_ == 0) break;
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    returned_.wait_for(lock, std::chrono::milliseconds(100));
  }
  host_held_ += host_bytes;
  device_held_ += device_bytes;
  ++lent_;
  lock.unlock();
  auto slot = std::make_unique<StagingSlot>();
  absl::Status s = Allocate(*slot, host_bytes, device_bytes);
  if (!s.ok()) {
    Free(*slot);
    std::lock_guard<std::mutex> relock(mu_);
    host_held_ -= host_bytes;
    device_held_ -= device_bytes;
    --lent_;
    returned_.notify_all();
    return s;
  }
  return slot;
}

void StagingPool::Return(std::unique_ptr<StagingSlot> slot) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_.push_back(std::move(slot));
  --lent_;
  std::sort(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
    return a->host_bytes + a->device_bytes < b->host_bytes + b->device_bytes;
  });
  while (!idle_.empty() && !FitsLocked(0, 0)) {
    std::unique_ptr<StagingSlot> largest = std::move(idle_.back());
    idle_.pop_back();
    host_held_ -= largest->host_bytes;
    device_held_ -= largest->device_bytes;
    Free(*largest);
  }
  returned_.notify_all();
}

void StagingPool::Drop(std::unique_ptr<StagingSlot> slot) {
  bool freed = ctx_->failure().ok() && ctx_->MakeCurrent().ok();
  for (CUstream stream : slot->streams) {
    freed = freed && (stream == nullptr || ctx_->api().cuStreamSynchronize(stream) == CUDA_SUCCESS);
  }
  if (freed) Free(*slot);
  std::lock_guard<std::mutex> lock(mu_);
  if (freed) {
    host_held_ -= slot->host_bytes;
    device_held_ -= slot->device_bytes;
  }
  --lent_;
  returned_.notify_all();
}

bool StagingPool::FitsLocked(size_t host_bytes, size_t device_bytes) const {
  return host_held_ + host_bytes <= max_bytes_ && device_held_ + device_bytes <= max_bytes_;
}

absl::Status StagingPool::Allocate(StagingSlot& slot, size_t host_bytes,
                                   size_t device_bytes) const {
  const cuda::DriverApi& api = ctx_->api();
  NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
  for (CUstream& stream : slot.streams) {
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
  }
  if (host_bytes != 0) {
    void* p = nullptr;
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(api.cuMemHostAlloc(&p, host_bytes, 0), "cuMemHostAlloc"));
    slot.host = static_cast<uint8_t*>(p);
    slot.host_bytes = host_bytes;
  }
  if (device_bytes != 0) {
    NORMGRAD_ASSIGN_OR_RETURN(slot.device, AllocateDevice(slot.streams[0], device_bytes));
    slot.device_bytes = device_bytes;
  }
  for (int i = 0; i < StagingSlot::kStreams; ++i) {
    NORMGRAD_ASSIGN_OR_RETURN(slot.semaphores[i],
                              AllocateDevice(slot.streams[i], StagingSlot::kSemaphoreBytes));
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
        api.cuMemsetD32Async(slot.semaphores[i], 0, StagingSlot::kSemaphoreBytes / sizeof(uint32_t),
                             slot.streams[i]),
        "cuMemsetD32Async(semaphores)"));
  }
  for (CUstream stream : slot.streams) {
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(api.cuStreamSynchronize(stream), "cuStreamSynchronize"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CUdeviceptr> StagingPool::AllocateDevice(CUstream stream, size_t bytes) const {
  const cuda::DriverApi& api = ctx_->api();
  CUdeviceptr p = 0;
  NORMGRAD_RETURN_IF_ERROR(
      ctx_->stream_ordered ? ctx_->Check(api.cuMemAllocAsync(&p, bytes, stream), "cuMemAllocAsync")
                           : ctx_->Check(api.cuMemAlloc_v2(&p, bytes), "cuMemAlloc"));
  return p;
}

void StagingPool::Free(StagingSlot& slot) const {
  if (!ctx_->failure().ok() || !ctx_->MakeCurrent().ok()) return;
  const cuda::DriverApi& api = ctx_->api();
  for (const CUdeviceptr p : {slot.device, slot.semaphores[0], slot.semaphores[1]}) {
    if (p == 0) continue;
    if (ctx_->stream_ordered && slot.streams[0] != nullptr) {
      api.cuMemFreeAsync(p, slot.streams[0]);
    } else {
      api.cuMemFree_v2(p);
    }
  }
  for (CUstream stream : slot.streams) {
    if (stream == nullptr) continue;
    api.cuStreamSynchronize(stream);
    api.cuStreamDestroy_v2(stream);
  }
  if (slot.host != nullptr) api.cuMemFreeHost(slot.host);
  slot = StagingSlot{};
}

}  // namespace normgrad::server::cuda_internal
