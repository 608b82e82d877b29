// CUDA IPC from the client's side (docs/api.md, "CUDA IPC"): turns device pointers of this
// process into the handles a server on the same GPU opens, so that Backward runs on tensors that
// already live on the GPU with no host copy and no transfer.
//
//   auto uuid = normgrad::CudaDeviceUuid(0);              // the GPU the tensors are on
//   auto x = normgrad::ExportCudaBuffer(x_device_ptr);    // also dy, dx (and rms)
//   normgrad::RawBackwardArgs args;  ... type, num_rows, hidden_dim, eps, gamma, dgamma ...
//   args.device = normgrad::CudaIpcTensors{*uuid, *x, *dy, *dx, std::nullopt};
//   (*client)->BackwardRaw(args, {});   // grad_input is in dx's device memory when it returns
//
// The driver is loaded at run time (dlopen of $NORMGRAD_CUDA_DRIVER, else libcuda.so.1), so the
// client library needs no CUDA toolkit to build and links no libcuda. Call these from a thread
// whose current CUDA context owns the pointers (what a framework's CUDA thread has). A device
// allocation must stay allocated while the server may use it: the server keeps exported
// allocations open (--max-cuda-ipc-handles) and the real driver leaves freeing one that another
// process still has open undefined.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "normgrad/client.h"

namespace normgrad {

// The 16-byte UUID of CUDA device `ordinal` (cuDeviceGetUuid). FAILED_PRECONDITION naming the
// driver's error when no driver or device is there.
absl::StatusOr<std::string> CudaDeviceUuid(int ordinal);

// The IPC handle of the allocation that holds `device_pointer` (cuIpcGetMemHandle of its base,
// from cuMemGetAddressRange) and the pointer's offset from that base.
absl::StatusOr<CudaIpcBuffer> ExportCudaBuffer(uint64_t device_pointer);

}  // namespace normgrad
