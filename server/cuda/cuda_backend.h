// The CUDA backend: the Driver API loaded at run time (nvidia/driver_api.h), modules JIT-
// loaded from the kernels library's PTX and cached by ConfigKey (ModuleCache, single-flight).
//
// Device set-up (once per backend): cuInit, the device's primary context retained (released
// when the backend, its sessions and its cached modules are gone), stream-ordered allocation
// from the device's default pool with CU_MEMPOOL_ATTR_RELEASE_THRESHOLD raised to UINT64_MAX
// (cuMemAlloc when the driver or device lacks pools).
//
// Staging, per backend, not per session: a chunk borrows a slot from the backend's staging pool
// for the length of one ProcessChunk call (two CU_STREAM_NON_BLOCKING streams, pinned host
// memory from cuMemHostAlloc and device memory for gamma, x, dy, dx, rms, the plan's workspace
// and the chunk's grad_gamma), and gives it back once its streams are synchronized; an idle
// session holds none. Slots are reused across sessions and RPCs. The pinned bytes of all slots,
// in use or idle, stay within max_staging_bytes, and so do the device bytes (a slot that alone
// is larger is still lent when no other slot is held); a chunk that would pass the bound first
// frees idle slots, then waits for one in use to come back. The server passes
// --max-inflight-bytes (docs/operations.md, "Memory and overload"). Every call that issues work
// first makes the context current on the calling thread (cuCtxSetCurrent).
//
// The chunk pipeline: a chunk is cut into pieces of about pipeline_piece_bytes of x (whole
// rows) that alternate between the slot's two streams. Piece p+1 is staged into pinned memory
// and issued (host-to-device copies, the plan's launches, device-to-host copies) before the
// host waits for piece p, so the host's staging copies, host-to-device and device-to-host copies
// (PCIe is full duplex) and kernels of neighbouring pieces overlap. The pieces' f32 grad_gamma
// are added on the host (double) in piece order; the cut depends only on the chunk's shape, so
// the bits do too.
//
// Which kernel runs is kernels/rmsnorm/kernel_choice.h's ChooseBackwardKernel (kernels::BackwardRequest::kernel, else
// its choice for the request and this GPU); the backend obeys what the kernel's data flow says
// (kernels/backward_kernel.h): the given rms goes to the device when the kernel reads it, and
// grad_gamma is added on the host, from the chunk and the given rms, when the kernel does not
// write it. A request no kernel takes (a given rms with rows too wide for every kernel that
// reads one) goes to the one CPU path: the CPU backend the factory gives it
// (CudaBackendOptions::host), whose session takes the whole batch.
//
// Rooms (all internal to this folder, namespace cuda_internal): device_context.h (the retained
// context, health, registered host memory), module_loader.h (PTX -> loaded module),
// cuda_launcher.h (a module + a stream: where a kernel's launches go), staging_pool.h,
// ipc_buffer_cache.h, cuda_session.h (a batch's chunks), and this backend.
//
// Reproducibility: with a kernel whose grad_gamma sum has a fixed order (the row-resident kernel),
// same input, chunking and GPU model (SM count) give the same bits; atomics do not (within f32
// rounding).
// dtypes: f32, f16 and bf16 (bf16 kernels need sm_80): x, dy, gamma and dx travel in the dtype,
// the kernels compute in f32, rms and the device grad_gamma are f32.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/cache/module_cache.h"

namespace normgrad::server {

// 8 MiB of x per piece: a 64 MiB shared-memory chunk of x is 8 pieces; a gRPC chunk (1 MiB by
// default, 4 MiB at most) is one.
inline constexpr uint64_t kDefaultPipelinePieceBytes = uint64_t{8} << 20;

struct CudaBackendOptions {
  std::string driver_library;  // empty: $NORMGRAD_CUDA_DRIVER, else "libcuda.so.1"
  int device_ordinal = 0;
  ModuleCacheOptions cache;
  // Bound of the staging pool: pinned host bytes, and device bytes, each (see above).
  uint64_t max_staging_bytes = 1ull << 30;
  // CUDA IPC: other processes' device allocations kept open (least recently used closed first).
  uint32_t max_ipc_handles = 64;
  // The chunk pipeline (see above): bytes of x per piece (at least one row per piece).
  uint64_t pipeline_piece_bytes = kDefaultPipelinePieceBytes;
  // Computes the batches no GPU kernel takes: the CPU backend (the one CPU path; the backend
  // factory gives it). None: such a batch is FAILED_PRECONDITION.
  std::shared_ptr<Backend> host;
};

// FAILED_PRECONDITION saying why when no usable GPU is found (library not loadable or not a
// driver, cuInit failure, no device, bad ordinal, context not retained).
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options);

}  // namespace normgrad::server
