#include "kernels/ptx/divergence_analysis.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/ptx/cfg.h"
#include "kernels/ptx/ptx_printer.h"

namespace normgrad::kernels {
namespace {

enum class Level : int { kUniform = 0, kWarpUniform = 1, kLaneAffine = 2, kDivergent = 3 };

// Abstract value of a register. `mult32`: known to be a multiple of 32 (uniform levels only).
struct Shape {
  bool defined = false;  // bottom until some definition is seen
  Level level = Level::kUniform;
  bool mult32 = false;

  friend bool operator==(const Shape& a, const Shape& b) {
    return a.defined == b.defined && a.level == b.level && a.mult32 == b.mult32;
  }
};

bool AtMostWarp(const Shape& s) { return s.level <= Level::kWarpUniform; }

Shape Make(Level level, bool mult32 = false) { return Shape{true, level, mult32}; }

Shape Join(const Shape& a, const Shape& b) {
  if (!a.defined) return b;
  if (!b.defined) return a;
  if (a.level == b.level) return Make(a.level, a.mult32 && b.mult32);
  if (AtMostWarp(a) && AtMostWarp(b)) return Make(std::max(a.level, b.level), a.mult32 && b.mult32);
  return Make(Level::kDivergent);
}

// A value written under control (or a guard) of the given level.
Shape Raise(const Shape& s, Level control) {
  if (control == Level::kUniform) return s;
  if (control == Level::kDivergent || control == Level::kLaneAffine) {
    return Make(Level::kDivergent);
  }
  // Warp-uniform control: lanes of one warp agree, so per-warp facts survive.
  if (s.level == Level::kUniform) return Make(Level::kWarpUniform, s.mult32);
  return s;
}

// Any lane-dependent value used where only its uniformity matters.
Shape Plain(const Shape& s) {
  if (s.level == Level::kLaneAffine) return Make(Level::kDivergent);
  return Make(s.level);
}

Shape MaxOf(const std::vector<Shape>& shapes) {
  Level level = Level::kUniform;
  for (const Shape& s : shapes) level = std::max(level, Plain(s).level);
  return Make(level);
}

bool IsImmediateAtLeast(const Value& v, uint64_t n) { return v.is_immediate() && v.bits() >= n; }

class Analyzer {
 public:
  Analyzer(const Function& f, const Cfg& cfg, const LaunchAssumptions& a)
      : f_(f), cfg_(cfg), a_(a), ipdom_(ImmediatePostDominators(cfg)) {}

  std::vector<DivergenceFinding> Run() {
    shapes_.assign(f_.num_registers(), Shape{});
    control_.assign(cfg_.num_nodes(), Level::kUniform);
    exit_control_.assign(cfg_.num_nodes(), Level::kUniform);
    // Register shapes are only ever joined upward and region levels only raised, over finite
    // lattices, so iterating to the joint fixpoint terminates; no round limit could cut it short.
    bool changed = true;
    while (changed) {
      const bool shapes_changed = PropagateShapes();
      const bool regions_changed = ComputeRegions();
      changed = shapes_changed || regions_changed;
    }
    return Findings();
  }

 private:
  Shape OperandShape(const Value& v) const {
    switch (v.kind()) {
      case Value::Kind::kRegister:
        return v.reg() < shapes_.size() ? shapes_[v.reg()] : Make(Level::kDivergent);
      case Value::Kind::kImmediate:
        return Make(Level::kUniform, !IsFloat(v.type()) && v.bits() % 32 == 0);
      case Value::Kind::kSpecial:
        switch (v.special()) {
          case SpecialReg::kTidX:
            return a_.one_dimensional_block ? Make(Level::kLaneAffine) : Make(Level::kDivergent);
          case SpecialReg::kTidY:
          case SpecialReg::kTidZ:
            return a_.one_dimensional_block ? Make(Level::kUniform, true) : Make(Level::kDivergent);
          case SpecialReg::kNtidX:
            return Make(Level::kUniform, a_.block_x_multiple_of_32);
          case SpecialReg::kLaneId:
            return Make(Level::kDivergent);
          case SpecialReg::kWarpId:
            return Make(Level::kWarpUniform);
          default:
            return Make(Level::kUniform);
        }
      case Value::Kind::kSharedSymbol:
        return Make(Level::kUniform);
      case Value::Kind::kNone:
        break;
    }
    return Make(Level::kDivergent);
  }

