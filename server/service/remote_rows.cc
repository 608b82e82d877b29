#include "server/service/remote_rows.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kernels/kernel_config.h"
#include "base/status_macros.h"

namespace normgrad::server {
namespace {

// A device UUID as the CUDA tools print it (32 hex digits), or what was sent when not 16 bytes.
std::string HexUuid(const std::string& uuid) {
  if (uuid.size() != 16) return absl::StrCat("(", uuid.size(), " bytes, not 16)");
  return absl::BytesToHexString(uuid);
}

// FAILED_PRECONDITION unless this server takes chunks whose rows are in `kind` (`taken`; `how`
// says how to start one that does) and the client is on this machine.
absl::Status CheckTaken(absl::string_view where, absl::string_view field, absl::string_view kind,
                        bool taken, absl::string_view how, bool peer_is_local) {
  if (!taken) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "carries ", field, " but this server takes no ", kind, " (", how, ")"));
  }
  if (!peer_is_local) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "carries ", field, " but the client is not on this machine (", kind,
        " is taken only on a unix socket or a loopback address)"));
  }
  return absl::OkStatus();
}

// What an overlap refusal adds: the one overlap that is taken.
constexpr absl::string_view kInPlaceRule =
    "; grad_input may overlap an input only as exactly dy's range (in place)";

}  // namespace

RowLayout RowLayout::Of(const kernels::BackwardRequest& spec) {
  RowLayout layout;
  layout.element_bytes = kernels::DTypeBytes(spec.dtype);
  layout.row_bytes = uint64_t{spec.hidden_dim} * layout.element_bytes;
  layout.rms_provided = spec.rms_provided;
  return layout;
}

absl::StatusOr<RegionRows> FindRegionRows(const RegionRegistry* regions, bool peer_is_local,
                                          const v1::SharedMemoryChunk& shm, const ValidatedChunk& chunk,
                                          const RowLayout& layout) {
  const std::string where = absl::StrCat("chunk ", chunk.index, ": ");
  NORMGRAD_RETURN_IF_ERROR(CheckTaken(
      where, "shm", "shared memory", regions != nullptr,
      "start it with --shared-memory and reach it on its unix socket", peer_is_local));
  absl::StatusOr<std::shared_ptr<const MappedRegion>> region =
      regions->Find(shm.region_id(), shm.region_key());
  if (!region.ok()) {
    return absl::Status(region.status().code(), absl::StrCat(where, region.status().message()));
  }
  // Pages the client released since it registered the region (a hole punched) would be
  // faulted in, and charged, to the server: refused.
  if (absl::Status s = (*region)->CheckAllocated(absl::StrCat(where, "shm.region_id=",
                                                              shm.region_id()));
      !s.ok()) {
    return s;
  }
  const uint64_t size = (*region)->size();
  const uint64_t element = layout.element_bytes;
  if (chunk.num_rows > UINT64_MAX / layout.row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, "shm.num_rows = ", chunk.num_rows,
                                                   " rows do not fit in any region"));
  }
  const uint64_t bytes = chunk.num_rows * layout.row_bytes;
  const uint64_t rms_bytes = layout.rms_provided ? chunk.num_rows * 4 : 0;
  // As a bytes chunk's rms without header.rms_provided: refused, not ignored (0 is also the
  // field's unset value, so only a nonzero offset can tell).
  if (!layout.rms_provided && shm.rms_offset() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, "shm.rms_offset = ", shm.rms_offset(),
                                                   " but header.rms_provided is false"));
  }
  struct Range {
    const char* field;
    uint64_t offset, bytes, alignment;
  };
  const Range ranges[] = {{"shm.x_offset", shm.x_offset(), bytes, element},
                          {"shm.dy_offset", shm.dy_offset(), bytes, element},
                          {"shm.rms_offset", shm.rms_offset(), rms_bytes, 4},
                          {"shm.grad_input_offset", shm.grad_input_offset(), bytes, element}};
  for (const Range& r : ranges) {
    if (absl::Status s = CheckRegionRange(absl::StrCat(where, r.field), r.offset, r.bytes, size,
                                          r.alignment);
        !s.ok()) {
      return s;
    }
  }
  // grad_input is written while x, dy and rms are read: it must not overlap them, except that
  // it may be exactly dy's range (in place: each dy element is read before its dx is written).
  const Range& out = ranges[3];
  for (int i = 0; i < 3; ++i) {
    const Range& in = ranges[i];
    const bool over_dy = i == 1 && out.offset == in.offset;
    if (!over_dy && in.bytes > 0 && out.offset < in.offset + in.bytes &&
        in.offset < out.offset + out.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "shm.grad_input_offset = ", out.offset, " (", out.bytes, " bytes) overlaps ",
          in.field, " = ", in.offset, " (", in.bytes, " bytes)", kInPlaceRule));
    }
  }
  RegionRows rows;
  rows.region = *std::move(region);
  rows.x = shm.x_offset();
  rows.dy = shm.dy_offset();
  rows.rms = shm.rms_offset();
  rows.grad_input = shm.grad_input_offset();
  return rows;
}

