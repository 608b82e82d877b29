#include "server/cuda/cuda_session.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/backend/batch_checks.h"
#include "server/cuda/cuda_launcher.h"
#include "server/host_rows/element_conversion.h"

namespace normgrad::server::cuda_internal {

CudaBackwardSession::CudaBackwardSession(std::shared_ptr<const DeviceContext> ctx,
                                         const kernels::BackwardRequest& spec,
                                         kernels::BackwardPlan plan,
                                         std::shared_ptr<const LoadedModule> module,
                                         std::vector<uint8_t> gamma,
                                         std::shared_ptr<StagingPool> staging, uint64_t piece_bytes)
    : BackwardSessionBase(spec),
      ctx_(std::move(ctx)),
      staging_(std::move(staging)),
      piece_bytes_(std::max<uint64_t>(piece_bytes, 1)),
      plan_(std::move(plan)),
      module_(std::move(module)),
      element_bytes_(backend_internal::ElementBytes(spec.dtype)),
      gamma_(std::move(gamma)) {}

absl::Status CudaBackwardSession::ProcessChunk(absl::Span<const uint8_t> x,
                                               absl::Span<const uint8_t> dy,
                                               absl::Span<const float> rms, uint64_t rows,
                                               absl::Span<uint8_t> dx) {
  NORMGRAD_RETURN_IF_ERROR(broken_);
  NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
  NORMGRAD_RETURN_IF_ERROR(
      backend_internal::CheckChunk(spec_, rows_done_, rows, x.size(), dy.size(), rms, dx.size()));
  return Compute(rows, [&] { return DeviceChunk(x, dy, rms, rows, dx); });
}

absl::Status CudaBackwardSession::ProcessDeviceChunk(const DeviceRows& rows) {
  NORMGRAD_RETURN_IF_ERROR(broken_);
  NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
  if (rows.rows == 0 || rows.rows > spec_.num_rows - rows_done_) {
    return absl::InvalidArgumentError(absl::StrCat("a device chunk of ", rows.rows, " rows after ",
                                                   rows_done_, " of ", spec_.num_rows));
  }
  return Compute(rows.rows, [&] { return DeviceChunkInPlace(rows); });
}

absl::string_view CudaBackwardSession::KernelName() const {
  return plan_.kernel().EntryName();
}

uint64_t CudaBackwardSession::PieceRows(uint64_t rows) const {
  const uint64_t row_bytes = uint64_t{spec_.hidden_dim} * element_bytes_;
  return std::clamp<uint64_t>(piece_bytes_ / row_bytes, 1, rows);
}

absl::Status CudaBackwardSession::RunKernel(const DeviceRows& rows, const LaunchScratch& scratch,
                                            CUstream stream) {
  const kernels::BackwardPlan& plan = plan_;
  if (plan.SemaphoreBytes(rows.rows) > StagingSlot::kSemaphoreBytes) {
    // A grid far beyond any device's.
    return absl::InternalError(
        absl::StrCat(plan.kernel().EntryName(), " needs ", plan.SemaphoreBytes(rows.rows),
                     " bytes of semaphores for ", rows.rows, " rows; a staging slot has ",
                     StagingSlot::kSemaphoreBytes));
  }
  kernels::BackwardArgs args;
  args.x = rows.x;
  args.dy = rows.dy;
  args.dx = rows.dx;
  args.rms = rows.rms;
  args.rows = rows.rows;
  args.gamma = scratch.gamma;
  args.dgamma = scratch.dgamma;
  args.workspace = scratch.workspace;
  args.semaphores = scratch.semaphores;
  args.hidden_dim = spec_.hidden_dim;
  args.eps = spec_.eps;
  CudaLauncher launcher(*module_, stream);
  return plan.Run(args, launcher);
}

template <typename Work>
absl::Status CudaBackwardSession::WithSlot(size_t host_bytes, size_t device_bytes, Work work) {
  NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<StagingSlot> slot,
                            staging_->Acquire(host_bytes, device_bytes));
  absl::Status s = work(*slot);
  if (s.ok()) {
    staging_->Return(std::move(slot));
  } else {
    staging_->Drop(std::move(slot));
  }
  return s;
}