  Shape AddShape(const Shape& a, const Shape& b, bool subtract) const {
    if (AtMostWarp(a) && AtMostWarp(b))
      return Make(std::max(a.level, b.level), a.mult32 && b.mult32);
    if (a.level == Level::kLaneAffine && AtMostWarp(b) && b.mult32) return Make(Level::kLaneAffine);
    if (!subtract && b.level == Level::kLaneAffine && AtMostWarp(a) && a.mult32) {
      return Make(Level::kLaneAffine);
    }
    return Make(Level::kDivergent);
  }

  Shape MulShape(const Shape& a, const Shape& b) const {
    if (AtMostWarp(a) && AtMostWarp(b))
      return Make(std::max(a.level, b.level), a.mult32 || b.mult32);
    return Make(Level::kDivergent);
  }

  // The shape an instruction gives its destination(s), before control dependence.
  Shape Transfer(const Instruction& in) const {
    std::vector<Shape> src;
    for (const Value& v : in.src) src.push_back(OperandShape(v));
    const bool is_float = IsFloat(in.type);
    switch (in.op) {
      case Opcode::kLdParam:
        return Make(Level::kUniform);
      case Opcode::kMov:
        return src.empty() ? Make(Level::kDivergent) : src[0];
      case Opcode::kCvt:
        if (src.empty()) return Make(Level::kDivergent);
        if (IsFloat(in.type) || IsFloat(in.src_type)) return Plain(src[0]);
        // Integer widening keeps the number; narrowing may wrap, keep only uniformity.
        if (PtxTypeBits(in.type) >= PtxTypeBits(in.src_type)) return src[0];
        return Plain(src[0]);
      case Opcode::kLd:
        return src.empty() || !AtMostWarp(src[0]) ? Make(Level::kDivergent) : Make(src[0].level);
      case Opcode::kAtomAdd:
        return Make(Level::kDivergent);
      case Opcode::kAdd:
      case Opcode::kSub:
        if (is_float || src.size() < 2) return MaxOf(src);
        return AddShape(src[0], src[1], in.op == Opcode::kSub);
      case Opcode::kMul:
        if (is_float || src.size() < 2 || in.mul_mode == MulMode::kHi) return MaxOf(src);
        return MulShape(src[0], src[1]);
      case Opcode::kMad:
        if (is_float || src.size() < 3 || in.mul_mode == MulMode::kHi) return MaxOf(src);
        return AddShape(MulShape(src[0], src[1]), src[2], false);
      case Opcode::kShl:
        if (src.size() < 2) return MaxOf(src);
        if (AtMostWarp(src[0]) && AtMostWarp(src[1])) {
          return Make(std::max(src[0].level, src[1].level),
                      src[0].mult32 || IsImmediateAtLeast(in.src[1], 5));
        }
        return Make(Level::kDivergent);
      case Opcode::kShr:
        if (src.size() < 2) return MaxOf(src);
        // (32*w + lane) >> k with k >= 5 is w >> (k-5): the same for the whole warp.
        if (src[0].level == Level::kLaneAffine && IsImmediateAtLeast(in.src[1], 5) &&
            !IsSigned(in.type)) {
          return Make(Level::kWarpUniform);
        }
        return MaxOf(src);
      case Opcode::kShfl: {
        if (src.size() < 2) return Make(Level::kDivergent);
        if (in.shfl == ShflMode::kIdx) {
          if (!AtMostWarp(src[1])) return Make(Level::kDivergent);
          return src[0].level == Level::kUniform ? Make(Level::kUniform)
                                                 : Make(Level::kWarpUniform);
        }
        // up/down/bfly move values within the warp: a warp-uniform value stays so.
        return AtMostWarp(src[0]) ? Make(src[0].level) : Make(Level::kDivergent);
      }
      default:
        return MaxOf(src);
    }
  }

