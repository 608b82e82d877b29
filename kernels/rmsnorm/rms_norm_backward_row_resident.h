// RMSNorm backward that reads x and dy from global memory once and writes dx and a reproducible
// grad_gamma in one launch.
//
//   `rms_norm_backward_row_resident`: a persistent grid of G blocks (Geometry: the device's SM
//   count times the blocks the entry's `.minnctapersm` keeps resident on one SM) takes rows in a
//   grid-stride loop. A block holds one row in registers (each thread a fixed set of columns)
//   between the two block reductions (sum x^2 and sum x*gamma*dy: warp shuffles, then shared
//   memory + bar.sync, summed in warp order) and the output, so x and dy are read once and dx
//   written once. Loads and stores are 16-byte vectors (ld/st.global.v4.f32, or .v4.u32 holding
//   eight f16/bf16) when every row start is 16-byte aligned, else element by element; the tail of
//   any hidden_dim is element by element. grad_gamma: each thread accumulates its columns over
//   the block's rows in fp32 registers; then the blocks' sums are added by a last-block-done tree
//   (fan-in kFanIn, through the workspace and a few u32 semaphores) whose order depends only on
//   G, and the block that finishes last writes dgamma (f32). No waiting between blocks, no
//   atomics on data.
//
//   Rows wider than a block can hold (hidden_dim > kMaxHeldHiddenDim, up to kMaxHiddenDim) are
//   streamed instead: a block of 1024 threads reads the row twice, in segments of 1024 16-byte
//   vectors (pass 1: the two sums, x and dy kept in L2 with .cg; pass 2: dx, x and dy loaded
//   .cs), and keeps its grad_gamma sums in its own workspace row (level 0 of the same tree,
//   added to in place, .cg) instead of registers; the tree then sums rows segment by segment.
//   Same math, same per-thread column order, same tree order: one launch, reproducible.
//
// In place: dx may be exactly dy (grad_input_ptr == grad_output_ptr). Each thread reads the dy of
// its own columns of a row (held: all of them, before the reduction; streamed: each segment in
// pass 2) before it writes dx to those same columns, and no thread writes a column another reads.
//
// Same inputs and the same G give the same bits, run after run. G depends on num_rows and
// KernelConfig::sm_count, so results are bitwise equal for equal (rows, sm_count), and equal to
// the reference within the f32 tolerance for any G.
//
//   KernelConfig config{.hidden_dim = 4096, .dtype = DType::kBF16, .target_sm = 90,
//                       .sm_count = 132};
//   const BackwardKernel* k = FindKernel("rms_norm_backward_row_resident");
//   LaunchGeometry g = k->Geometry(config, num_rows);   // g.grid[0] = G
//   ... launch with (x, gamma, dy, dx, rms or 0, dgamma, workspace, semaphores, num_rows,
//   hidden_dim, eps): workspace TreeRows(G) x stride f32, semaphores TreeSemaphores(G) u32 that
//   are zero (the launch leaves them zero). Run (kernels/backward_kernel.h) does all of this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/built_kernel.h"
#include "kernels/kernel_config.h"
#include "kernels/ptx/ptx_builder.h"

namespace normgrad::kernels {

// How a row is spread over a block; baked into the PTX, so part of ConfigKey ("tile=TxKxN").
// Thread t holds columns t*V + k*T*V + j for k < K, j < V: K 16-byte vectors per row.
struct RowTiling {
  uint32_t threads = 0;             // T = block.x: 256, 512 or 1024
  uint32_t vectors_per_thread = 0;  // K
  uint32_t vector_elements = 0;     // V: 4 for f32, 8 for f16/bf16 (16 bytes)
  uint32_t blocks_per_sm = 0;       // N: the entry's .minnctapersm; G = sm_count * N
  // The row is streamed (read twice, K segments of T vectors, grad_gamma sums in the workspace)
  // rather than held in registers: hidden_dim > kMaxHeldHiddenDim. Key: "tile=TxKxNs".
  bool streamed = false;
  uint32_t capacity() const { return threads * vectors_per_thread * vector_elements; }
  uint32_t elements_per_thread() const { return vectors_per_thread * vector_elements; }
};

// `rms_norm_backward_row_resident`.
// Params: input_ptr, gamma_ptr, grad_output_ptr, grad_input_ptr, rms_ptr, dgamma_ptr,
//         dgamma_partials_ptr, semaphores_ptr (u64), num_rows, hidden_dim (u32), eps (f32).
// rms_ptr == 0: rms recomputed from x and eps; otherwise rms_ptr[row] (f32, the forward's rms,
// already containing eps) is used as is. dgamma_ptr: f32 [hidden_dim], written.
// dgamma_partials_ptr: the tree's workspace, f32 [WorkspaceRows(config, grid.x), capacity()] in
// the threads' order, 16-byte aligned. semaphores_ptr: u32 [TreeSemaphores(grid.x)], zero before
// the launch; the launch leaves them zero (so a caller zeroes them once, when it allocates them).
// hidden_dim: CanImplement accepts 1..kMaxHiddenDim. Up to kMaxHeldHiddenDim (32 elements per
// thread at 512 threads) the row is held in registers; above, streamed (the top of this file;
// docs/kernels.md, "Row-resident kernel"). Wider still: batched_rms_norm_backward. The run-time
// hidden_dim must be at most the tiling's capacity for config.hidden_dim (equal is the normal
// use; a smaller one works, a larger one only processes the first capacity() columns).
class RowResidentRmsNormBackwardKernel : public BuiltKernel {
 public:
  // The row is held as x, dy (f32) and the thread's grad_gamma accumulators: 3 registers per
  // element. 512 threads x 32 elements keeps that under the 128 registers per thread a 512-thread
  // block may use (checked with ptxas by the tests).
  static constexpr uint32_t kMaxHeldHiddenDim = 16384;
  // Streamed rows: up to the server's default --max-hidden-dim.
  static constexpr uint32_t kMaxHiddenDim = 65536;
  static constexpr uint32_t kStreamedThreads = 1024;
  // Up to this many elements per thread, kResidentThreadsPerSm threads are resident per SM
  // (64 registers each, the entry's .minnctapersm).
  static constexpr uint32_t kPreferredElementsPerThread = 8;
  static constexpr uint32_t kMaxElementsPerThread = 32;
  static constexpr uint32_t kResidentThreadsPerSm = 1024;
  // Rows wider than 1024 threads x kPreferredElementsPerThread: 512 threads, one block per SM.
  static constexpr uint32_t kWideRowThreads = 512;
  static constexpr uint32_t kMaxThreads = 1024;
  // Used by Geometry when KernelConfig::sm_count is 0 (unknown): an H100 SXM's 132 SMs.
  static constexpr uint32_t kDefaultSmCount = 132;
  // Members per group of the grad_gamma tree (a power of two).
  static constexpr uint32_t kFanIn = 16;
  static constexpr uint32_t kLogFanIn = 4;

