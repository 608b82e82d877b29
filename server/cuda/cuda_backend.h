// The CUDA backend: the Driver API loaded at run time (server/cuda/driver_api.h), modules JIT-
// loaded from the kernels library's PTX and cached by ConfigKey (ModuleCache, single-flight).
//
// Device set-up (once per backend): cuInit, the device's primary context retained (released
// when the backend, its sessions and its cached modules are gone), stream-ordered allocation
// from the device's default pool with CU_MEMPOOL_ATTR_RELEASE_THRESHOLD raised to UINT64_MAX
// (cuMemAlloc when the driver or device lacks pools).
//
// Per session: one CU_STREAM_NON_BLOCKING stream, device buffers grown to the largest chunk,
// pinned host staging (cuMemHostAlloc) for the chunk's inputs and outputs. Every call that
// issues work first makes the context current on the calling thread (cuCtxSetCurrent).
//
// Which kernel runs (BatchSpec::kernel empty = the backend's choice):
//   rms not given                   batched_rms_norm_backward: dx on the GPU, and each chunk's
//                                   grad_gamma summed by atomics into a zeroed device buffer,
//                                   then added on the host (double) in chunk order.
//   rms given, hidden_dim <= 32     rms_norm_backward (uses the given rms) for dx; the chunk's
//                                   grad_gamma on the host from x, dy and the given rms.
//   rms given, hidden_dim > 32      no GPU kernel takes a given rms for wide rows yet: the host
//                                   path (the CPU backend's Highway rows) computes dx and
//                                   grad_gamma exactly from the given rms.
// A named kernel is obeyed: batched_rms_norm_backward with rms given recomputes rms from x and
// eps (equal to the given one for a consistent forward pass).
//
// Reproducibility: grad_gamma of the batched kernel depends on the order of float atomics
// within a chunk, so it is not bitwise reproducible (it is within f32 rounding); the CPU
// backend's is. dtypes: f32, f16 and bf16 (bf16 kernels need sm_80): x, dy, gamma and dx travel
// in the dtype, the kernels compute in f32, rms and the device grad_gamma are f32.
#ifndef NORMGRAD_SERVER_CUDA_CUDA_BACKEND_H_
#define NORMGRAD_SERVER_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/cache/module_cache.h"

namespace normgrad::server {

struct CudaBackendOptions {
  std::string driver_library;  // empty: $NORMGRAD_CUDA_DRIVER, else "libcuda.so.1"
  int device_ordinal = 0;
  ModuleCacheOptions cache;
};

// FAILED_PRECONDITION saying why when no usable GPU is found (library not loadable or not a
// driver, cuInit failure, no device, bad ordinal, context not retained).
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options);

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_CUDA_CUDA_BACKEND_H_
