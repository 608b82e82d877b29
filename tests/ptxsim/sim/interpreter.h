// Executes one kernel launch of a decoded PTX entry on the CPU with the GPU's SIMT semantics,
// and checks what compute-sanitizer would (docs/ptxsim.md):
//
//   LaunchConfig config;
//   config.grid = {num_rows, 1, 1};
//   config.block = {32, 1, 1};
//   void* params[] = {&x_ptr, &gamma_ptr, ..., &eps};   // like cuLaunchKernel's kernelParams
//   LaunchReport report;
//   absl::Status s = Launch(*module.FindEntry("batched_rms_norm_backward"), config, params,
//                           memory, &report);
//   // !s.ok(): report.finding says what went wrong; s.message() is the diagnosis.
//
// Blocks run one after another on the calling thread (in index order, or reversed); the warps of a
// block run one at a time until each blocks at a barrier or exits. Launch() is reentrant:
// concurrent launches on different threads share nothing but `memory` (read) and the global memory
// they touch.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tests/ptxsim/sim/memory_map.h"
#include "tests/ptxsim/sim/module.h"

namespace normgrad::ptxsim {

struct Dim3 {
  uint32_t x = 1;
  uint32_t y = 1;
  uint32_t z = 1;
};

struct LaunchConfig {
  Dim3 grid;
  Dim3 block;
  uint32_t dynamic_shared_bytes = 0;
  // Bound on executed warp-instructions for the whole launch (a hung kernel becomes a finding,
  // not a hung test).
  uint64_t max_warp_instructions = uint64_t{1} << 36;
  // Blocks run from the last to the first instead (blocks that count arrivals, such as a
  // last-block-done reduction, then see another arrival order).
  bool reverse_block_order = false;
  // Count global-memory traffic into LaunchReport::traffic (off by default: it costs time).
  bool count_traffic = false;
  // With count_traffic: address ranges (a workspace, say) whose distinct sectors are also
  // reported apart, in TrafficReport::marked_read_bytes / marked_written_bytes.
  std::vector<MemoryRange> traffic_marked;
};

// Global-memory traffic of a launch, counted the way the hardware moves memory: in 32-byte
// sectors. Every warp-level ld/st/atom/red whose address is global (ld.global, or generic outside
// the shared window) counts; an atom or red counts as a load and a store of its sectors. Sums of
// several launches are meaningful (operator+=); ratios are computed from the sums.
struct TrafficReport {
  static constexpr uint64_t kSectorBytes = 32;
  uint64_t accesses = 0;  // warp-level access instructions (an atomic counts twice)
  // Per access: the distinct sectors its active lanes touch x 32 (what L1/L2 serve; a sector
  // read again by another access counts again), and the bytes the lanes asked for (each byte
  // once per access: lanes reading the same word ask for it once).
  uint64_t requested_sector_bytes = 0;
  uint64_t useful_bytes = 0;
  // Per launch: the distinct sectors read and written x 32 (the compulsory DRAM traffic: a
  // sector read by many warps counts once, as a cache would serve it). A sector that two
  // allocations share counts once for each.
  uint64_t read_bytes = 0;
  uint64_t written_bytes = 0;
  // The part of read_bytes / written_bytes inside LaunchConfig::traffic_marked.
  uint64_t marked_read_bytes = 0;
  uint64_t marked_written_bytes = 0;

  // useful / requested (1 when nothing was requested).
  double SectorEfficiency() const {
    return requested_sector_bytes == 0
               ? 1.0
               : static_cast<double>(useful_bytes) / static_cast<double>(requested_sector_bytes);
  }
  TrafficReport& operator+=(const TrafficReport& o) {
    accesses += o.accesses;
    requested_sector_bytes += o.requested_sector_bytes;
    useful_bytes += o.useful_bytes;
    read_bytes += o.read_bytes;
    written_bytes += o.written_bytes;
    marked_read_bytes += o.marked_read_bytes;
    marked_written_bytes += o.marked_written_bytes;
    return *this;
  }
};

enum class Finding {
  kNone,
  kInvalidLaunch,          // geometry or parameters the entry cannot run with
  kOutOfBounds,            // global/shared access outside every live allocation
  kMisaligned,             // address not a multiple of the access size
  kShuffleMask,            // shfl.sync member mask names exited or diverged lanes
  kBarrier,                // bar.sync not reached by all non-exited threads of the block
  kUninitializedRegister,  // read of a register never written (in that thread)
  kNonUniformBranch,       // bra.uni taken by only some threads of the group
  kInstructionLimit,       // max_warp_instructions exceeded
};
absl::string_view FindingName(Finding finding);  // "out-of-bounds access", ...

struct LaunchReport {
  Finding finding = Finding::kNone;
  uint64_t warp_instructions = 0;    // instructions issued (one per warp group)
  uint64_t thread_instructions = 0;  // instructions executed by individual threads
  TrafficReport traffic;             // zero unless LaunchConfig::count_traffic
};

// kernel_params[i] points at the value of the entry's i-th parameter (entry.params[i].size
// bytes), exactly as cuLaunchKernel's kernelParams. Errors: INVALID_ARGUMENT for a bad launch
// (zero or too large dimensions, block above .maxntid or 1024 threads), INTERNAL for a
// sanitizer finding, DEADLINE_EXCEEDED for the instruction limit. The message names the kernel,
// block, thread, line and (for memory) the address.
absl::Status Launch(const Entry& entry, const LaunchConfig& config, void* const* kernel_params,
                    const MemoryMap& memory, LaunchReport* report);

}  // namespace normgrad::ptxsim
