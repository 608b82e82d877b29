// The backend's staging slots: the work area of one chunk on the device (two streams, pinned host
// memory, device memory and the kernels' semaphores), lent for one ProcessChunk call and given
// back once its streams are synchronized, so an idle session holds none and slots are reused
// across sessions and RPCs. Thread-safe.
//
// Bound: the pinned bytes of all slots, lent or idle, stay within max_bytes, and so do the device
// bytes; a slot that alone is larger is still lent when no other slot is held (and freed when it
// comes back). A chunk that would pass the bound first frees idle slots, then waits for a lent
// one to come back (the device's failure ends the wait).
//
//   StagingPool pool(ctx, /*max_bytes=*/1 << 30);
//   NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<StagingSlot> slot, pool.Acquire(host, device));
//   ... work on slot->streams[0] and [1], synchronized
//   ok ? pool.Return(std::move(slot)) : pool.Drop(std::move(slot));
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nvidia/driver_api.h"
#include "server/cuda/device_context.h"

namespace normgrad::server::cuda_internal {

// One chunk's work area on the device. A chunk's pieces alternate between the two streams
// (CudaBackwardSession), so one piece's copies overlap the other's kernel.
struct StagingSlot {
  static constexpr int kStreams = 2;
  // The kernels' semaphores (kernels::BackwardArgs::semaphores) for every launch on stream i:
  // semaphores[i], zeroed once when the slot is made; every completed run leaves them zero, and
  // a slot whose chunk failed is dropped, not reused. 1024 counters each: a grid of up to
  // ~15,000 blocks.
  static constexpr size_t kSemaphoreBytes = 4096;

  CUstream streams[kStreams] = {};
  uint8_t* host = nullptr;  // cuMemHostAlloc
  size_t host_bytes = 0;
  CUdeviceptr device = 0;  // stream-ordered on streams[0] when the device has pools
  size_t device_bytes = 0;
  CUdeviceptr semaphores[kStreams] = {};  // kSemaphoreBytes each, likewise
};

class StagingPool {
 public:
  StagingPool(std::shared_ptr<const DeviceContext> ctx, uint64_t max_bytes)
      : ctx_(std::move(ctx)), max_bytes_(max_bytes) {}
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  ~StagingPool();

  // A slot with at least `host_bytes` pinned and `device_bytes` of device memory: an idle one
  // that is large enough (the smallest such), else a new one (idle slots freed first to make
  // room under the bound, else waiting for a lent one to come back).
  absl::StatusOr<std::unique_ptr<StagingSlot>> Acquire(size_t host_bytes, size_t device_bytes);

  // A slot whose streams have no work left (synchronized), kept for reuse; but while the pool
  // holds more than its bound (a slot lent alone above it), idle slots are freed, largest
  // first, until it is back under the bound.
  void Return(std::unique_ptr<StagingSlot> slot);

  // A slot after a failed chunk: freed once its streams are idle. On a failed device nothing is
  // freed (a synchronize might never return; the process is going away) and its bytes stay
  // counted.
  void Drop(std::unique_ptr<StagingSlot> slot);

 private:
  bool FitsLocked(size_t host_bytes, size_t device_bytes) const;
  // Streams, pinned and device memory, zeroed semaphores; both streams synchronized at the end,
  // so memory allocated in stream order on one of them is usable on either from then on.
  absl::Status Allocate(StagingSlot& slot, size_t host_bytes, size_t device_bytes) const;
  absl::StatusOr<CUdeviceptr> AllocateDevice(CUstream stream, size_t bytes) const;
  // Frees what `slot` holds (its streams have no work left). Nothing on a failed device.
  void Free(StagingSlot& slot) const;

  const std::shared_ptr<const DeviceContext> ctx_;
  const uint64_t max_bytes_;
  std::mutex mu_;
  std::condition_variable returned_;
  std::vector<std::unique_ptr<StagingSlot>> idle_;  // guarded by mu_
  uint64_t host_held_ = 0;                          // lent and idle; guarded by mu_
  uint64_t device_held_ = 0;                        // lent and idle; guarded by mu_
  uint32_t lent_ = 0;                               // guarded by mu_
};

}  // namespace normgrad::server::cuda_internal
