// The parts of rms_norm_backward_row_resident's PTX (kernels/rmsnorm/rms_norm_backward_row_resident.h),
// internal to its files: the per-row math both forms share (row_resident_math.cc), the
// last-block-done grad_gamma trees (row_resident_dgamma_tree.cc) and the streamed-row form
// (row_resident_streamed_rows.cc). The held-row form and the kernel itself are in
// rms_norm_backward_row_resident.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/kernel_config.h"
#include "kernels/ptx/ptx_builder.h"
#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"

namespace normgrad::kernels::row_resident_internal {

constexpr uint32_t kVectorBytes = 16;

// Sum over the 32 lanes of a warp by butterfly: every lane ends with the same bits (each step
// adds the same two values, and f32 addition is commutative).
Value WarpAllSum(Builder& b, Value v);

// A 32-bit word of two 16-bit elements (element 2i in the low half) as two f32 values.
std::pair<Value, Value> UnpackWord(Builder& b, DType dtype, Value word);

// Loads one 16-byte vector slot of a row (V elements starting at `addr`) as it is in memory: the
// whole vector where `vec`, else each element j where `scalar[j]`, 0 elsewhere. A thread that
// takes the vector path branches over the element path (and back), so it issues one load. f32:
// four f32 registers; f16/bf16: four u32 words of two elements each (element 2i in the low
// half), so a held row costs one register per two elements.
std::vector<Value> LoadSlotRaw(Builder& b, DType dtype, Address addr, Value vec,
                               const std::vector<Value>& scalar);

// A slot from LoadSlotRaw as V f32 values (exact conversions).
std::vector<Value> SlotToF32(Builder& b, DType dtype, const std::vector<Value>& raw);

std::vector<Value> LoadSlot(Builder& b, DType dtype, Address addr, Value vec,
                            const std::vector<Value>& scalar);

// Stores one slot of f32 results in dtype, with the same predicates (and branches) as LoadSlot.
void StoreSlot(Builder& b, DType dtype, Address addr, Value vec, const std::vector<Value>& scalar,
               const std::vector<Value>& values);

inline uint32_t CeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// The variant as the PTX computes it. Without gamma the scale is 1, so the offset does not
// apply and every casting mode is the same math (dy is already of the element type); for f32 the
// roundings are the identity. Such configs share one module (ConfigKey names this variant).
NormVariant EmittedVariant(const KernelConfig& config);

// What the per-column math of a variant needs (docs/kernels.md, "Variants").
struct VariantMath {
  DType dtype = DType::kF32;
  NormVariant variant;
  // m = R(dy * scale): casting llama and none, 16-bit dtypes, with gamma.
  bool round_scaled() const {
    return variant.has_gamma && variant.casting != CastingMode::kGemma && dtype != DType::kF32;
  }
  // grad_gamma adds dy * R(x / rms): casting llama, 16-bit dtypes.
  bool round_normalized() const {
    return variant.casting == CastingMode::kLlama && dtype != DType::kF32;
  }
};

inline VariantMath MathFor(const KernelConfig& config) { return {config.dtype, EmittedVariant(config)}; }

// f32 rounded to the element type and back (exact): cvt.rn to f16/bf16, then widened as a load
// widens (bf16: the high half of an f32; f16: cvt.f32.f16).
Value RoundToElement(Builder& b, DType dtype, Value v);

// One slot's scales (offset + gamma, one f32 add after the load); none without gamma (scale 1:
// no gamma load at all).
std::vector<Value> LoadScales(Builder& b, const VariantMath& math, Address addr, Value vec,
                              const std::vector<Value>& scalar);

// Column j's m: dy * scale, rounded to the element type where the casting mode says so; dy
// itself without gamma.
Value ScaledDy(Builder& b, const VariantMath& math, const std::vector<Value>& gs,
               const std::vector<Value>& dys, size_t j);

// Which path a thread takes for one slot (V columns from col0 + slot_col): `vec` the whole
// 16-byte vector (the slot lies inside the row and rows are aligned), else `elem[j]` for each
// column inside the row. Recomputed where needed rather than held (they are cheap, registers
// are not).
struct SlotPredicates {
  Value vec;
  std::vector<Value> elem;
};

SlotPredicates MakeSlotPredicates(Builder& b, Value col0, uint32_t slot_col, uint32_t V,
                                  Value vec_limit, Value hidden);

// What both forms of the entry (held and streamed rows) declare: the parameters, in the one
// order kernels/kernel_params.h gives them, the launch bounds' blocks per SM, and the shared
// arrays of the row reduction (two f32 per warp: its sums of x^2 and x*gamma*dy) and of the tree
// (whether this block arrived last, written by thread 0).
struct RowKernelDecl {
  Param input, gamma, grad_output, grad_input, rms, dgamma, partials, semaphores, num_rows,
      hidden_dim, eps;
  SharedArray warp_sums, last_flag;
};

RowKernelDecl DeclareRowKernel(Function& f, const RowTiling& tiling);

// What both compute before their row loop.
struct RowKernelValues {
  Value tid, block, grid;
  Value rows, hidden, eps, x_base, gamma_base, dy_base, dx_base, rms_base;
  Value hidden_f;                        // hidden_dim as f32
  Value have_rms;                        // rms_ptr != 0 (the same for the whole grid)
  Value vec_limit;                       // see below
  Value col0;                            // this thread's first column: tid * V
  Value thread_bytes, gamma_thread;      // its byte offset in a row (tid * 16) and in gamma
  Value is_lane0, sums_base, warp_slot;  // the row reduction's lane 0, array and warp's pair
};

RowKernelValues LoadRowKernelValues(Builder& b, const RowKernelDecl& d, const RowTiling& tiling,
                                    DType dtype, bool has_gamma);

// This thread's first x, dy and dx element in row `row`.
struct ThreadRowPointers {
  Value x, dy, dx;
};

ThreadRowPointers RowPointers(Builder& b, const RowKernelValues& v, Value row,
                              uint32_t elem_bytes);

// Adds one slot's columns to the thread's sums of x^2 and x*m (m = ScaledDy), in column order.
void AddRowSums(Builder& b, const VariantMath& math, const std::vector<Value>& xs,
                const std::vector<Value>& dys, const std::vector<Value>& gs, Value sum_sq,
                Value sum_dot);

// The row's 1/rms and correction = mean(x*gamma*dy) / rms^2 from the threads' sums: a butterfly
// per warp (every lane the same bits), lane 0's pair to shared memory, every thread adds the
// warps' pairs in warp order (deterministic), a second barrier so the next row's stores wait for
// every read. 1/rms from the forward's rms when given (used as is: it contains eps), else
// recomputed.
struct RowScale {
  Value inv_rms, correction;
};

RowScale ReduceRowSums(Builder& b, const RowKernelValues& v, uint32_t warps, Value sum_sq,
                       Value sum_dot, Value row);

// One slot's dx = inv_rms * (m - x*correction) and grad_gamma parts, column by column;
// `on_part(j, part)` takes each part as it is made (none without gamma). The part is
// dy*x*inv_rms, or dy * R(x*inv_rms) for casting llama.
template <typename OnPart>
std::vector<Value> SlotDx(Builder& b, const VariantMath& math, const std::vector<Value>& xs,
                          const std::vector<Value>& dys, const std::vector<Value>& gs,
                          const RowScale& scale, OnPart on_part) {
  std::vector<Value> dx(xs.size());
  for (size_t j = 0; j < xs.size(); ++j) {
    const Value m = ScaledDy(b, math, gs, dys, j);
    const Value xc = b.Mul(xs[j], scale.correction);
    const Value diff = b.Sub(m, xc);
    dx[j] = b.Mul(scale.inv_rms, diff);
    if (!math.variant.has_gamma) continue;
    // Columns past hidden_dim hold x = dy = 0 and add 0.
    if (math.round_normalized()) {
      const Value normalized = b.Mul(xs[j], scale.inv_rms);
      on_part(j, b.Mul(dys[j], RoundToElement(b, math.dtype, normalized)));
    } else {
      const Value dyx = b.Mul(dys[j], xs[j]);
      on_part(j, b.Mul(dyx, scale.inv_rms));
    }
  }
  return dx;
}

// The parameters BuildDgammaTree reads, and the run-time hidden_dim.
struct DgammaTreeParams {
  Param dgamma;      // f32 [hidden_dim], written by the block that finishes last
  Param workspace;   // f32 [TreeRows(G), stride]: the tree's rows
  Param semaphores;  // u32 [TreeSemaphores(G)]: zero on entry, zero again on exit
  Value hidden;
};

// grad_gamma in the same launch, in a fixed order: a last-block-done tree over the G blocks'
// partial sums (`acc`, K*V f32 per thread, the columns the row loop gave it).
//
// Level 0 has G members (the blocks); member m belongs to group m / F (F = kFanIn). Every member
// writes its sums as one workspace row, fences, and thread 0 counts its arrival on the group's
// semaphore (atom.add); the member that arrives last (count == group size - 1) resets the
// semaphore to 0, reads the group's rows in member order, adds them in that order, and goes on
// as member m / F of the next level; the others exit. A level of one member is the top: its sums
// are the whole grad_gamma, written to dgamma. Which block does a sum depends on timing; what it
// adds, and in which order, depends only on G: same inputs and G, same bits. No block waits for
// another, so the grid need not be resident.
//
// A workspace row is the tiling's capacity (T*K*V floats) in the threads' order: thread t's
// floats 4q..4q+3 of slot k at ((k*V/4 + q)*T + t)*4, so each 16-byte vector access of a warp
// covers 512 contiguous bytes (whole sectors). A thread whose slot starts at or past hidden_dim
// rounded up to V neither writes nor reads it (the sectors it would touch are never moved); the
// columns past hidden_dim below that hold the zeros their x and dy gave. The workspace is 16-byte
// aligned (BackwardKernel::CheckArgs). Workspace accesses are .cg: written by other blocks
// during this launch, so read from L2, never from a stale L1 line.
void BuildDgammaTree(Builder& b, const RowTiling& tiling, Value col0, Value tid,
                     SharedArray last_flag, const std::vector<Value>& acc,
                     const DgammaTreeParams& p);

// Emits a block-uniform loop over a streamed row's segments: `body(seg, seg_bytes4)` for seg =
// 0, step, 2*step, ... while seg < limit, where seg is the segment's first column relative to
// the thread's (u32) and seg_bytes4 = 4 * seg as a u64 (the segment's byte offset in an f32
// row: the workspace's and dgamma's).
template <typename Body>
void SegmentLoop(Builder& b, Value limit, uint32_t step, const char* name, Body body) {
  const Label loop = b.CreateLabel(name);
  const Label done = b.CreateLabel(absl::StrCat(name, "_done"));
  const Value seg = b.Mov(Value::U32(0));
  const Value seg_bytes4 = b.Mov(Value::U64(0));
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, seg, limit), done);
  body(seg, seg_bytes4);
  b.AddTo(seg, Value::U32(step));
  b.AddTo(seg_bytes4, Value::U64(uint64_t{step} * 4));
  b.Bra(loop);
  b.Bind(done);
}