// One chunk on the device, in a slot of the staging pool held for this call only, as a pipeline
// of pieces of PieceRows() rows that alternate between the slot's two streams. Each piece is: its
// rows staged into pinned memory (host), copied to the device, the kernel's launches, dx and its
// grad_gamma copied back. Piece p+1 is staged and issued before the host waits for piece p, so
// the host's staging copies, the copies in each direction (PCIe is full duplex) and the kernels
// of neighbouring pieces overlap; the host then copies piece p's dx out while the device works on
// p+1. Each stream has its own gamma, workspace, semaphores and grad_gamma, so the two streams
// share nothing but the rows' disjoint ranges.
//
// Slot layout: pinned [gamma | x | dy | rms | dx | grad_gamma x2] (x, dy, rms and dx only when
// the chunk is not in registered host memory), device [gamma x2 | x | dy | dx | rms |
// workspace x2 | grad_gamma x2], each part 256-byte aligned.
absl::Status CudaBackwardSession::DeviceChunk(absl::Span<const uint8_t> x,
                                              absl::Span<const uint8_t> dy,
                                              absl::Span<const float> rms, uint64_t rows,
                                              absl::Span<uint8_t> dx) {
  const kernels::BackwardPlan& plan = plan_;
  const kernels::BackwardDataFlow flow = plan.DataFlow();
  const size_t h = spec_.hidden_dim;
  const size_t data_bytes = rows * h * element_bytes_;
  const size_t rms_bytes = flow.reads_rms && spec_.rms_provided ? rows * sizeof(float) : 0;
  const size_t dgamma_bytes = flow.writes_dgamma ? h * sizeof(float) : 0;
  const uint64_t piece_rows = PieceRows(rows);
  const int streams = rows > piece_rows ? StagingSlot::kStreams : 1;
  // A chunk whose x, dy, rms and dx all lie in registered host memory (a shared-memory region)
  // is copied straight from and to it; any other goes through pinned staging.
  const bool in_place = ctx_->IsRegisteredHost(x.data(), data_bytes) &&
                        ctx_->IsRegisteredHost(dy.data(), data_bytes) &&
                        (rms_bytes == 0 || ctx_->IsRegisteredHost(rms.data(), rms_bytes)) &&
                        ctx_->IsRegisteredHost(dx.data(), data_bytes);
  const size_t staged = in_place ? 0 : data_bytes;
  const size_t staged_rms = in_place ? 0 : rms_bytes;
  ChunkLayout at;
  SlotLayout host;
  at.host_gamma = host.Add(gamma_.size());
  at.host_x = host.Add(staged);
  at.host_dy = host.Add(staged);
  at.host_rms = host.Add(staged_rms);
  at.host_dx = host.Add(staged);
  SlotLayout device;
  for (int i = 0; i < streams; ++i) at.gamma[i] = device.Add(gamma_.size());
  at.x = device.Add(data_bytes);
  at.dy = device.Add(data_bytes);
  at.dx = device.Add(data_bytes);
  at.rms = device.Add(rms_bytes);
  for (int i = 0; i < streams; ++i) {
    at.workspace[i] = device.Add(plan.WorkspaceBytes(piece_rows));
    at.dgamma[i] = device.Add(dgamma_bytes);
    at.host_dgamma[i] = host.Add(dgamma_bytes);
  }
  return WithSlot(host.bytes(), device.bytes(), [&](const StagingSlot& slot) -> absl::Status {
    NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
    if (!gamma_.empty()) std::memcpy(slot.host + at.host_gamma, gamma_.data(), gamma_.size());
    const ChunkBuffers chunk{x,           dy,           rms, dx, in_place, rms_bytes != 0,
                          dgamma_bytes, !flow.writes_dgamma && spec_.variant.has_gamma};
    const uint64_t pieces = (rows + piece_rows - 1) / piece_rows;
    Piece next = PieceOf(0, piece_rows, rows);
    NORMGRAD_RETURN_IF_ERROR(IssuePiece(slot, at, chunk, next));
    for (uint64_t p = 0; p < pieces; ++p) {
      const Piece piece = next;
      if (p + 1 < pieces) {
        next = PieceOf(p + 1, piece_rows, rows);
        NORMGRAD_RETURN_IF_ERROR(IssuePiece(slot, at, chunk, next));
      }
      NORMGRAD_RETURN_IF_ERROR(CompletePiece(slot, at, chunk, piece));
    }
    return absl::OkStatus();
  });
}

