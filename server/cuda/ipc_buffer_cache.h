// Device memory of other processes (CUDA IPC), opened with cuIpcOpenMemHandle and kept open in a
// bounded cache keyed by the handle's bytes, least recently used closed first (a buffer still
// computing is closed when its last holder lets go). The driver counts opens of one handle per
// context, so every entry is one open and one close. Thread-safe.
//
//   IpcBufferCache cache(ctx, /*max_open=*/64);
//   absl::StatusOr<std::shared_ptr<const DeviceBuffer>> b = cache.Open(handle_bytes);
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/backend/backend.h"
#include "server/cuda/device_context.h"

namespace normgrad::server::cuda_internal {

class IpcBufferCache {
 public:
  IpcBufferCache(std::shared_ptr<const DeviceContext> ctx, uint32_t max_open)
      : ctx_(std::move(ctx)), max_open_(std::max<uint32_t>(1, max_open)) {}

  // The allocation `handle` (CU_IPC_HANDLE_SIZE bytes) names. INVALID_ARGUMENT for a handle of
  // another size or one the driver refuses (its buffer freed, its process gone, another GPU).
  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> Open(absl::string_view handle);

 private:
  const std::shared_ptr<const DeviceContext> ctx_;
  const uint32_t max_open_;
  mutable std::mutex mu_;
  // Most recently used first; a handle's bytes -> its opened buffer. Guarded by mu_.
  std::list<std::pair<std::string, std::shared_ptr<const DeviceBuffer>>> lru_;
};

}  // namespace normgrad::server::cuda_internal
