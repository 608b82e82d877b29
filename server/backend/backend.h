// The compute interface the gRPC service drives, with two real implementations: CUDA
// (server/cuda/, Driver API loaded at run time) and CPU (server/cpu/, multi-threaded, Highway
// SIMD). No gRPC types cross it, so the GPU path builds and is tested on machines without gRPC
// libraries. This folder holds the interface and what both implementations share (batch_checks.h,
// backward_session_base.h), never an implementation: CreateBackend (server/backend_factory/)
// picks one.
//
//   absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(options);
//   auto session = (*backend)->StartBackward(spec, gamma_bytes);   // validates, compiles
//   for (each chunk) (*session)->ProcessChunk(x, dy, rms, rows, dx);  // blocking, in order
//   (*session)->Finish(dgamma_bytes);
//
// Threading: a Backend is shared by all streams and is thread-safe. A BackwardSession belongs
// to one stream and is used by one thread at a time. ProcessChunk blocks until dx is written:
// the service calls it from a worker thread, never inside a gRPC reaction.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_choice.h"
#include "server/cache/module_cache.h"

namespace normgrad::server {

struct DeviceDescription {
  std::string name;                 // "cpu: 2 threads, AVX2" or the GPU's name
  int compute_capability_major = 0; // 0 on the CPU backend
  int compute_capability_minor = 0;
  uint64_t total_memory_bytes = 0;
  std::string driver_version;       // "13.0"; empty on the CPU backend
  std::string max_ptx_version;      // highest PTX ISA the driver accepts; empty on CPU
  uint32_t sm_count = 0;            // multiprocessors (CPU: worker threads)
};

// The size of a CUDA IPC memory handle (cuda.h's CU_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// Device memory another process on this GPU exported (cuIpcGetMemHandle), opened by the
// backend: the allocation's base address in this process and its size. It stays open while
// any holder keeps the shared_ptr (and the backend's bounded cache may hold it longer).
struct DeviceBuffer {
  uint64_t address = 0;
  uint64_t bytes = 0;
};

// One chunk whose x, dy, rms and dx are device addresses (inside opened DeviceBuffers; the
// caller checked every range): rows * hidden_dim elements of the dtype each, rms: `rows` f32
// (0 unless rms_provided).
struct DeviceRows {
  uint64_t x = 0, dy = 0, rms = 0, dx = 0;
  uint64_t rows = 0;
};

class BackwardSession {
 public:
  virtual ~BackwardSession() = default;

  // One chunk of whole rows, in batch order. x, dy, dx: rows * hidden_dim elements of the
  // batch's dtype as raw little-endian bytes; rms: `rows` floats when rms_provided, else empty.
  // grad_gamma is accumulated inside the session in a fixed order (same input and chunking,
  // same bits where the backend documents it).
  virtual absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                                    absl::Span<const float> rms, uint64_t rows,
                                    absl::Span<uint8_t> dx) = 0;

  // The same for a chunk in device memory (CUDA IPC): computed on the device in place, with
  // no host copy of the rows. FAILED_PRECONDITION on a backend without a device.
  virtual absl::Status ProcessDeviceChunk(const DeviceRows& rows) {
    return absl::FailedPreconditionError("this backend computes no chunk in device memory");
  }

  // Writes grad_gamma (hidden_dim elements of the dtype; none, an empty span, for a batch without
  // gamma). Call once, after the last chunk.
  virtual absl::Status Finish(absl::Span<uint8_t> dgamma) = 0;

  virtual absl::string_view KernelName() const = 0;  // what ran ("cpu_highway" on CPU)
  virtual double ComputeSeconds() const = 0;         // time spent inside the backend so far
};

class DeviceBackend;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::string_view Name() const = 0;  // "cpu" or "cuda"
  virtual DeviceDescription Device() const = 0;

  // gamma: hidden_dim elements of spec.dtype. Errors: INVALID_ARGUMENT (unknown kernel,
  // CanImplement), RESOURCE_EXHAUSTED (device memory), INTERNAL (JIT log), UNAVAILABLE.
  virtual absl::StatusOr<std::unique_ptr<BackwardSession>> StartBackward(
      const kernels::BackwardRequest& spec, absl::Span<const uint8_t> gamma) = 0;

  // Compiles (or finds) the module for `config` of `kernel` ahead of use (--preload).
  // The CPU backend has nothing to compile and returns OK.
  virtual absl::Status Preload(const kernels::BackwardKernel& kernel,
                               const kernels::KernelConfig& config) = 0;

  // Statistics of the backend's module cache (all zeros on the CPU backend).
  virtual ModuleCacheStats CacheStats() const = 0;

  // What only a backend with a device can do (DeviceBackend, below); null for one without
  // (the CPU backend). Asked for where it is needed: shared-memory registration, CUDA IPC, the
  // device's failure and its watchdog.
  virtual DeviceBackend* device() { return nullptr; }
};

// The device side of a backend (the CUDA backend's), asked for through Backend::device().
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // Host memory that chunks will be read from and written to in place (a client's shared-memory
  // region, mapped by the server), for as long as it stays registered: registered with the
  // driver (cuMemHostRegister), so that copies go straight between it and the device. An error
  // only means the backend stages such chunks like any other.
  virtual absl::Status RegisterHostMemory(void* base, uint64_t bytes) = 0;
  virtual void UnregisterHostMemory(void* base) = 0;

  // CUDA IPC. DeviceUuid: the GPU's 16-byte UUID (cuDeviceGetUuid), empty when the driver
  // cannot open device memory of other processes. OpenIpcBuffer: the allocation an exported
  // 64-byte handle names, opened once and kept in a bounded cache (least recently used closed
  // first). Errors: INVALID_ARGUMENT for a handle the driver refuses (its buffer freed, its
  // process gone, another GPU), FAILED_PRECONDITION without IPC, UNAVAILABLE when the device
  // failed.
  virtual std::string DeviceUuid() const = 0;
  virtual absl::StatusOr<std::shared_ptr<const DeviceBuffer>> OpenIpcBuffer(
      absl::string_view handle) = 0;

  // Device failure. A device can fail for good (a sticky driver error such as an illegal address
  // or an uncorrectable ECC error, or work that never completes); from then on every call that
  // needs it fails UNAVAILABLE, and the handler set here (before any work) is called once, on
  // the thread that saw the failure, with the reason. It must not block.
  using FailureHandler = std::function<void(const absl::Status&)>;
  virtual void SetFailureHandler(FailureHandler handler) = 0;
  // OK, or the device's failure. Work handed to the device and not completed within `bound`
  // (a synchronize still waiting; zero: no bound) becomes the failure first. Cheap: the server's
  // device watchdog calls it periodically, from a thread of its own.
  virtual absl::Status CheckDevice(absl::Duration bound) = 0;
};

// The UUID of `backend`'s device when it can open other processes' device memory (CUDA IPC);
// empty otherwise (no device, or a driver without IPC).
inline std::string IpcDeviceUuid(Backend& backend) {
  DeviceBackend* device = backend.device();
  return device != nullptr ? device->DeviceUuid() : std::string();
}


}  // namespace normgrad::server