CudaBackwardSession::Piece CudaBackwardSession::PieceOf(uint64_t p, uint64_t piece_rows,
                                                        uint64_t chunk_rows) const {
  Piece piece;
  piece.index = p;
  piece.stream = static_cast<int>(p % StagingSlot::kStreams);
  piece.first = p * piece_rows;
  piece.rows = std::min(piece_rows, chunk_rows - piece.first);
  piece.off = piece.first * spec_.hidden_dim * element_bytes_;
  piece.bytes = piece.rows * spec_.hidden_dim * element_bytes_;
  return piece;
}

// Stages a piece's rows (unless in place) and issues its copies and launches on its stream. A
// stream's first piece of the chunk also copies gamma (if any) to that stream's own copy. Where
// the host adds grad_gamma, it does so here, before the piece's dx may overwrite its dy.
absl::Status CudaBackwardSession::IssuePiece(const StagingSlot& slot, const ChunkLayout& at,
                                             const ChunkBuffers& c, const Piece& piece) {
  const cuda::DriverApi& api = ctx_->api();
  const int s = piece.stream;
  const CUstream stream = slot.streams[s];
  const uint64_t rows = piece.rows;
  const size_t off = piece.off, bytes = piece.bytes;
  const size_t rms_off = piece.first * sizeof(float);
  const size_t rms_bytes = c.rms_to_device ? rows * sizeof(float) : 0;
  uint8_t* const pinned = slot.host;
  const CUdeviceptr dev = slot.device;
  if (c.host_dgamma) {
    AddHostGradGamma(c.x.subspan(off, bytes), c.dy.subspan(off, bytes),
                     c.rms.subspan(piece.first, piece.rows), piece.rows);
  }
  if (piece.index < StagingSlot::kStreams && !gamma_.empty()) {
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
        api.cuMemcpyHtoDAsync_v2(dev + at.gamma[s], pinned + at.host_gamma, gamma_.size(), stream),
        "cuMemcpyHtoDAsync(gamma)"));
  }
  const uint8_t* x_host = c.x.data() + off;
  const uint8_t* dy_host = c.dy.data() + off;
  // No offset into an absent rms (null + offset is undefined even unused).
  const uint8_t* rms_host =
      rms_bytes != 0 ? reinterpret_cast<const uint8_t*>(c.rms.data()) + rms_off : nullptr;
  if (!c.in_place) {
    std::memcpy(pinned + at.host_x + off, x_host, bytes);
    std::memcpy(pinned + at.host_dy + off, dy_host, bytes);
    if (rms_bytes != 0) std::memcpy(pinned + at.host_rms + rms_off, rms_host, rms_bytes);
    x_host = pinned + at.host_x + off;
    dy_host = pinned + at.host_dy + off;
    rms_host = pinned + at.host_rms + rms_off;
  }
  NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
      api.cuMemcpyHtoDAsync_v2(dev + at.x + off, x_host, bytes, stream), "cuMemcpyHtoDAsync(x)"));
  NORMGRAD_RETURN_IF_ERROR(
      ctx_->Check(api.cuMemcpyHtoDAsync_v2(dev + at.dy + off, dy_host, bytes, stream),
                  "cuMemcpyHtoDAsync(dy)"));
  if (rms_bytes != 0) {
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuMemcpyHtoDAsync_v2(dev + at.rms + rms_off, rms_host, rms_bytes, stream),
                    "cuMemcpyHtoDAsync(rms)"));
  }
  const DeviceRows piece_rows{dev + at.x + off, dev + at.dy + off,
                              rms_bytes != 0 ? dev + at.rms + rms_off : 0, dev + at.dx + off, rows};
  const LaunchScratch scratch{dev + at.gamma[s], c.dgamma_bytes != 0 ? dev + at.dgamma[s] : 0,
                              dev + at.workspace[s], slot.semaphores[s]};
  NORMGRAD_RETURN_IF_ERROR(RunKernel(piece_rows, scratch, stream));
  NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
      api.cuMemcpyDtoHAsync_v2(c.in_place ? c.dx.data() + off : pinned + at.host_dx + off,
                               dev + at.dx + off, bytes, stream),
      "cuMemcpyDtoHAsync(dx)"));
  if (c.dgamma_bytes != 0) {
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuMemcpyDtoHAsync_v2(pinned + at.host_dgamma[s], dev + at.dgamma[s],
                                             c.dgamma_bytes, stream),
                    "cuMemcpyDtoHAsync(grad_gamma)"));
  }
  return absl::OkStatus();
}

