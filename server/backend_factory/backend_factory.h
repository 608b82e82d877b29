// Picks and builds the Backend a server runs on: the CUDA backend (server/cuda/) when asked for
// or, with kAuto, when a driver loads and a device is usable; else the CPU backend (server/cpu/).
// The one place that knows both implementations; everything above it sees only Backend.
//
//   BackendOptions options;
//   options.kind = BackendKind::kAuto;
//   absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(options);
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/backend/backend.h"

namespace normgrad::server {

enum class BackendKind { kAuto, kCuda, kCpu };
absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view text);  // "auto|cuda|cpu"

struct BackendOptions {
  BackendKind kind = BackendKind::kAuto;
  std::string cuda_driver_library;  // empty: $NORMGRAD_CUDA_DRIVER, else "libcuda.so.1"
  int device_ordinal = 0;
  int cpu_threads = 0;  // 0: hardware concurrency
  uint64_t cache_max_entries = 256;
  uint64_t cache_max_bytes = 256ull << 20;
  // CUDA: bound of the staging pool, pinned and device bytes each (the server passes
  // --max-inflight-bytes; cuda_backend.h).
  uint64_t max_staging_bytes = 1ull << 30;
  // CUDA IPC: device allocations of other processes kept open (--max-cuda-ipc-handles).
  uint32_t max_ipc_handles = 64;
  // CUDA: bytes of x per piece of a chunk's pipeline (cuda_backend.h); 0: the backend's
  // default (8 MiB). Tests make it small.
  uint64_t cuda_pipeline_piece_bytes = 0;
};

// kAuto: CUDA when a driver loads and a device is usable, else CPU; logs one line to stderr
// saying which it chose and why. kCuda with no usable GPU: FAILED_PRECONDITION saying why.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options);

}  // namespace normgrad::server
