#include "nvidia/driver_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace normgrad::server::cuda {

std::string ResolveDriverLibrary(absl::string_view option) {
  if (!option.empty()) return std::string(option);
  const char* env = std::getenv("NORMGRAD_CUDA_DRIVER");
  if (env != nullptr && *env != '\0') return env;
  return "libcuda.so.1";
}

bool IsDeviceLost(CUresult result) {
  switch (result) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_NVLINK_UNCORRECTABLE:
    case CUDA_ERROR_CONTAINED:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_EXTERNAL_DEVICE:
      return true;
    default:
      return false;
  }
}

absl::Status CudaResultToStatus(const DriverApi* api, CUresult result, absl::string_view call) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* description = nullptr;
  if (api != nullptr && api->cuGetErrorName != nullptr &&
      api->cuGetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (api != nullptr && api->cuGetErrorString != nullptr &&
      api->cuGetErrorString(result, &description) != CUDA_SUCCESS) {
    description = nullptr;
  }
  const std::string message =
      absl::StrCat(call, " failed: ", name != nullptr ? name : "CUresult",
                   name != nullptr ? "" : absl::StrCat(" ", static_cast<int>(result)),
                   description != nullptr ? absl::StrCat(" (", description, ")") : "");
  if (IsDeviceLost(result)) return absl::UnavailableError(message);
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(message);
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_DEVICE_NOT_LICENSED:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
    case CUDA_ERROR_PROFILER_DISABLED:
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<std::shared_ptr<const CudaDriver>> CudaDriver::Load(const std::string& path) {
  dlerror();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat(path, " not loadable: ", error != nullptr ? error : "unknown dlopen error"));
  }
  std::shared_ptr<CudaDriver> driver(new CudaDriver());
  driver->path_ = path;
  std::string missing;
#define NORMGRAD_CUDA_RESOLVE(name, required)                                    \
  driver->api_.name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name)); \
  if (driver->api_.name == nullptr && (required))                                \
    absl::StrAppend(&missing, missing.empty() ? "" : ", ", #name);
  NORMGRAD_CUDA_DRIVER_FUNCTIONS(NORMGRAD_CUDA_RESOLVE)
#undef NORMGRAD_CUDA_RESOLVE
  if (!missing.empty()) {
    dlclose(handle);  // nothing from it is in use yet
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a usable CUDA driver: it lacks ", missing));
  }
  return std::shared_ptr<const CudaDriver>(std::move(driver));
}

std::string DriverVersionString(int driver_version) {
  return absl::StrCat(driver_version / 1000, ".", (driver_version % 1000) / 10);
}

std::string MaxPtxVersionForDriver(int driver_version) {
  struct Row {
    int driver;
    const char* ptx;
  };
  static constexpr Row kTable[] = {
      {11000, "7.0"}, {11010, "7.1"}, {11020, "7.2"}, {11030, "7.3"}, {11040, "7.4"},
      {11050, "7.5"}, {11060, "7.6"}, {11070, "7.7"}, {11080, "7.8"}, {12000, "8.0"},
      {12010, "8.1"}, {12020, "8.2"}, {12030, "8.3"}, {12040, "8.4"}, {12050, "8.5"},
      {12060, "8.5"}, {12080, "8.7"}, {12090, "8.8"}, {13000, "9.0"},
  };
  const char* best = "";
  for (const Row& row : kTable) {
    if (row.driver <= driver_version) best = row.ptx;
  }
  return best;
}

}  // namespace normgrad::server::cuda