// The last-block-done tree of BuildDgammaTree for a streamed tiling, whose sums are not in
// registers: every block's level-0 row is already in the workspace (row ctaid, written by the row
// loop), and the group's last member adds its members' rows segment by segment, in member order,
// into its row of the next level, or into dgamma at the top. Same members, groups, order,
// semaphores, layout and identity (-0.0) as the register tree, so the same bits for the same
// sums. G == 1: row 0 is the whole grad_gamma, copied to dgamma.
void BuildStreamedTree(Builder& b, const RowTiling& tiling, Value col0, Value tid,
                       SharedArray last_flag, const DgammaTreeParams& p);

// rms_norm_backward_row_resident for a streamed tiling (hidden_dim > kMaxHeldHiddenDim): the
// held kernel's per-row math with the row read twice, one 16-byte vector per thread per segment
// of T*V columns (thread t: columns seg + t*V + j, the held layout's slot k = seg / (T*V)).
//   pass 1: x and dy (.cg: kept in L2 for pass 2) and gamma; the per-thread sums in column order.
//   the block reduction (warp butterfly, then the warps in order), 1/rms and the correction.
//   pass 2: x and dy again (.cs), gamma; dx stored (.cs); the thread's grad_gamma sums for the
//           segment's columns: workspace row ctaid, quad q at ((seg/(T*V)*V/4 + q)*T + t)*16
//           bytes (the tree's layout), set to 0 + part on the block's first row and added to on
//           the next ones (.cg: L2), where the held kernel adds in registers. Same bits.
// Then BuildStreamedTree. Registers hold one segment (a few dozen), so T = 1024 fits 64.
void BuildStreamedRows(Builder& b, const KernelConfig& config, const RowKernelDecl& d,
                       const RowKernelValues& v, Label row_loop, Label rows_done);

}  // namespace normgrad::kernels::row_resident_internal
