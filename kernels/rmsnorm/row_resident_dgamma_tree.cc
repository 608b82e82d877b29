#include "kernels/rmsnorm/row_resident_parts.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"

namespace normgrad::kernels::row_resident_internal {
namespace {

// What both trees load and compute before their level loop, in this order: the parameters, the
// workspace stride (hidden_dim rounded up to V) and row size, this thread's place in a workspace
// row and in dgamma, thread 0 and the flag's address, and the loop's level state: count (members
// of this level), member (this block's place in it), level_row and level_sem (the level's first
// workspace row and semaphore).
struct TreeFrame {
  Value dgamma, workspace, semaphores, stride, ws_thread, col0_bytes, is_thread0, flag_addr;
  Value count, member, level_row, level_sem;
  uint32_t row_bytes = 0;
};

TreeFrame StartTree(Builder& b, const RowTiling& tiling, Value col0, Value tid,
                    SharedArray last_flag, const DgammaTreeParams& p) {
  const uint32_t V = tiling.vector_elements;
  TreeFrame t;
  std::tie(t.dgamma, t.workspace, t.semaphores) =
      std::tuple_cat(b.LdParams({p.dgamma, p.workspace, p.semaphores}));
  const Value stride_up = b.Add(p.hidden, Value::U32(V - 1));
  t.stride = b.And(stride_up, Value::U32(~(V - 1)));
  t.row_bytes = tiling.capacity() * 4;
  const Value tid_bytes = b.MulWide(tid, Value::U32(kVectorBytes));
  t.ws_thread = b.Add(t.workspace, tid_bytes);
  t.col0_bytes = b.MulWide(col0, Value::U32(4));
  t.is_thread0 = b.Setp(CmpOp::kEq, tid, Value::U32(0));
  t.flag_addr = b.AddressOf(last_flag);
  t.count = b.Mov(SpecialReg::kNctaidX);
  t.member = b.Mov(SpecialReg::kCtaidX);
  t.level_row = b.Mov(Value::U32(0));
  t.level_sem = b.Mov(Value::U32(0));
  return t;
}

// The ticket of the last-block-done tree, the same at every level of both trees: release this
// block's row (fence, barrier), count its arrival on its group's semaphore (thread 0; the last
// to arrive resets the semaphore and fences to acquire the others' rows) and leave the tree
// (`done`) unless this block arrived last. Returns the group and its first member and size.
struct GroupTicket {
  Value group, first, size;
};

GroupTicket TakeGroupTicket(Builder& b, const TreeFrame& tree, Label ticket_taken, Label done) {
  constexpr uint32_t F = RowResidentRmsNormBackwardKernel::kFanIn;
  constexpr uint32_t kLogF = RowResidentRmsNormBackwardKernel::kLogFanIn;
  static_assert((1u << kLogF) == F, "the fan-in is a power of two");
  // Release: every thread's row stores are visible GPU-wide before thread 0's arrival.
  b.Fence();
  b.BarSync(0);
  GroupTicket t;
  t.group = b.Shr(tree.member, Value::U32(kLogF));
  t.first = b.Shl(t.group, Value::U32(kLogF));
  const Value left = b.Sub(tree.count, t.first);
  t.size = b.Min(left, Value::U32(F));
  const Value sem_index = b.Add(tree.level_sem, t.group);
  const Value sem_off = b.MulWide(sem_index, Value::U32(4));
  const Value sem_addr = b.Add(tree.semaphores, sem_off);
  b.BraIfNot(tree.is_thread0, ticket_taken);
  {
    const Value arrived = b.AtomAdd(StateSpace::kGlobal, Address{sem_addr, 0}, Value::U32(1));
    const Value last_index = b.Sub(t.size, Value::U32(1));
    const Value last = b.Setp(CmpOp::kEq, arrived, last_index);
    const Value flag = b.Selp(Value::U32(1), Value::U32(0), last);
    b.St(StateSpace::kShared, Address{tree.flag_addr, 0}, flag);
    {
      // Every member has arrived: the semaphore is ready for the next launch.
      auto reset = b.If(last);
      b.St(StateSpace::kGlobal, Address{sem_addr, 0}, Value::U32(0));
    }
    // Acquire: the other members' rows are read after their arrivals were seen.
    b.Fence();
  }
  b.Bind(ticket_taken);
  b.BarSync(0);
  const Value go = b.Ld(StateSpace::kShared, PtxType::kU32, Address{tree.flag_addr, 0});
  b.BraIf(b.Setp(CmpOp::kEq, go, Value::U32(0)), done);
  return t;
}

// Where dgamma (f32 [hidden_dim]) takes 16-byte vectors: hidden_dim when the pointer is 16-byte
// aligned and hidden_dim % 4 == 0, else 0 (every quad element by element).
Value DgammaVectorLimit(Builder& b, Value dgamma, Value hidden) {
  const Value dg_low64 = b.And(dgamma, Value::U64(kVectorBytes - 1));
  const Value dg_low = b.Cvt(PtxType::kU32, dg_low64);
  const Value hidden_low = b.And(hidden, Value::U32(3));
  const Value misaligned = b.Or(dg_low, hidden_low);
  const Value aligned = b.Setp(CmpOp::kEq, misaligned, Value::U32(0));
  return b.Selp(hidden, Value::U32(0), aligned);
}

// A tree's labels, created in this order: the level loop, the ticket taken, where a level of one
// member goes (`end`), and done.
struct TreeLabels {
  Label level_loop, ticket_taken, end, done;
};

TreeLabels CreateTreeLabels(Builder& b, absl::string_view tree, absl::string_view end) {
  TreeLabels l;
  l.level_loop = b.CreateLabel(absl::StrCat(tree, "_level"));
  l.ticket_taken = b.CreateLabel(absl::StrCat(tree, "_ticket_taken"));
  l.end = b.CreateLabel(absl::StrCat(tree, "_", end));
  l.done = b.CreateLabel(absl::StrCat(tree, "_done"));
  return l;
}

// The address of this thread's place in workspace row `row`.
Value WorkspaceRow(Builder& b, const TreeFrame& t, Value row) {
  const Value row_off = b.MulWide(row, Value::U32(t.row_bytes));
  return b.Add(t.ws_thread, row_off);
}

// The members of the next level: ceil(count / F).
Value GroupsAbove(Builder& b, Value count) {
  const Value groups_up = b.Add(count, Value::U32(RowResidentRmsNormBackwardKernel::kFanIn - 1));
  return b.Shr(groups_up, Value::U32(RowResidentRmsNormBackwardKernel::kLogFanIn));
}

// Uniform: member i of a group of `size` exists (size > i), for i in 1..kFanIn-1.
std::vector<Value> MembersPresent(Builder& b, Value size) {
  std::vector<Value> has_row(RowResidentRmsNormBackwardKernel::kFanIn);
  for (uint32_t i = 1; i < has_row.size(); ++i) {
    has_row[i] = b.Setp(CmpOp::kGt, size, Value::U32(i));
  }
  return has_row;
}

// Whether a thread loads member i's quad at column `col`: inside the stride (`in_row`), and
// for i > 0 only where that member exists.
Value LoadsMember(Builder& b, uint32_t i, Value col, Value in_row, Value stride,
                  const std::vector<Value>& has_row) {
  if (i == 0) return in_row;
  const Value limit = b.Selp(stride, Value::U32(0), has_row[i]);
  return b.Setp(CmpOp::kLt, col, limit);
}

// For each member i of a group, in member order: body(i, addr, load), addr member i's row (the
// group's first row plus i rows), load whether this thread loads member i's quad at `col`.
template <typename Body>
void ForEachMember(Builder& b, Value first_row_addr, uint32_t row_bytes, Value col, Value in_row,
                   Value stride, const std::vector<Value>& has_row, Body body) {
  const Value addr = b.Mov(first_row_addr);
  for (uint32_t i = 0; i < RowResidentRmsNormBackwardKernel::kFanIn; ++i) {
    if (i > 0) b.AddTo(addr, Value::U64(row_bytes));
    body(i, addr, LoadsMember(b, i, col, in_row, stride, has_row));
  }
}

// Four f32 from `at` where `load`, else -0.0, the identity of f32 addition (x + -0.0 == x for
// every x, -0.0 too).
std::vector<Value> LoadQuadOrIdentity(Builder& b, Address at, Value load) {
  std::vector<Value> quad;
  for (int j = 0; j < 4; ++j) quad.push_back(b.Mov(Value::F32(-0.0f)));
  b.LdInto(StateSpace::kGlobal, PtxType::kF32, at, quad, load);
  return quad;
}

}  // namespace

void BuildDgammaTree(Builder& b, const RowTiling& tiling, Value col0, Value tid,
                     SharedArray last_flag, const std::vector<Value>& acc,
                     const DgammaTreeParams& p) {
  const uint32_t T = tiling.threads;
  const uint32_t K = tiling.vectors_per_thread;
  const uint32_t V = tiling.vector_elements;
  const TreeLabels labels = CreateTreeLabels(b, "tree", "top");
  const Label level_loop = labels.level_loop, ticket_taken = labels.ticket_taken;
  const Label top = labels.end, done = labels.done;
  const TreeFrame t = StartTree(b, tiling, col0, tid, last_flag, p);
  // Byte offset of slot k's quad q in a workspace row, past the thread's own 16 bytes.
  auto quad_offset = [&](uint32_t k, uint32_t q) {
    return int64_t{k * (V / 4) + q} * T * kVectorBytes;
  };

  // The whole loop is block-uniform: count, member and the flag are the same in every thread.
  b.Bind(level_loop);
  b.BraIf(b.Setp(CmpOp::kEq, t.count, Value::U32(1)), top);
  {
    const Value row_addr = WorkspaceRow(b, t, b.Add(t.level_row, t.member));
    {
      auto l2 = b.WithCache(CacheOp::kCg);
      for (uint32_t k = 0; k < K; ++k) {
        const Value col = b.Add(col0, Value::U32(k * T * V));
        const Value in_row = b.Setp(CmpOp::kLt, col, t.stride);
        auto guard = b.If(in_row);
        for (uint32_t q = 0; q < V / 4; ++q) {
          const std::vector<Value> quad(acc.begin() + k * V + 4 * q,
                                        acc.begin() + k * V + 4 * q + 4);
          b.StV4(StateSpace::kGlobal, Address{row_addr, quad_offset(k, q)}, quad);
        }
      }
    }
    const auto [group, first, size] = TakeGroupTicket(b, t, ticket_taken, done);

    // The last member: acc = row(first) + row(first + 1) + ... + row(first + size - 1), in that
    // order. Rows past the group's size are not loaded (their predicate is false).
    const Value member_addr = WorkspaceRow(b, t, b.Add(t.level_row, first));
    const std::vector<Value> has_row = MembersPresent(b, size);
    {
      auto l2 = b.WithCache(CacheOp::kCg);
      // Slot by slot (fewer registers live), member by member within a slot.
      for (uint32_t k = 0; k < K; ++k) {
        const Value col = b.Add(col0, Value::U32(k * T * V));
        const Value in_row = b.Setp(CmpOp::kLt, col, t.stride);
        ForEachMember(b, member_addr, t.row_bytes, col, in_row, t.stride, has_row,
                      [&](uint32_t i, Value addr, Value load) {
          for (uint32_t q = 0; q < V / 4; ++q) {
            const std::vector<Value> quad =
                LoadQuadOrIdentity(b, Address{addr, quad_offset(k, q)}, load);
            for (int j = 0; j < 4; ++j) {
              const Value& a = acc[k * V + 4 * q + j];
              if (i == 0) {
                b.Assign(a, quad[j]);
              } else {
                b.AddTo(a, quad[j]);
              }
            }
          }
        });
      }
    }
    b.AddTo(t.level_row, t.count);
    const Value groups = GroupsAbove(b, t.count);
    b.AddTo(t.level_sem, groups);
    b.Assign(t.member, group);
    b.Assign(t.count, groups);
    b.Bra(level_loop);
  }

  // The top: acc is the whole grad_gamma (or, for G == 1, the one block's sums). dgamma is the
  // caller's f32 [hidden_dim]: 16-byte vectors where it is aligned, else element by element.
  b.Bind(top);
  const Value vec_limit = DgammaVectorLimit(b, t.dgamma, p.hidden);
  const Value dg_thread = b.Add(t.dgamma, t.col0_bytes);
  for (uint32_t k = 0; k < K; ++k) {
    for (uint32_t q = 0; q < V / 4; ++q) {
      const uint32_t slot_col = k * T * V + 4 * q;
      const SlotPredicates sp = MakeSlotPredicates(b, col0, slot_col, 4, vec_limit, p.hidden);
      const std::vector<Value> quad(acc.begin() + k * V + 4 * q, acc.begin() + k * V + 4 * q + 4);
      StoreSlot(b, DType::kF32, Address{dg_thread, 4 * int64_t{slot_col}}, sp.vec, sp.elem, quad);
    }
  }
  b.Bind(done);
  b.Ret();
}

void BuildStreamedTree(Builder& b, const RowTiling& tiling, Value col0, Value tid,
                       SharedArray last_flag, const DgammaTreeParams& p) {
  const uint32_t T = tiling.threads;
  const uint32_t V = tiling.vector_elements;
  const TreeLabels labels = CreateTreeLabels(b, "stree", "single");
  const Label level_loop = labels.level_loop, ticket_taken = labels.ticket_taken;
  const Label single = labels.end, done = labels.done;
  const TreeFrame t = StartTree(b, tiling, col0, tid, last_flag, p);
  const Value hidden = p.hidden;
  const Value dg_thread = b.Add(t.dgamma, t.col0_bytes);
  const Value dg_limit = DgammaVectorLimit(b, t.dgamma, hidden);
  // Stores quad q of a segment's sums to dgamma (f32, vector or element by element).
  auto store_dgamma = [&](Value seg, Value seg_bytes4, uint32_t q, const std::vector<Value>& quad) {
    const Value col = b.Add(col0, seg);
    const SlotPredicates sp = MakeSlotPredicates(b, col, 4 * q, 4, dg_limit, hidden);
    const Value addr = b.Add(dg_thread, seg_bytes4);
    StoreSlot(b, DType::kF32, Address{addr, 16 * int64_t{q}}, sp.vec, sp.elem, quad);
  };

  b.BraIf(b.Setp(CmpOp::kEq, t.count, Value::U32(1)), single);

  // Block-uniform, as in BuildDgammaTree. This block's row of the level is written.
  b.Bind(level_loop);
  {
    const auto [group, first, size] = TakeGroupTicket(b, t, ticket_taken, done);

    // The last member: the group's rows in member order, into the next level's row `group` or,
    // when the next level has one member, into dgamma.
    const Value groups = GroupsAbove(b, t.count);
    const Value is_top = b.Setp(CmpOp::kEq, groups, Value::U32(1));
    const Value member_addr = WorkspaceRow(b, t, b.Add(t.level_row, first));
    const Value next_base = b.Add(t.level_row, t.count);
    const Value dest_addr = WorkspaceRow(b, t, b.Add(next_base, group));
    const std::vector<Value> has_row = MembersPresent(b, size);
    SegmentLoop(b, hidden, T * V, "stree_segment", [&](Value seg, Value seg_bytes4) {
      const Value col = b.Add(col0, seg);
      const Value in_row = b.Setp(CmpOp::kLt, col, t.stride);
      const Value seg_addr = b.Add(member_addr, seg_bytes4);
      for (uint32_t q = 0; q < V / 4; ++q) {
        std::vector<Value> sum;
        {
          auto l2 = b.WithCache(CacheOp::kCg);
          ForEachMember(b, seg_addr, t.row_bytes, col, in_row, t.stride, has_row,
                        [&](uint32_t i, Value addr, Value load) {
            const std::vector<Value> quad =
                LoadQuadOrIdentity(b, Address{addr, int64_t{q} * T * kVectorBytes}, load);
            for (int j = 0; j < 4; ++j) {
              if (i == 0) {
                sum.push_back(quad[j]);
              } else {
                b.AddTo(sum[j], quad[j]);
              }
            }
          });
        }
        const Label to_dgamma = b.CreateLabel("stree_to_dgamma");
        const Label stored = b.CreateLabel("stree_stored");
        b.BraIf(is_top, to_dgamma);
        {
          const Value dest = b.Add(dest_addr, seg_bytes4);
          auto l2 = b.WithCache(CacheOp::kCg);
          auto guard = b.If(in_row);
          b.StV4(StateSpace::kGlobal, Address{dest, int64_t{q} * T * kVectorBytes}, sum);
        }
        b.Bra(stored);
        b.Bind(to_dgamma);
        store_dgamma(seg, seg_bytes4, q, sum);
        b.Bind(stored);
      }
    });
    b.AddTo(t.level_row, t.count);
    b.AddTo(t.level_sem, groups);
    b.Assign(t.member, group);
    b.Assign(t.count, groups);
    b.BraIf(is_top, done);
    b.Bra(level_loop);
  }

  // One block: its row 0 is the whole grad_gamma (its own stores, read back by the same threads).
  b.Bind(single);
  SegmentLoop(b, hidden, T * V, "stree_single_segment", [&](Value seg, Value seg_bytes4) {
    const Value col = b.Add(col0, seg);
    const Value in_row = b.Setp(CmpOp::kLt, col, t.stride);
    const Value addr = b.Add(t.ws_thread, seg_bytes4);
    for (uint32_t q = 0; q < V / 4; ++q) {
      std::vector<Value> quad;
      {
        auto l2 = b.WithCache(CacheOp::kCg);
        quad = LoadQuadOrIdentity(b, Address{addr, int64_t{q} * T * kVectorBytes}, in_row);
      }
      store_dgamma(seg, seg_bytes4, q, quad);
    }
  });
  b.Bind(done);
  b.Ret();
}

}  // namespace normgrad::kernels::row_resident_internal