// Waits for a piece (its stream holds nothing issued after it: the next piece on that stream is
// issued only after this), then copies its dx out of pinned memory and adds the kernel's
// grad_gamma.
absl::Status CudaBackwardSession::CompletePiece(const StagingSlot& slot, const ChunkLayout& at,
                                                const ChunkBuffers& c, const Piece& piece) {
  const size_t off = piece.off, bytes = piece.bytes;
  NORMGRAD_RETURN_IF_ERROR(ctx_->Synchronize(slot.streams[piece.stream]));
  if (!c.in_place) std::memcpy(c.dx.data() + off, slot.host + at.host_dx + off, bytes);
  if (c.dgamma_bytes != 0) {
    const float* piece_dgamma =
        reinterpret_cast<const float*>(slot.host + at.host_dgamma[piece.stream]);
    for (size_t i = 0; i < spec_.hidden_dim; ++i) dgamma_sum_[i] += piece_dgamma[i];
  }
  return absl::OkStatus();
}

// One chunk whose rows are in device memory (CUDA IPC): the kernel runs on them where they are
// (dx may be dy's own range: every kernel reads a dy element before that dx element is written).
// The slot holds only gamma, the workspace and grad_gamma on the device; where the kernel leaves
// grad_gamma to the host, x, dy and rms come to pinned memory for it, copied before the launch
// (which may overwrite dy).
absl::Status CudaBackwardSession::DeviceChunkInPlace(const DeviceRows& in) {
  const kernels::BackwardPlan& plan = plan_;
  const kernels::BackwardDataFlow flow = plan.DataFlow();
  const cuda::DriverApi& api = ctx_->api();
  const size_t h = spec_.hidden_dim;
  const uint64_t rows = in.rows;
  const size_t data_bytes = rows * h * element_bytes_;
  const bool rms_to_device = flow.reads_rms && spec_.rms_provided;
  const bool dgamma_on_device = flow.writes_dgamma;
  const bool host_dgamma = !dgamma_on_device && spec_.variant.has_gamma;
  if ((rms_to_device || host_dgamma) && in.rms == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(plan.kernel().EntryName(), " needs the forward pass's rms for each row"));
  }
  const size_t dgamma_bytes = dgamma_on_device ? h * sizeof(float) : 0;
  const size_t to_host = host_dgamma ? data_bytes : 0;
  const size_t rms_to_host = host_dgamma ? rows * sizeof(float) : 0;
  SlotLayout host;
  const size_t h_gamma = host.Add(gamma_.size()), h_dgamma = host.Add(dgamma_bytes),
               h_x = host.Add(to_host), h_dy = host.Add(to_host), h_rms = host.Add(rms_to_host);
  SlotLayout device;
  const size_t d_gamma = device.Add(gamma_.size()),
               d_workspace = device.Add(plan.WorkspaceBytes(rows)),
               d_dgamma = device.Add(dgamma_bytes);
  return WithSlot(host.bytes(), device.bytes(), [&](const StagingSlot& slot) -> absl::Status {
    uint8_t* const pinned = slot.host;
    const CUdeviceptr dev = slot.device;
    const CUstream stream = slot.streams[0];
    NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
    if (!gamma_.empty()) {
      std::memcpy(pinned + h_gamma, gamma_.data(), gamma_.size());
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
          api.cuMemcpyHtoDAsync_v2(dev + d_gamma, pinned + h_gamma, gamma_.size(), stream),
          "cuMemcpyHtoDAsync(gamma)"));
    }
    if (host_dgamma) {
      // Stream order: copied before the launch writes dx, which may be dy's range.
      for (auto [to, from, bytes, what] :
           {std::tuple{h_x, in.x, data_bytes, "x"}, std::tuple{h_dy, in.dy, data_bytes, "dy"},
            std::tuple{h_rms, in.rms, rms_to_host, "rms"}}) {
        NORMGRAD_RETURN_IF_ERROR(
            ctx_->Check(api.cuMemcpyDtoHAsync_v2(pinned + to, from, bytes, stream),
                        absl::StrCat("cuMemcpyDtoHAsync(", what, ")")));
      }
    }
    const DeviceRows on_device{in.x, in.dy, rms_to_device ? in.rms : 0, in.dx, rows};
    const LaunchScratch scratch{dev + d_gamma, dgamma_on_device ? dev + d_dgamma : 0,
                                dev + d_workspace, slot.semaphores[0]};
    NORMGRAD_RETURN_IF_ERROR(RunKernel(on_device, scratch, stream));
    if (dgamma_on_device) {
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
          api.cuMemcpyDtoHAsync_v2(pinned + h_dgamma, dev + d_dgamma, dgamma_bytes, stream),
          "cuMemcpyDtoHAsync(grad_gamma)"));
    }
    NORMGRAD_RETURN_IF_ERROR(ctx_->Synchronize(stream));
    if (dgamma_on_device) {
      const float* chunk_dgamma = reinterpret_cast<const float*>(pinned + h_dgamma);
      for (size_t i = 0; i < h; ++i) dgamma_sum_[i] += chunk_dgamma[i];
    } else if (host_dgamma) {
      AddHostGradGamma(absl::MakeConstSpan(pinned + h_x, data_bytes),
                       absl::MakeConstSpan(pinned + h_dy, data_bytes),
                       absl::MakeConstSpan(reinterpret_cast<const float*>(pinned + h_rms), rows),
                       rows);
    }
    return absl::OkStatus();
  });
}