  bool PropagateShapes() {
    bool changed = false;
    const std::vector<Instruction>& code = f_.instructions();
    bool local_change = true;
    while (local_change) {
      local_change = false;
      for (size_t i = 0; i < code.size(); ++i) {
        const Instruction& in = code[i];
        if (in.dst.empty()) continue;
        Shape s = Transfer(in);
        Level control = control_[cfg_.block_of_instruction[i]];
        if (in.guard.valid()) control = std::max(control, Plain(OperandShape(in.guard)).level);
        s = Raise(s, control);
        for (size_t d = 0; d < in.dst.size(); ++d) {
          const Value& v = in.dst[d];
          if (!v.is_register() || v.reg() >= shapes_.size()) continue;
          // The predicate output of shfl.sync says whether the source lane was in range.
          const Shape value = (in.op == Opcode::kShfl && d == 1) ? Make(Level::kDivergent) : s;
          const Shape joined = Join(shapes_[v.reg()], value);
          if (!(joined == shapes_[v.reg()])) {
            shapes_[v.reg()] = joined;
            local_change = true;
            changed = true;
          }
        }
      }
    }
    return changed;
  }

  // Nodes reachable from `from`'s successors without passing `stop`.
  std::vector<int> Region(int from, int stop) const {
    std::vector<bool> seen(cfg_.num_nodes(), false);
    std::vector<int> stack;
    std::vector<int> out;
    for (int s : cfg_.blocks[from].succs) stack.push_back(s);
    while (!stack.empty()) {
      const int v = stack.back();
      stack.pop_back();
      if (v == stop || v == cfg_.exit_node() || seen[v]) continue;
      seen[v] = true;
      out.push_back(v);
      for (int s : cfg_.blocks[v].succs) stack.push_back(s);
    }
    return out;
  }

  bool Exits(int block) const {
    const std::vector<int>& s = cfg_.blocks[block].succs;
    return std::find(s.begin(), s.end(), cfg_.exit_node()) != s.end();
  }

  bool IsReturnOnly(int node) const {
    if (node < 0 || node >= static_cast<int>(cfg_.blocks.size())) return false;
    const BasicBlock& bb = cfg_.blocks[node];
    bool returns = false;
    for (size_t i = bb.begin; i < bb.end; ++i) {
      const Instruction& in = f_.instructions()[i];
      if (in.op == Opcode::kLabel) continue;
      if ((in.op == Opcode::kRet || in.op == Opcode::kExit) && !in.guard.valid()) {
        returns = true;
        continue;
      }
      return false;
    }
    return returns;
  }

  bool ComputeRegions() {
    std::vector<Level> control(cfg_.num_nodes(), Level::kUniform);
    std::vector<Level> exit_control(cfg_.num_nodes(), Level::kUniform);
    const std::vector<Instruction>& code = f_.instructions();
    for (int b = 0; b < static_cast<int>(cfg_.blocks.size()); ++b) {
      const BasicBlock& bb = cfg_.blocks[b];
      if (bb.begin == bb.end) continue;
      const Instruction& last = code[bb.end - 1];
      const bool conditional =
          last.guard.valid() &&
          (last.op == Opcode::kBra || last.op == Opcode::kRet || last.op == Opcode::kExit);
      if (!conditional) continue;
      // The branch itself runs under its block's control: divergence nests.
      const Level level = std::max(Plain(OperandShape(last.guard)).level, control_[b]);
      if (level == Level::kUniform) continue;
      const std::vector<int> region = Region(b, ipdom_[b]);
      // Threads may have exited when the region holds a ret/exit, or when the join point is a
      // block that does nothing but return (the taken side goes straight out).
      bool exits = last.op != Opcode::kBra || IsReturnOnly(ipdom_[b]);
      for (int v : region) exits = exits || Exits(v);
      for (int v : region) {
        control[v] = std::max(control[v], level);
        if (exits) exit_control[v] = std::max(exit_control[v], level);
      }
    }
    // Control also flows down: a block inside a region keeps the region's level.
    bool changed = false;
    for (int v = 0; v < cfg_.num_nodes(); ++v) {
      const Level c = std::max(control[v], control_[v]);
      const Level e = std::max(exit_control[v], exit_control_[v]);
      if (c != control_[v] || e != exit_control_[v]) changed = true;
      control_[v] = c;
      exit_control_[v] = e;
    }
    return changed;
  }