absl::Status CheckDeviceChunk(absl::string_view server_uuid, bool peer_is_local,
                              const v1::CudaIpcChunk& ipc, const ValidatedChunk& chunk,
                              const RowLayout& layout) {
  const std::string where = absl::StrCat("chunk ", chunk.index, ": ");
  NORMGRAD_RETURN_IF_ERROR(CheckTaken(
      where, "cuda_ipc", "CUDA IPC", !server_uuid.empty(),
      "start it with --cuda-ipc on the CUDA backend, and reach it on its unix socket",
      peer_is_local));
  if (ipc.device_uuid() != server_uuid) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "cuda_ipc.device_uuid = ", HexUuid(ipc.device_uuid()),
        " is not this server's GPU (", HexUuid(std::string(server_uuid)),
        "): the buffers must be on the server's device"));
  }
  const bool rms = layout.rms_provided;
  const std::pair<const char*, const v1::CudaIpcBuffer*> buffers[] = {
      {"cuda_ipc.x", &ipc.x()},
      {"cuda_ipc.dy", &ipc.dy()},
      {"cuda_ipc.grad_input", &ipc.grad_input()},
      {"cuda_ipc.rms", rms ? &ipc.rms() : nullptr}};
  for (const auto& [field, buffer] : buffers) {
    if (buffer == nullptr) continue;
    if (buffer->handle().size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, field, ".handle has ",
                                                     buffer->handle().size(), " bytes, not ",
                                                     kCudaIpcHandleBytes));
    }
  }
  if (!rms && ipc.has_rms()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "cuda_ipc.rms is set but header.rms_provided is false"));
  }
  // grad_input is written while x, dy and rms are read: within one allocation it must not
  // overlap them, except as exactly dy's range (in place).
  if (chunk.num_rows > UINT64_MAX / layout.row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, "cuda_ipc.num_rows = ", chunk.num_rows,
                                                   " rows do not fit in any buffer"));
  }
  const uint64_t bytes = chunk.num_rows * layout.row_bytes;
  const v1::CudaIpcBuffer& out = ipc.grad_input();
  const std::tuple<const char*, const v1::CudaIpcBuffer*, uint64_t> inputs[] = {
      {"cuda_ipc.x", &ipc.x(), bytes},
      {"cuda_ipc.dy", &ipc.dy(), bytes},
      {"cuda_ipc.rms", &ipc.rms(), rms ? chunk.num_rows * 4 : 0}};
  for (const auto& [field, in, in_bytes] : inputs) {
    if (in_bytes == 0 || in->handle() != out.handle()) continue;
    if (in == &ipc.dy() && in->offset() == out.offset()) continue;  // in place
    if (out.offset() < in->offset() + in_bytes && in->offset() < out.offset() + bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "cuda_ipc.grad_input.offset = ", out.offset(), " (", bytes,
                       " bytes) overlaps ", field, ".offset = ", in->offset(), " (", in_bytes,
                       " bytes) in the same allocation", kInPlaceRule));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceRows> OpenDeviceRows(Backend& backend, const v1::CudaIpcChunk& ipc,
                                          const ValidatedChunk& chunk, const RowLayout& layout,
                                          std::vector<std::shared_ptr<const DeviceBuffer>>& held) {
  const std::string where = absl::StrCat("chunk ", chunk.index, ": ");
  const uint64_t bytes = chunk.num_rows * layout.row_bytes;
  const bool rms_provided = layout.rms_provided;
  const uint64_t element = layout.element_bytes;
  DeviceBackend* device = backend.device();
  DeviceRows rows;
  rows.rows = chunk.num_rows;
  const std::tuple<const char*, const v1::CudaIpcBuffer*, uint64_t, uint64_t, uint64_t*> parts[] =
      {{"cuda_ipc.x", &ipc.x(), bytes, element, &rows.x},
       {"cuda_ipc.dy", &ipc.dy(), bytes, element, &rows.dy},
       {"cuda_ipc.grad_input", &ipc.grad_input(), bytes, element, &rows.dx},
       {"cuda_ipc.rms", &ipc.rms(), rms_provided ? chunk.num_rows * 4 : 0, 4, &rows.rms}};
  for (const auto& [field, buffer, part_bytes, alignment, address] : parts) {
    if (part_bytes == 0) continue;
    absl::StatusOr<std::shared_ptr<const DeviceBuffer>> opened =
        device != nullptr ? device->OpenIpcBuffer(buffer->handle())
                          : absl::FailedPreconditionError(absl::StrCat(
                                "the ", backend.Name(), " backend opens no CUDA IPC handles"));
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat(where, field, ".handle: ",
                                                               opened.status().message()));
    }
    NORMGRAD_RETURN_IF_ERROR(CheckRegionRange(absl::StrCat(where, field, ".offset"),
                                              buffer->offset(), part_bytes, (*opened)->bytes,
                                              alignment));
    *address = (*opened)->address + buffer->offset();
    held.push_back(*std::move(opened));
  }
  // Two handles can name one allocation (bytes the driver ignores differ): only the device
  // addresses they open at tell whether grad_input overlaps what is read while it is written.
  const std::tuple<const char*, uint64_t, uint64_t> inputs[] = {
      {"cuda_ipc.x", rows.x, bytes},
      {"cuda_ipc.dy", rows.dy, bytes},
      {"cuda_ipc.rms", rows.rms, rms_provided ? chunk.num_rows * 4 : 0}};
  for (const auto& [field, address, in_bytes] : inputs) {
    if (in_bytes == 0) continue;
    if (absl::string_view(field) == "cuda_ipc.dy" && rows.dx == rows.dy) continue;  // in place
    if (rows.dx < address + in_bytes && address < rows.dx + bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "cuda_ipc.grad_input (", bytes, " bytes at device address 0x", absl::Hex(rows.dx),
          ") overlaps ", field, " (", in_bytes, " bytes at 0x", absl::Hex(address),
          "): their handles name the same device memory", kInPlaceRule));
    }
  }
  return rows;
}

}  // namespace normgrad::server