void CudaBackwardSession::AddHostGradGamma(absl::Span<const uint8_t> x,
                                           absl::Span<const uint8_t> dy,
                                           absl::Span<const float> rms, uint64_t rows) {
  const size_t h = spec_.hidden_dim;
  const size_t tile = std::min<uint64_t>(rows, GradGammaTileRows());
  std::vector<float> xf(tile * h), yf(tile * h);
  for (uint64_t first = 0; first < rows; first += tile) {
    const size_t m = std::min<uint64_t>(tile, rows - first);
    host_rows::ConvertToF32(spec_.dtype, x.data() + first * h * element_bytes_, xf.data(), m * h);
    host_rows::ConvertToF32(spec_.dtype, dy.data() + first * h * element_bytes_, yf.data(), m * h);
    for (uint64_t r = 0; r < m; ++r) {
      const double inv_rms = 1.0 / static_cast<double>(rms[first + r]);
      for (size_t i = 0; i < h; ++i) {
        dgamma_sum_[i] += static_cast<double>(yf[r * h + i]) * xf[r * h + i] * inv_rms;
      }
    }
  }
}

uint64_t CudaBackwardSession::GradGammaTileRows() const {
  return std::max<uint64_t>(1, kHostStagingElements / spec_.hidden_dim);
}

}  // namespace normgrad::server::cuda_internal
