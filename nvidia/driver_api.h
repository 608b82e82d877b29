// The CUDA Driver API functions normgrad uses, resolved at run time from the driver library
// (dlopen + dlsym), so that one binary runs on machines with and without a driver. Never link
// libcuda.
//
// NORMGRAD_CUDA_DRIVER_FUNCTIONS is the one list of exported symbol names looked up (the names
// cuda.h's macros map to, e.g. cuMemAlloc -> cuMemAlloc_v2). A library that stands in for the
// driver (an emulator used by tests) exports exactly these. X(name, required): a missing
// required symbol makes the library unusable; a missing optional one leaves its pointer null
// (stream-ordered allocation then falls back to cuMemAlloc_v2/cuMemFree_v2; without the IPC
// functions the backend takes no CUDA IPC chunks).
//
//   absl::StatusOr<std::shared_ptr<const CudaDriver>> driver = CudaDriver::Load("libcuda.so.1");
//   CUdevice dev;
//   absl::Status s = (*driver)->Check((*driver)->api().cuDeviceGet(&dev, 0), "cuDeviceGet");
#pragma once

#include <cuda.h>

// CUDA 13's cuda.h maps cuEventElapsedTime to cuEventElapsedTime_v2, which only drivers from
// 12.8 on export; the unversioned symbol (same signature) is in every driver, so that is the one
// looked up. Declared here only for its type: never called through the linker.
#undef cuEventElapsedTime
extern "C" CUresult CUDAAPI cuEventElapsedTime(float* milliseconds, CUevent start, CUevent end);

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define NORMGRAD_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit, true)                         \
  X(cuDriverGetVersion, true)             \
  X(cuDeviceGetCount, true)               \
  X(cuDeviceGet, true)                    \
  X(cuDeviceGetName, true)                \
  X(cuDeviceGetAttribute, true)           \
  X(cuDeviceTotalMem_v2, true)            \
  X(cuDevicePrimaryCtxRetain, true)       \
  X(cuDevicePrimaryCtxRelease_v2, true)   \
  X(cuCtxSetCurrent, true)                \
  X(cuCtxGetCurrent, true)                \
  X(cuModuleLoadDataEx, true)             \
  X(cuModuleUnload, true)                 \
  X(cuModuleGetFunction, true)            \
  X(cuLaunchKernel, true)                 \
  X(cuMemAlloc_v2, true)                  \
  X(cuMemFree_v2, true)                   \
  X(cuMemAllocAsync, false)               \
  X(cuMemFreeAsync, false)                \
  X(cuDeviceGetDefaultMemPool, false)     \
  X(cuMemPoolSetAttribute, false)         \
  X(cuMemHostAlloc, true)                 \
  X(cuMemFreeHost, true)                  \
  X(cuMemcpyHtoDAsync_v2, true)           \
  X(cuMemcpyDtoHAsync_v2, true)           \
  X(cuMemHostRegister_v2, false)          \
  X(cuMemHostUnregister, false)           \
  X(cuMemsetD8Async, true)                \
  X(cuMemsetD32Async, true)               \
  X(cuStreamCreate, true)                 \
  X(cuStreamDestroy_v2, true)             \
  X(cuStreamSynchronize, true)            \
  X(cuEventCreate, true)                  \
  X(cuEventRecord, true)                  \
  X(cuEventSynchronize, true)             \
  X(cuEventElapsedTime, true)             \
  X(cuEventDestroy_v2, true)              \
  X(cuGetErrorName, true)                 \
  X(cuGetErrorString, true)               \
  X(cuMemGetInfo_v2, true)                 \
  X(cuDeviceGetUuid_v2, false)            \
  X(cuIpcOpenMemHandle_v2, false)         \
  X(cuIpcCloseMemHandle, false)           \
  X(cuMemGetAddressRange_v2, false)

