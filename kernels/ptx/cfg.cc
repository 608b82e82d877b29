#include "kernels/ptx/cfg.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/ptx/ptx_printer.h"

namespace normgrad::kernels {
namespace {

bool EndsBlock(const Instruction& in) {
  return in.op == Opcode::kBra || in.op == Opcode::kRet || in.op == Opcode::kExit;
}

void AddEdge(Cfg& cfg, int from, int to) {
  std::vector<int>& s = cfg.blocks[from].succs;
  if (std::find(s.begin(), s.end(), to) != s.end()) return;
  s.push_back(to);
  if (to < static_cast<int>(cfg.blocks.size())) cfg.blocks[to].preds.push_back(from);
}

}  // namespace

absl::StatusOr<Cfg> BuildCfg(const Function& f) {
  const std::vector<Instruction>& code = f.instructions();
  Cfg cfg;
  cfg.block_of_instruction.assign(code.size(), -1);
  std::vector<int> label_block(f.num_labels(), -1);

  // Leaders: the first instruction, every label, every instruction after a block end.
  std::vector<bool> leader(code.size() + 1, false);
  leader[0] = true;
  for (size_t i = 0; i < code.size(); ++i) {
    if (code[i].op == Opcode::kLabel) leader[i] = true;
    if (EndsBlock(code[i])) leader[i + 1] = true;
  }
  for (size_t i = 0; i < code.size(); ++i) {
    if (leader[i]) {
      if (!cfg.blocks.empty()) cfg.blocks.back().end = i;
      cfg.blocks.push_back(BasicBlock{i, i, {}, {}});
    }
    cfg.block_of_instruction[i] = static_cast<int>(cfg.blocks.size()) - 1;
    if (code[i].op == Opcode::kLabel) {
      if (code[i].label >= f.num_labels()) {
        return absl::InvalidArgumentError(absl::StrCat("instruction ", i, " binds label id ",
                                                       code[i].label, " which was never created"));
      }
      if (label_block[code[i].label] != -1) {
        return absl::InvalidArgumentError(absl::StrCat("label ", f.label_name(code[i].label),
                                                       " is bound twice (instruction ", i, ")"));
      }
      label_block[code[i].label] = static_cast<int>(cfg.blocks.size()) - 1;
    }
  }
  if (cfg.blocks.empty()) {
    cfg.blocks.push_back(BasicBlock{0, 0, {}, {}});
  } else {
    cfg.blocks.back().end = code.size();
  }

  const int n = static_cast<int>(cfg.blocks.size());
  for (int b = 0; b < n; ++b) {
    const BasicBlock& bb = cfg.blocks[b];
    const bool empty = bb.begin == bb.end;
    const Instruction* last = empty ? nullptr : &code[bb.end - 1];
    bool falls_through = true;
    if (last != nullptr && last->op == Opcode::kBra) {
      if (last->label >= f.num_labels() || label_block[last->label] == -1) {
        return absl::InvalidArgumentError(
            absl::StrCat("instruction ", bb.end - 1, " (", InstructionText(f, *last),
                         ") branches to a label that is not bound in ", f.name()));
      }
      AddEdge(cfg, b, label_block[last->label]);
      falls_through = last->guard.valid();
    } else if (last != nullptr && (last->op == Opcode::kRet || last->op == Opcode::kExit)) {
      AddEdge(cfg, b, cfg.exit_node());
      falls_through = last->guard.valid();
    }
    if (falls_through) {
      if (b + 1 < n) {
        AddEdge(cfg, b, b + 1);
      } else {
        AddEdge(cfg, b, cfg.exit_node());
        cfg.falls_off_end = true;
      }
    }
  }
  return cfg;
}

std::vector<int> ImmediatePostDominators(const Cfg& cfg) {
  const int n = cfg.num_nodes();
  const int exit = cfg.exit_node();
  auto succs = [&](int v) -> const std::vector<int>& {
    static const std::vector<int> kNone;
    return v == exit ? kNone : cfg.blocks[v].succs;
  };

  // Nodes that reach the exit (reverse reachability).
  std::vector<std::vector<int>> preds(n);
  for (int v = 0; v < exit; ++v) {
    for (int s : cfg.blocks[v].succs) preds[s].push_back(v);
  }
  std::vector<bool> reaches(n, false);
  std::vector<int> stack{exit};
  reaches[exit] = true;
  while (!stack.empty()) {
    const int v = stack.back();
    stack.pop_back();
    for (int p : preds[v]) {
      if (!reaches[p]) {
        reaches[p] = true;
        stack.push_back(p);
      }
    }
  }

  // pdom(v) = {v} + intersection of pdom(s) over successors that reach the exit.
  std::vector<std::vector<bool>> pdom(n, std::vector<bool>(n, true));
  pdom[exit].assign(n, false);
  pdom[exit][exit] = true;
  bool changed = true;
  while (changed) {
    changed = false;
    for (int v = n - 1; v >= 0; --v) {
      if (v == exit || !reaches[v]) continue;
      std::vector<bool> next(n, true);
      for (int s : succs(v)) {
        if (!reaches[s]) continue;
        for (int k = 0; k < n; ++k) next[k] = next[k] && pdom[s][k];
      }
      next[v] = true;
      if (next != pdom[v]) {
        pdom[v] = std::move(next);
        changed = true;
      }
    }
  }

  std::vector<int> ipdom(n, -1);
  ipdom[exit] = exit;
  for (int v = 0; v < n; ++v) {
    if (v == exit || !reaches[v]) continue;
    const int size = static_cast<int>(std::count(pdom[v].begin(), pdom[v].end(), true));
    for (int p = 0; p < n; ++p) {
      if (p == v || !pdom[v][p]) continue;
      const int psize = static_cast<int>(std::count(pdom[p].begin(), pdom[p].end(), true));
      if (psize == size - 1) {
        ipdom[v] = p;
        break;
      }
    }
  }
  return ipdom;
}

}  // namespace normgrad::kernels
