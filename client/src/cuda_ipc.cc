#include "normgrad/cuda_ipc.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace normgrad {
namespace {

// The few Driver API types these calls need, as the driver's ABI defines them (cuda.h), so the
// client library builds without the CUDA toolkit.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): the ABI's type
struct CUuuid {
  char bytes[16];
};
struct CUipcMemHandle {
  char reserved[64];
};

struct Driver {
  std::string path;
  std::string error;  // why it is not usable; empty when it is
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetUuid_v2)(CUuuid*, CUdevice) = nullptr;
  CUresult (*cuMemGetAddressRange_v2)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
};

template <typename F>
void Resolve(void* library, const char* name, F& out, std::string& error) {
  out = reinterpret_cast<F>(dlsym(library, name));
  if (out == nullptr && error.empty()) error = absl::StrCat("lacks ", name);
}

// Loaded once per process and never unloaded (as the server does with the driver).
const Driver& LoadDriver() {
  static const Driver* driver = [] {
    auto* d = new Driver;
    const char* env = std::getenv("NORMGRAD_CUDA_DRIVER");
    d->path = env != nullptr && *env != '\0' ? env : "libcuda.so.1";
    void* library = dlopen(d->path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      d->error = absl::StrCat("not loadable: ", why != nullptr ? why : "unknown");
      return d;
    }
    Resolve(library, "cuInit", d->cuInit, d->error);
    Resolve(library, "cuDeviceGet", d->cuDeviceGet, d->error);
    Resolve(library, "cuDeviceGetUuid_v2", d->cuDeviceGetUuid_v2, d->error);
    Resolve(library, "cuMemGetAddressRange_v2", d->cuMemGetAddressRange_v2, d->error);
    Resolve(library, "cuIpcGetMemHandle", d->cuIpcGetMemHandle, d->error);
    Resolve(library, "cuGetErrorName", d->cuGetErrorName, d->error);
    return d;
  }();
  return *driver;
}

absl::Status Usable(const Driver& d) {
  if (d.error.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("CUDA driver ", d.path, " ", d.error));
}

// "<call> failed: CUDA_ERROR_... (<number>)" for a failed driver call.
absl::Status Failed(const Driver& d, CUresult r, const std::string& call,
                    absl::StatusCode code = absl::StatusCode::kFailedPrecondition) {
  const char* name = nullptr;
  if (d.cuGetErrorName(r, &name) != 0 || name == nullptr) name = "an unknown CUDA error";
  return absl::Status(code, absl::StrCat(call, " failed: ", name, " (", r, ")"));
}

}  // namespace

absl::StatusOr<std::string> CudaDeviceUuid(int ordinal) {
  const Driver& d = LoadDriver();
  if (absl::Status s = Usable(d); !s.ok()) return s;
  if (CUresult r = d.cuInit(0); r != 0) return Failed(d, r, "cuInit");
  CUdevice device = 0;
  if (CUresult r = d.cuDeviceGet(&device, ordinal); r != 0) {
    return Failed(d, r, absl::StrCat("cuDeviceGet(", ordinal, ")"));
  }
  CUuuid uuid{};
  if (CUresult r = d.cuDeviceGetUuid_v2(&uuid, device); r != 0) {
    return Failed(d, r, "cuDeviceGetUuid");
  }
  return std::string(uuid.bytes, sizeof(uuid.bytes));
}

absl::StatusOr<CudaIpcBuffer> ExportCudaBuffer(uint64_t device_pointer) {
  const Driver& d = LoadDriver();
  if (absl::Status s = Usable(d); !s.ok()) return s;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (CUresult r = d.cuMemGetAddressRange_v2(&base, &size, device_pointer); r != 0) {
    return Failed(d, r, absl::StrCat("cuMemGetAddressRange(0x", absl::Hex(device_pointer), ")"),
                  absl::StatusCode::kInvalidArgument);
  }
  CUipcMemHandle handle{};
  if (CUresult r = d.cuIpcGetMemHandle(&handle, base); r != 0) {
    return Failed(d, r, absl::StrCat("cuIpcGetMemHandle(0x", absl::Hex(base), ")"),
                  absl::StatusCode::kInvalidArgument);
  }
  CudaIpcBuffer out;
  out.handle.assign(handle.reserved, sizeof(handle.reserved));
  out.offset = device_pointer - base;
  return out;
}

}  // namespace normgrad