namespace normgrad::server::cuda {

// One pointer per symbol, typed from cuda.h's declaration; null until loaded.
struct DriverApi {
#define NORMGRAD_CUDA_DECLARE_POINTER(name, required) decltype(&::name) name = nullptr;
  NORMGRAD_CUDA_DRIVER_FUNCTIONS(NORMGRAD_CUDA_DECLARE_POINTER)
#undef NORMGRAD_CUDA_DECLARE_POINTER
};

// The library to load: `option` when non-empty, else $NORMGRAD_CUDA_DRIVER when set and
// non-empty, else "libcuda.so.1".
std::string ResolveDriverLibrary(absl::string_view option);

// True for the errors after which the device cannot be used by this process any more: the
// sticky ones, which the CUDA documentation describes as leaving the process in an inconsistent
// state where every later call fails the same way until it is restarted (illegal address or
// instruction, misaligned address, invalid PC or address space, hardware stack error, launch
// failure or timeout, uncorrectable ECC or NVLink error, a contained error, a destroyed context),
// and a device that became unavailable or external-device failures. CUDA_ERROR_NOT_READY is not
// one (an asynchronous query's "not yet").
bool IsDeviceLost(CUresult result);

// The one place a CUresult becomes an absl::Status. OK for CUDA_SUCCESS; otherwise
// "<call> failed: <CUDA_ERROR_NAME> (<description>)" with the code:
//   RESOURCE_EXHAUSTED   out of memory
//   FAILED_PRECONDITION  no device / no or too old a driver / no binary or unsupported PTX for
//                        this GPU (what a wrong or missing GPU looks like)
//   UNAVAILABLE          IsDeviceLost: the device failed; the work may succeed on another one
//   INVALID_ARGUMENT     never (bad input is refused before any driver call)
//   INTERNAL             everything else (a bug).
// `api` may be null or lack cuGetErrorName/String (then the number is shown).
absl::Status CudaResultToStatus(const DriverApi* api, CUresult result, absl::string_view call);

// A loaded driver library. The library is never dlclose'd (the real driver does not support
// being unloaded while it may still own threads); the object is shared by the backend, its
// sessions and its cached modules.
class CudaDriver {
 public:
  // dlopen(path) and dlsym of every symbol above. FAILED_PRECONDITION saying why when the
  // library cannot be loaded ("<path> not loadable: <dlerror>") or lacks a required symbol.
  static absl::StatusOr<std::shared_ptr<const CudaDriver>> Load(const std::string& path);

  const DriverApi& api() const { return api_; }
  const std::string& path() const { return path_; }

  // CudaResultToStatus with this driver's error names.
  absl::Status Check(CUresult result, absl::string_view call) const {
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    return CudaResultToStatus(&api_, result, call);
  }

  // True when CUDA IPC (opening other processes' device memory) and the device UUID were found.
  bool HasIpc() const {
    return api_.cuDeviceGetUuid_v2 != nullptr && api_.cuIpcOpenMemHandle_v2 != nullptr &&
           api_.cuIpcCloseMemHandle != nullptr && api_.cuMemGetAddressRange_v2 != nullptr;
  }

  // True when stream-ordered allocation (cuMemAllocAsync and friends) was found.
  bool HasStreamOrderedAllocation() const {
    return api_.cuMemAllocAsync != nullptr && api_.cuMemFreeAsync != nullptr &&
           api_.cuDeviceGetDefaultMemPool != nullptr && api_.cuMemPoolSetAttribute != nullptr;
  }

 private:
  CudaDriver() = default;
  DriverApi api_;
  std::string path_;
};

// "13.0" for 13000, "12.8" for 12080.
std::string DriverVersionString(int driver_version);

// The highest PTX ISA a driver of `driver_version` (cuDriverGetVersion) JIT-compiles:
// 12.0 -> 8.0 ... 12.5 -> 8.5, 12.6 -> 8.5, 12.8 -> 8.7, 12.9 -> 8.8, 13.0 -> 9.0; versions
// newer than the table -> its newest entry; older than 12.0 -> "7.x" estimates down to 11.0.
std::string MaxPtxVersionForDriver(int driver_version);

}  // namespace normgrad::server::cuda
