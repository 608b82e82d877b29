// Barrier and shuffle safety over the control-flow graph (rather than a text heuristic such as
// looking for a literal `bra exit` inside loops).
//
//   absl::StatusOr<std::vector<DivergenceFinding>> f = AnalyzeDivergence(fn, LaunchAssumptions{});
//   absl::Status s = CheckDivergence(module, LaunchAssumptions{});  // FAILED_PRECONDITION if any
//
// How it works:
// 1. Uniformity of every register (flow-insensitive fixpoint over all its definitions) on the
//    lattice  uniform (same in the whole block) < warp-uniform (same in each warp)  and
//    lane-affine (32*w + lane, w warp-uniform: tid.x in a 1-D block) < divergent. Uniform and
//    warp-uniform integers also track "is a multiple of 32", so ctaid*ntid + tid is lane-affine
//    and (...) >> 5 warp-uniform. Loads from a (warp-)uniform address are (warp-)uniform;
//    shfl.idx from a uniform lane is warp-uniform; atomics and lane-dependent values are divergent.
// 2. A conditional branch (or guarded ret/exit) on a warp-uniform or divergent predicate makes the
//    blocks between it and its immediate post-dominator a divergent region of that level;
//    registers written inside the region are raised to that level (sync dependence). Because
//    ret/exit lead to a virtual exit node, a thread-dependent exit makes everything after it part
//    of the region: "after a divergent exit" is the same fact.
// 3. Findings: bar.sync in a warp-uniform or divergent region (some threads of the block may be
//    elsewhere or gone), or guarded by such a predicate; a full-mask (0xffffffff) shfl.sync in a
//    divergent region or under a divergent guard, or anywhere when blocks are not whole warps.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

// Facts about the launch that the kernels' Geometry() guarantees.
struct LaunchAssumptions {
  bool one_dimensional_block = true;   // ntid.y == ntid.z == 1, so tid.x = 32 * warp + lane
  bool block_x_multiple_of_32 = true;  // every warp has 32 threads
};

enum class DivergenceHazard {
  kBarrierUnderDivergence,  // bar.sync not reached by every thread of the block
  kShuffleUnderDivergence,  // full-mask shfl.sync with lanes of the warp inactive or exited
};

struct DivergenceFinding {
  size_t instruction = 0;  // index into Function::instructions()
  DivergenceHazard hazard = DivergenceHazard::kBarrierUnderDivergence;
  bool after_exit = false;  // the missing threads may have exited (not merely branched away)
  std::string message;      // "entry e, instruction 12 (bar.sync 0): ..."
};

// Every hazard in `function`. INVALID_ARGUMENT only when the CFG cannot be built.
absl::StatusOr<std::vector<DivergenceFinding>> AnalyzeDivergence(
    const Function& function, const LaunchAssumptions& assumptions);

// OK when no entry of `module` has a finding; FAILED_PRECONDITION listing them otherwise.
absl::Status CheckDivergence(const Module& module, const LaunchAssumptions& assumptions);

}  // namespace normgrad::kernels
