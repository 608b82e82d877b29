// The control-flow graph of one Function: basic blocks split at labels and after every branch,
// ret and exit, plus one virtual exit node that every ret/exit (and falling off the end) reaches.
// Shared by the verifier (definite assignment) and the divergence analysis (post-dominators).
//
//   absl::StatusOr<Cfg> cfg = BuildCfg(function);
//   for (int s : cfg->blocks[0].succs) { ... }   // s == cfg->exit_node() for the virtual exit
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

struct BasicBlock {
  size_t begin = 0;  // first instruction index (a kLabel when the block is a branch target)
  size_t end = 0;    // one past the last instruction
  std::vector<int> succs;
  std::vector<int> preds;
};

struct Cfg {
  std::vector<BasicBlock> blocks;         // blocks[0] is the entry
  std::vector<int> block_of_instruction;  // instruction index -> block
  bool falls_off_end = false;             // the last block can run past the last instruction

  int exit_node() const { return static_cast<int>(blocks.size()); }  // virtual exit
  int num_nodes() const { return static_cast<int>(blocks.size()) + 1; }
};

// INVALID_ARGUMENT when a branch names a label that is not bound (or bound twice).
absl::StatusOr<Cfg> BuildCfg(const Function& function);

// Immediate post-dominator of every node (the virtual exit's is itself; -1 for nodes that cannot
// reach the exit, e.g. an infinite loop).
std::vector<int> ImmediatePostDominators(const Cfg& cfg);

}  // namespace normgrad::kernels