  std::string Where(size_t index) const {
    return absl::StrCat("entry ", f_.name(), ", instruction ", index, " (",
                        InstructionText(f_, f_.instructions()[index]), ")");
  }

  std::vector<DivergenceFinding> Findings() const {
    std::vector<DivergenceFinding> out;
    const std::vector<Instruction>& code = f_.instructions();
    for (size_t i = 0; i < code.size(); ++i) {
      const Instruction& in = code[i];
      const int b = cfg_.block_of_instruction[i];
      const Level guard = in.guard.valid() ? Plain(OperandShape(in.guard)).level : Level::kUniform;
      if (in.op == Opcode::kBarSync) {
        const Level c = std::max(control_[b], guard);
        if (c >= Level::kWarpUniform) {
          const bool after_exit = exit_control_[b] >= Level::kWarpUniform;
          out.push_back(DivergenceFinding{
              i, DivergenceHazard::kBarrierUnderDivergence, after_exit,
              absl::StrCat(Where(i), ": bar.sync ",
                           after_exit
                               ? "after a thread-dependent exit (exited threads never arrive)"
                           : guard >= Level::kWarpUniform ? "under a thread-dependent guard"
                                                          : "under thread-dependent control flow",
                           ": not every thread of the block reaches it")});
        }
      }
      if (in.op == Opcode::kShfl && in.src.size() == 4 && in.src[3].is_immediate() &&
          in.src[3].bits() == 0xffffffffu) {
        const Level c = std::max(control_[b], guard);
        const bool partial_warps = !a_.block_x_multiple_of_32;
        if (c >= Level::kLaneAffine || partial_warps) {
          const bool after_exit = exit_control_[b] >= Level::kLaneAffine;
          out.push_back(DivergenceFinding{
              i, DivergenceHazard::kShuffleUnderDivergence, after_exit,
              absl::StrCat(Where(i), ": full-mask shfl.sync ",
                           partial_warps ? "in a launch whose blocks are not whole warps"
                           : after_exit  ? "after a lane-dependent exit"
                           : guard >= Level::kLaneAffine ? "under a lane-dependent guard"
                                                         : "under lane-dependent control flow",
                           ": some lanes named in the mask may be inactive or exited")});
        }
      }
    }
    return out;
  }

  const Function& f_;
  const Cfg& cfg_;
  const LaunchAssumptions& a_;
  std::vector<int> ipdom_;
  std::vector<Shape> shapes_;
  std::vector<Level> control_;       // per CFG node: level of the divergence it runs under
  std::vector<Level> exit_control_;  // ... of which some threads may have exited
};

}  // namespace

absl::StatusOr<std::vector<DivergenceFinding>> AnalyzeDivergence(
    const Function& function, const LaunchAssumptions& assumptions) {
  absl::StatusOr<Cfg> cfg = BuildCfg(function);
  if (!cfg.ok()) return cfg.status();
  return Analyzer(function, *cfg, assumptions).Run();
}

absl::Status CheckDivergence(const Module& module, const LaunchAssumptions& assumptions) {
  std::vector<std::string> messages;
  for (const Function& f : module.functions()) {
    absl::StatusOr<std::vector<DivergenceFinding>> findings = AnalyzeDivergence(f, assumptions);
    if (!findings.ok()) return findings.status();
    for (const DivergenceFinding& finding : *findings) messages.push_back(finding.message);
  }
  if (messages.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrJoin(messages, "; "));
}

}  // namespace normgrad::kernels
