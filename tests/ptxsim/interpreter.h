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
// Blocks run one after another on the calling thread; the warps of a block run one at a time
// until each blocks at a barrier or exits. Launch() is reentrant: concurrent launches on
// different threads share nothing but `memory` (read) and the global memory they touch.
#ifndef NORMGRAD_TESTS_PTXSIM_INTERPRETER_H_
#define NORMGRAD_TESTS_PTXSIM_INTERPRETER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tests/ptxsim/memory_map.h"
#include "tests/ptxsim/module.h"

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
};

// kernel_params[i] points at the value of the entry's i-th parameter (entry.params[i].size
// bytes), exactly as cuLaunchKernel's kernelParams. Errors: INVALID_ARGUMENT for a bad launch
// (zero or too large dimensions, block above .maxntid or 1024 threads), INTERNAL for a
// sanitizer finding, DEADLINE_EXCEEDED for the instruction limit. The message names the kernel,
// block, thread, line and (for memory) the address.
absl::Status Launch(const Entry& entry, const LaunchConfig& config, void* const* kernel_params,
                    const MemoryMap& memory, LaunchReport* report);

}  // namespace normgrad::ptxsim

#endif  // NORMGRAD_TESTS_PTXSIM_INTERPRETER_H_
