// The names and texts of the CUDA driver's results, as cuGetErrorName and cuGetErrorString give
// them, for the test doubles of the driver (the scripted one and the emulated one), so that both
// describe an error the way the real driver does.
//
//   CUresult cuGetErrorName(CUresult r, const char** s) { return DescribeCudaResult(r, false, s); }
#pragma once

#include <cuda.h>

namespace normgrad::testing {

struct CudaErrorText {
  CUresult code;
  const char* name;
  const char* text;
};

#define NORMGRAD_CUDA_ERROR(code, text) \
  { code, #code, text }
inline constexpr CudaErrorText kCudaErrorTexts[] = {
    NORMGRAD_CUDA_ERROR(CUDA_SUCCESS, "no error"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_NO_BINARY_FOR_GPU,
                        "no kernel image is available for execution on the device"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                        "the provided PTX was compiled with an unsupported toolchain."),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_NOT_READY, "device not ready"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_MISALIGNED_ADDRESS, "misaligned address"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                        "too many resources requested for launch"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_LAUNCH_TIMEOUT, "the launch timed out and was terminated"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    NORMGRAD_CUDA_ERROR(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef NORMGRAD_CUDA_ERROR

// cuGetErrorName (`description` false) or cuGetErrorString (true): CUDA_ERROR_INVALID_VALUE
// (and *out = nullptr) for a result not in the table or a null `out`.
inline CUresult DescribeCudaResult(CUresult error, bool description, const char** out) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (const CudaErrorText& e : kCudaErrorTexts) {
    if (e.code == error) {
      *out = description ? e.text : e.name;
      return CUDA_SUCCESS;
    }
  }
  *out = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}

}  // namespace normgrad::testing
