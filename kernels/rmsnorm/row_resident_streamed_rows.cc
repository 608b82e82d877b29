#include "kernels/rmsnorm/row_resident_parts.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"

namespace normgrad::kernels::row_resident_internal {

void BuildStreamedRows(Builder& b, const KernelConfig& config, const RowKernelDecl& d,
                       const RowKernelValues& v, Label row_loop, Label rows_done) {
  const DType dtype = config.dtype;
  const VariantMath math = MathFor(config);
  const bool has_gamma = math.variant.has_gamma;
  const RowTiling tiling = RowResidentRmsNormBackwardKernel::TilingFor(config);
  const uint32_t T = tiling.threads;
  const uint32_t V = tiling.vector_elements;
  const uint32_t elem_bytes = DTypeBytes(dtype);
  // This block's grad_gamma sums: workspace row ctaid (level 0 of the tree); no workspace
  // without gamma.
  Value stride, ws_thread;
  if (has_gamma) {
    const Value stride_up = b.Add(v.hidden, Value::U32(V - 1));
    stride = b.And(stride_up, Value::U32(~(V - 1)));
    const Value ws_base = b.LdParam(d.partials);
    const Value own_off = b.MulWide(v.block, Value::U32(tiling.capacity() * 4));
    const Value ws_block = b.Add(ws_base, own_off);
    ws_thread = b.Add(ws_block, v.thread_bytes);
  }
  // A segment's byte offset in a row of the dtype, from its offset in an f32 row.
  auto data_offset = [&](Value seg_bytes4) {
    return elem_bytes == 4 ? seg_bytes4 : b.Shr(seg_bytes4, Value::U32(1));
  };

  const Value row = b.Mov(v.block);
  b.Bind(row_loop);
  b.BraIf(b.Setp(CmpOp::kGe, row, v.rows), rows_done);
  {
    // Named values, not a structured binding: the lambdas below capture them (C++17).
    const ThreadRowPointers ptrs = RowPointers(b, v, row, elem_bytes);
    const Value x_thread = ptrs.x, dy_thread = ptrs.dy, dx_thread = ptrs.dx;
    // One segment's x, dy (with `cache`) and gamma as f32, and its predicates.
    struct Segment {
      SlotPredicates p;
      Value off;
      std::vector<Value> xs, dys, gs;
    };
    auto load_segment = [&](Value seg, Value seg_bytes4, CacheOp cache) {
      Segment sg;
      const Value col = b.Add(v.col0, seg);
      sg.p = MakeSlotPredicates(b, col, 0, V, v.vec_limit, v.hidden);
      sg.off = data_offset(seg_bytes4);
      const Value x_addr = b.Add(x_thread, sg.off);
      const Value dy_addr = b.Add(dy_thread, sg.off);
      const Value g_addr = has_gamma ? b.Add(v.gamma_thread, sg.off) : Value();
      std::vector<Value> x_raw, dy_raw;
      {
        auto policy = b.WithCache(cache);
        x_raw = LoadSlotRaw(b, dtype, Address{x_addr, 0}, sg.p.vec, sg.p.elem);
        dy_raw = LoadSlotRaw(b, dtype, Address{dy_addr, 0}, sg.p.vec, sg.p.elem);
      }
      sg.gs = LoadScales(b, math, Address{g_addr, 0}, sg.p.vec, sg.p.elem);
      sg.xs = SlotToF32(b, dtype, x_raw);
      sg.dys = SlotToF32(b, dtype, dy_raw);
      return sg;
    };

    // Pass 1: the sums (x and dy kept in L2 for pass 2).
    const Value sum_sq = b.Mov(Value::F32(0.0f));
    const Value sum_dot = b.Mov(Value::F32(0.0f));
    SegmentLoop(b, v.hidden, T * V, "pass1", [&](Value seg, Value seg_bytes4) {
      const Segment sg = load_segment(seg, seg_bytes4, CacheOp::kCg);
      AddRowSums(b, math, sg.xs, sg.dys, sg.gs, sum_sq, sum_dot);
    });
    const RowScale scale = ReduceRowSums(b, v, T / 32, sum_sq, sum_dot, row);
    // The block's first row starts its sums (0 + part, as the held kernel's zeroed registers);
    // later rows add to what the same thread stored.
    Value acc_limit;
    if (has_gamma) {
      const Value first_row = b.Setp(CmpOp::kEq, row, v.block);
      acc_limit = b.Selp(Value::U32(0), stride, first_row);
    }

    // Pass 2: dx, and the sums' parts into the workspace row.
    SegmentLoop(b, v.hidden, T * V, "pass2", [&](Value seg, Value seg_bytes4) {
      const Segment sg = load_segment(seg, seg_bytes4, CacheOp::kCs);  // last use
      std::vector<Value> part(V);
      const std::vector<Value> dx =
          SlotDx(b, math, sg.xs, sg.dys, sg.gs, scale, [&](size_t j, Value p) { part[j] = p; });
      {
        auto streamed = b.WithCache(CacheOp::kCs);
        const Value dx_addr = b.Add(dx_thread, sg.off);
        StoreSlot(b, dtype, Address{dx_addr, 0}, sg.p.vec, sg.p.elem, dx);
      }
      if (!has_gamma) return;
      // Columns below hidden_dim rounded up to V (past hidden_dim they add 0).
      const Value col = b.Add(v.col0, seg);
      const Value in_row = b.Setp(CmpOp::kLt, col, stride);
      const Value add_to = b.Setp(CmpOp::kLt, col, acc_limit);
      const Value ws_seg = b.Add(ws_thread, seg_bytes4);
      auto l2 = b.WithCache(CacheOp::kCg);
      for (uint32_t q = 0; q < V / 4; ++q) {
        const Address at{ws_seg, int64_t{q} * T * kVectorBytes};
        std::vector<Value> acc;
        for (int j = 0; j < 4; ++j) acc.push_back(b.Mov(Value::F32(0.0f)));
        b.LdInto(StateSpace::kGlobal, PtxType::kF32, at, acc, add_to);
        for (int j = 0; j < 4; ++j) b.AddTo(acc[j], part[4 * q + j]);
        auto guard = b.If(in_row);
        b.StV4(StateSpace::kGlobal, at, acc);
      }
    });
    b.AddTo(row, v.grid);
    b.Bra(row_loop);
  }
  b.Bind(rows_done);
  if (!has_gamma) {
    b.Ret();
    return;
  }
  BuildStreamedTree(b, tiling, v.col0, v.tid, d.last_flag,
                    DgammaTreeParams{d.dgamma, d.partials, d.semaphores, v.hidden});
}

}  // namespace normgrad::kernels::row_resident_internal