  // The tiling for config.hidden_dim and dtype: the smallest T in {256, 512, 1024} with
  // K*V <= kPreferredElementsPerThread (K = ceil(hidden_dim / (T*V))) and N = 1024 / T; above
  // that, T = 512 with up to kMaxElementsPerThread and N = 1; above kMaxHeldHiddenDim, streamed:
  // T = kStreamedThreads, K = ceil(hidden_dim / (T*V)) segments, N = 1.
  static RowTiling TilingFor(const KernelConfig& config);
  // Workspace rows and semaphores of the grad_gamma tree over `blocks` blocks: the sum of every
  // level's members (semaphores: groups) below the top, which has one.
  static uint32_t TreeRows(uint32_t blocks);
  static uint32_t TreeSemaphores(uint32_t blocks);
  // Workspace rows a launch of `blocks` blocks needs: TreeRows(blocks), and for a streamed tiling
  // at least 1 (a lone block still keeps its sums in row 0).
  static uint32_t WorkspaceRows(const KernelConfig& config, uint32_t blocks);

  static constexpr absl::string_view kEntryName = "rms_norm_backward_row_resident";

  RowResidentRmsNormBackwardKernel();
  // T of TilingFor(config): the tiling is baked into the PTX, so no other block size computes
  // the row.
  uint32_t BlockThreads(const KernelConfig& config) const override;
  // block.x = T; grid.x = G = clamp(min(num_rows, sm_count * N), 1, 2^31-1). shared_bytes = 0
  // (the reductions' shared arrays are static).
  LaunchGeometry Geometry(const KernelConfig& config, uint64_t num_rows) const override;
  // BuiltKernel's key plus "|tile=<T>x<K>x<N>" ("s" appended for a streamed tiling).
  std::string ConfigKey(const KernelConfig& config) const override;
  absl::StatusOr<Module> Build(const KernelConfig& config) const override;

  // Reads a given rms (optional); writes a reproducible f32 dgamma.
  BackwardDataFlow DataFlow() const override;
  // The tree's workspace rows and semaphores for the grid Geometry gives `rows`; 0 without gamma.
  uint64_t WorkspaceBytes(const KernelConfig& config, uint64_t rows) const override;
  uint64_t SemaphoreBytes(const KernelConfig& config, uint64_t rows) const override;

 protected:
  // Every variant (docs/kernels.md, "Variants"): scale = gamma_offset + gamma (one f32 add after
  // the load), or 1 without gamma (no gamma loads and no grad_gamma: no accumulators, no tree,
  // no workspace or semaphores, dgamma_ptr never touched); casting llama and none round
  // dy * scale to the element type, llama also x / rms before grad_gamma. f32 ignores the casting
  // mode and no gamma ignores both offset and casting: ConfigKey names the variant as emitted.
  bool ImplementsVariant(const NormVariant& variant) const override;
  // One launch takes every row: its num_rows is u32.
  uint64_t MaxRows() const override;
  // One launch of G blocks writes dx and, through the tree, dgamma.
  absl::Status Launch(const KernelConfig& config, const BackwardArgs& args,
                      KernelLauncher& launcher) const override;
};

}  // namespace normgrad::kernels
