// The CUDA backend's BackwardSession: how one batch's chunks are computed by its GPU kernel.
// Two paths:
//   ProcessChunk                  the chunk's rows copied to the device in pieces that alternate
//                                 between a staging slot's two streams, the kernel's launches,
//                                 dx and the piece's f32 grad_gamma copied back (DeviceChunk);
//   ProcessDeviceChunk            rows already in device memory (CUDA IPC): the kernel runs on
//                                 them in place (DeviceChunkInPlace).
// A batch no GPU kernel takes is not computed here: the backend hands it to the one CPU path, the
// CPU backend (CudaBackendOptions::host).
// Where the kernel leaves grad_gamma to its caller (BackwardDataFlow::writes_dgamma false with a
// gamma), the host computes it from the chunk and the given rms, reading each piece's dy before
// its dx is written (dx may be dy's own memory: in place). A batch without gamma has no
// grad_gamma: no gamma is uploaded and nothing is read back. grad_gamma is added (double) in piece and
// chunk order: the same chunks give the same bits where the kernel's own sum is reproducible.
//
// Device memory of a chunk lies in a slot borrowed from the backend's StagingPool for the chunk
// only: gamma, x, dy, dx (and rms), the kernel's workspace, and the chunk's f32 grad_gamma.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backward_kernel.h"
#include "server/backend/backend.h"
#include "server/backend/backward_session_base.h"
#include "server/cuda/device_context.h"
#include "server/cuda/module_loader.h"
#include "server/cuda/staging_pool.h"

namespace normgrad::server::cuda_internal {

class CudaBackwardSession : public backend_internal::BackwardSessionBase {
 public:
  // module: the plan's kernel, loaded in the device's context. gamma: hidden_dim elements of
  // spec.dtype as given. piece_bytes: bytes of x per piece of a chunk (CudaBackendOptions).
  CudaBackwardSession(std::shared_ptr<const DeviceContext> ctx, const kernels::BackwardRequest& spec,
                      kernels::BackwardPlan plan, std::shared_ptr<const LoadedModule> module,
                      std::vector<uint8_t> gamma, std::shared_ptr<StagingPool> staging,
                      uint64_t piece_bytes);

  absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows,
                            absl::Span<uint8_t> dx) override;
  absl::Status ProcessDeviceChunk(const DeviceRows& rows) override;
  absl::string_view KernelName() const override;

  // Rows per piece of a chunk of `rows`: about piece_bytes of x each, at least one row; a
  // function of the shape only, so the same chunk is cut the same way.
  uint64_t PieceRows(uint64_t rows) const;

 private:
  // Offsets of the parts of a staging slot, 256-byte aligned.
  class SlotLayout {
   public:
    size_t Add(size_t bytes) {
      const size_t at = bytes_;
      bytes_ += (bytes + 255) / 256 * 256;
      return at;
    }
    size_t bytes() const { return bytes_; }

   private:
    size_t bytes_ = 0;
  };
  // Where DeviceChunk's parts lie in the slot: host_* in pinned memory, the rest on the device;
  // [i]: stream i's own.
  struct ChunkLayout {
    size_t host_gamma = 0, host_x = 0, host_dy = 0, host_rms = 0, host_dx = 0;
    size_t host_dgamma[StagingSlot::kStreams] = {};
    size_t gamma[StagingSlot::kStreams] = {};
    size_t x = 0, dy = 0, dx = 0, rms = 0;
    size_t workspace[StagingSlot::kStreams] = {};
    size_t dgamma[StagingSlot::kStreams] = {};
  };
  // The chunk DeviceChunk pipelines: its rows as the caller passed them.
  struct ChunkBuffers {
    absl::Span<const uint8_t> x, dy;
    absl::Span<const float> rms;
    absl::Span<uint8_t> dx;
    bool in_place;        // x, dy, rms and dx in registered host memory: no staging copies
    bool rms_to_device;   // the kernel reads the given rms
    size_t dgamma_bytes;  // the kernel's f32 grad_gamma on the device; 0: see host_dgamma
    bool host_dgamma;     // the host adds grad_gamma (a gamma, and the kernel leaves it)
  };
  // Piece p of a chunk: its stream, rows and byte range in the chunk's rows.
  struct Piece {
    uint64_t index = 0;
    int stream = 0;  // p % 2
    uint64_t first = 0, rows = 0;
    size_t off = 0, bytes = 0;  // of x, dy and dx
  };
  // Device memory a launch uses besides the rows: gamma, grad_gamma (0: not on the device), the
  // workspace and the semaphores.
  struct LaunchScratch {
    uint64_t gamma = 0, dgamma = 0, workspace = 0, semaphores = 0;
  };

  absl::Status DeviceChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                           absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx);
  absl::Status DeviceChunkInPlace(const DeviceRows& in);

  Piece PieceOf(uint64_t p, uint64_t piece_rows, uint64_t chunk_rows) const;
  absl::Status IssuePiece(const StagingSlot& slot, const ChunkLayout& at, const ChunkBuffers& c,
                          const Piece& piece);
  absl::Status CompletePiece(const StagingSlot& slot, const ChunkLayout& at, const ChunkBuffers& c,
                             const Piece& piece);
  // The kernel's launches for `rows` with `scratch`, on `stream`: the one place launch arguments
  // are filled.
  absl::Status RunKernel(const DeviceRows& rows, const LaunchScratch& scratch, CUstream stream);

  // Runs `work(slot)` with a slot of the staging pool, then gives the slot back, or drops it
  // when the work failed (its streams may hold half a chunk).
  template <typename Work>
  absl::Status WithSlot(size_t host_bytes, size_t device_bytes, Work work);

  // grad_gamma_i += dy_ri * x_ri / rms_r in row order (double), where the kernel leaves it to
  // the host. Converted to f32 a few rows at a time (GradGammaTileRows).
  void AddHostGradGamma(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                        absl::Span<const float> rms, uint64_t rows);
  // Rows converted to f32 at once for AddHostGradGamma: kHostStagingElements elements, or one row
  // when rows are wider, so the f32 copies held do not grow with the chunk (at most
  // 12 x max(kHostStagingElements, hidden_dim) bytes per session computing).
  static constexpr uint64_t kHostStagingElements = 16384;
  uint64_t GradGammaTileRows() const;

  const std::shared_ptr<const DeviceContext> ctx_;
  const std::shared_ptr<StagingPool> staging_;
  const uint64_t piece_bytes_;
  const kernels::BackwardPlan plan_;
  const std::shared_ptr<const LoadedModule> module_;  // the plan's kernel
  const size_t element_bytes_;
  const std::vector<uint8_t> gamma_;
};

}  // namespace normgrad::server::cuda_internal
