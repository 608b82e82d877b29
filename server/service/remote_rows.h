// Where a row chunk's rows are when its request message does not carry them: byte ranges in a
// shared-memory region the client registered (`shm`), or buffers in the client's device memory
// (`cuda_ipc`). Each check names the field and the numbers of what the server refuses. No gRPC,
// no lock, no state: the stream pipeline calls them as a chunk arrives (and, for device memory,
// again on a worker as the chunk is computed).
//
//   const RowLayout layout = RowLayout::Of(validator.spec());
//   absl::StatusOr<RegionRows> in = FindRegionRows(regions, peer_is_local, request.shm(), chunk,
//                                                  layout);
//   absl::Status ok = CheckDeviceChunk(backend.DeviceUuid(), peer_is_local, request.cuda_ipc(),
//                                      chunk, layout);                        // as it arrives
//   absl::StatusOr<DeviceRows> d = OpenDeviceRows(backend, request.cuda_ipc(), chunk, layout,
//                                                 held);                      // on a worker
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/backend/backend.h"
#include "server/service/backward_validator.h"
#include "server/shared_memory/region_registry.h"

namespace normgrad::server {

// The sizes of one row of a batch, fixed once its header was accepted.
struct RowLayout {
  uint64_t row_bytes = 0;      // hidden_dim * element_bytes: one row of x, dy or grad_input
  uint64_t element_bytes = 0;  // of header.dtype
  bool rms_provided = false;   // rms: 4 bytes a row
  static RowLayout Of(const kernels::BackwardRequest& spec);
};

// A chunk's rows in a shared-memory region: byte offsets checked against the region (in range,
// aligned, grad_input apart from what is read). The mapping stays while this is held.
struct RegionRows {
  std::shared_ptr<const MappedRegion> region;
  uint64_t x = 0, dy = 0, rms = 0, grad_input = 0;
};

// `regions`: null when the server takes no shared memory (FAILED_PRECONDITION). `peer_is_local`:
// the client reached a unix socket or a loopback address (else FAILED_PRECONDITION).
absl::StatusOr<RegionRows> FindRegionRows(const RegionRegistry* regions, bool peer_is_local,
                                          const v1::SharedMemoryChunk& shm, const ValidatedChunk& chunk,
                                          const RowLayout& layout);

// What the message alone says about a chunk in device memory: the server's GPU
// (`server_uuid`, empty when it takes no CUDA IPC), handle sizes, rms as the header declared, and
// no overlap of grad_input with an input named by the same handle. Cheap: no driver call.
absl::Status CheckDeviceChunk(absl::string_view server_uuid, bool peer_is_local,
                              const v1::CudaIpcChunk& ipc, const ValidatedChunk& chunk,
                              const RowLayout& layout);

// Opens the chunk's device buffers through `backend` (kept open in `held` until the chunk is
// computed), checks the ranges against the allocations and grad_input's device addresses against
// the inputs'. A driver call per buffer: on a worker, after CheckDeviceChunk.
absl::StatusOr<DeviceRows> OpenDeviceRows(Backend& backend, const v1::CudaIpcChunk& ipc,
                                          const ValidatedChunk& chunk, const RowLayout& layout,
                                          std::vector<std::shared_ptr<const DeviceBuffer>>& held);

}  // namespace normgrad::server
