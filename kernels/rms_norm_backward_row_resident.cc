#include "kernels/rms_norm_backward_row_resident.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"
#include "base/status_macros.h"

namespace normgrad::kernels {
namespace {

constexpr uint32_t kVectorBytes = 16;

// Sum over the 32 lanes of a warp by butterfly: every lane ends with the same bits (each step
// adds the same two values, and f32 addition is commutative).
Value WarpAllSum(Builder& b, Value v) {
  Value sum = v;
  for (uint32_t mask : {16u, 8u, 4u, 2u, 1u}) {
    const Value other = b.Shfl(ShflMode::kBfly, sum, Value::U32(mask), kFullMask);
    sum = b.Add(sum, other);
  }
  return sum;
}

// A 32-bit word of two 16-bit elements (element 2i in the low half) as two f32 values.
std::pair<Value, Value> UnpackWord(Builder& b, DType dtype, Value word) {
  if (dtype == DType::kBF16) {
    // bf16 is the high half of an f32.
    const Value lo_bits = b.Shl(word, Value::U32(16));
    const Value lo = b.Bitcast(PtxType::kF32, lo_bits);
    const Value hi_bits = b.And(word, Value::B32(0xffff0000u));
    const Value hi = b.Bitcast(PtxType::kF32, hi_bits);
    return {lo, hi};
  }
  // cvt.f32.f16 takes a .b16 register: truncate, reinterpret, convert (exact).
  const Value lo16 = b.Cvt(PtxType::kU16, word);
  const Value lo_b16 = b.Bitcast(PtxType::kB16, lo16);
  const Value lo = b.CvtFrom(PtxType::kF32, PtxType::kF16, lo_b16);
  const Value hi_word = b.Shr(word, Value::U32(16));
  const Value hi16 = b.Cvt(PtxType::kU16, hi_word);
  const Value hi_b16 = b.Bitcast(PtxType::kB16, hi16);
  const Value hi = b.CvtFrom(PtxType::kF32, PtxType::kF16, hi_b16);
  return {lo, hi};
}

// Loads one 16-byte vector slot of a row (V elements starting at `addr`) as it is in memory: the
// whole vector where `vec`, else each element j where `scalar[j]`, 0 elsewhere. A thread that
// takes the vector path branches over the element path (and back), so it issues one load. f32:
// four f32 registers; f16/bf16: four u32 words of two elements each (element 2i in the low
// half), so a held row costs one register per two elements.
std::vector<Value> LoadSlotRaw(Builder& b, DType dtype, Address addr, Value vec,
                               const std::vector<Value>& scalar) {
  const bool f32 = dtype == DType::kF32;
  std::vector<Value> out;
  for (int w = 0; w < 4; ++w) out.push_back(b.Mov(f32 ? Value::F32(0.0f) : Value::U32(0)));
  const Label elements = b.CreateLabel("slot_elements");
  const Label loaded = b.CreateLabel("slot_loaded");
  b.BraIfNot(vec, elements);
  b.LdInto(StateSpace::kGlobal, f32 ? PtxType::kF32 : PtxType::kU32, addr, out);
  b.Bra(loaded);
  b.Bind(elements);
  if (f32) {
    for (int j = 0; j < 4; ++j) {
      b.LdInto(StateSpace::kGlobal, PtxType::kF32, Address{addr.base, addr.offset + 4 * j},
               {out[j]}, scalar[j]);
    }
  } else {
    std::vector<Value> halves;
    for (int j = 0; j < 8; ++j) {
      halves.push_back(b.LdOr(StateSpace::kGlobal, scalar[j],
                              Address{addr.base, addr.offset + 2 * j},
                              Value::Imm(PtxType::kU16, 0)));
    }
    for (int w = 0; w < 4; ++w) {
      const Value lo = b.Cvt(PtxType::kU32, halves[2 * w]);
      const Value hi_wide = b.Cvt(PtxType::kU32, halves[2 * w + 1]);
      const Value hi = b.Shl(hi_wide, Value::U32(16));
      const Value joined = b.Or(lo, hi);
      b.Assign(out[w], joined);
    }
  }
  b.Bind(loaded);
  return out;
}

// A slot from LoadSlotRaw as V f32 values (exact conversions).
std::vector<Value> SlotToF32(Builder& b, DType dtype, const std::vector<Value>& raw) {
  if (dtype == DType::kF32) return raw;
  std::vector<Value> out;
  for (const Value& word : raw) {
    const auto [lo, hi] = UnpackWord(b, dtype, word);
    out.push_back(lo);
    out.push_back(hi);
  }
  return out;
}

std::vector<Value> LoadSlot(Builder& b, DType dtype, Address addr, Value vec,
                            const std::vector<Value>& scalar) {
  const std::vector<Value> raw = LoadSlotRaw(b, dtype, addr, vec, scalar);
  return SlotToF32(b, dtype, raw);
}

// Stores one slot of f32 results in dtype, with the same predicates (and branches) as LoadSlot.
void StoreSlot(Builder& b, DType dtype, Address addr, Value vec, const std::vector<Value>& scalar,
               const std::vector<Value>& values) {
  const Label elements = b.CreateLabel("slot_store_elements");
  const Label stored = b.CreateLabel("slot_stored");
  if (dtype == DType::kF32) {
    b.BraIfNot(vec, elements);
    b.StV4(StateSpace::kGlobal, addr, values);
    b.Bra(stored);
    b.Bind(elements);
    for (int j = 0; j < 4; ++j) {
      auto one = b.If(scalar[j]);
      b.St(StateSpace::kGlobal, Address{addr.base, addr.offset + 4 * j}, values[j]);
    }
    b.Bind(stored);
    return;
  }
  std::vector<Value> halves;
  for (int j = 0; j < 8; ++j) halves.push_back(F32ToU16(b, dtype, values[j]));
  b.BraIfNot(vec, elements);
  std::vector<Value> words;
  for (int w = 0; w < 4; ++w) {
    const Value lo = b.Cvt(PtxType::kU32, halves[2 * w]);
    const Value hi_wide = b.Cvt(PtxType::kU32, halves[2 * w + 1]);
    const Value hi = b.Shl(hi_wide, Value::U32(16));
    words.push_back(b.Or(lo, hi));
  }
  b.StV4(StateSpace::kGlobal, addr, words);
  b.Bra(stored);
  b.Bind(elements);
  for (int j = 0; j < 8; ++j) {
    auto one = b.If(scalar[j]);
    b.StAs(StateSpace::kGlobal, PtxType::kB16, Address{addr.base, addr.offset + 2 * j}, halves[j]);
  }
  b.Bind(stored);
}

uint32_t CeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// The variant as the PTX computes it. Without gamma the scale is 1, so the offset does not
// apply and every casting mode is the same math (dy is already of the element type); for f32 the
// roundings are the identity. Such configs share one module (ConfigKey names this variant).
NormVariant EmittedVariant(const KernelConfig& config) {
  NormVariant v = config.variant;
  if (!v.has_gamma) v = NormVariant{.gamma_offset = 0.0f, .has_gamma = false};
  if (config.dtype == DType::kF32) v.casting = CastingMode::kGemma;
  return v;
}

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
VariantMath MathFor(const KernelConfig& config) { return {config.dtype, EmittedVariant(config)}; }

// f32 rounded to the element type and back (exact): cvt.rn to f16/bf16, then widened as a load
// widens (bf16: the high half of an f32; f16: cvt.f32.f16).
Value RoundToElement(Builder& b, DType dtype, Value v) {
  const Value bits = F32ToU16(b, dtype, v);
  if (dtype == DType::kF16) {
    return b.CvtFrom(PtxType::kF32, PtxType::kF16, b.Bitcast(PtxType::kB16, bits));
  }
  const Value wide = b.Cvt(PtxType::kU32, bits);
  return b.Bitcast(PtxType::kF32, b.Shl(wide, Value::U32(16)));
}

// One slot's scales (offset + gamma, one f32 add after the load); none without gamma (scale 1:
// no gamma load at all).
std::vector<Value> LoadScales(Builder& b, const VariantMath& math, Address addr, Value vec,
                              const std::vector<Value>& scalar) {
  if (!math.variant.has_gamma) return {};
  std::vector<Value> gs = LoadSlot(b, math.dtype, addr, vec, scalar);
  if (math.variant.gamma_offset != 0.0f) {
    for (Value& g : gs) g = b.Add(g, Value::F32(math.variant.gamma_offset));
  }
  return gs;
}

// Column j's m: dy * scale, rounded to the element type where the casting mode says so; dy
// itself without gamma.
Value ScaledDy(Builder& b, const VariantMath& math, const std::vector<Value>& gs,
               const std::vector<Value>& dys, size_t j) {
  if (!math.variant.has_gamma) return dys[j];
  const Value m = b.Mul(gs[j], dys[j]);
  return math.round_scaled() ? RoundToElement(b, math.dtype, m) : m;
}

// Which path a thread takes for one slot (V columns from col0 + slot_col): `vec` the whole
// 16-byte vector (the slot lies inside the row and rows are aligned), else `elem[j]` for each
// column inside the row. Recomputed where needed rather than held (they are cheap, registers
// are not).
struct SlotPredicates {
  Value vec;
  std::vector<Value> elem;
};
SlotPredicates MakeSlotPredicates(Builder& b, Value col0, uint32_t slot_col, uint32_t V,
                                  Value vec_limit, Value hidden) {
  SlotPredicates p;
  const Value col = b.Add(col0, Value::U32(slot_col));
  const Value slot_end = b.Add(col, Value::U32(V));
  p.vec = b.Setp(CmpOp::kLe, slot_end, vec_limit);
  const Value elem_limit = b.Selp(Value::U32(0), hidden, p.vec);
  for (uint32_t j = 0; j < V; ++j) {
    const Value c = b.Add(col, Value::U32(j));
    p.elem.push_back(b.Setp(CmpOp::kLt, c, elem_limit));
  }
  return p;
}

// What both forms of the entry (held and streamed rows) declare: the parameters, in the one
// order kernels/kernel_params.h gives them, the launch bounds' blocks per SM, and the shared
// arrays of the row reduction (two f32 per warp: its sums of x^2 and x*gamma*dy) and of the tree
// (whether this block arrived last, written by thread 0).
struct RowKernelDecl {
  Param input, gamma, grad_output, grad_input, rms, dgamma, partials, semaphores, num_rows,
      hidden_dim, eps;
  SharedArray warp_sums, last_flag;
};
RowKernelDecl DeclareRowKernel(Function& f, const RowTiling& tiling) {
  f.set_min_blocks_per_sm(tiling.blocks_per_sm);
  RowKernelDecl d;
  std::tie(d.input, d.gamma, d.grad_output, d.grad_input, d.rms, d.dgamma, d.partials, d.semaphores,
           d.num_rows, d.hidden_dim, d.eps) =
      std::tuple_cat(AddKernelParams(
          f, {KernelParamId::kInput, KernelParamId::kGamma, KernelParamId::kGradOutput,
              KernelParamId::kGradInput, KernelParamId::kRms, KernelParamId::kDgamma,
              KernelParamId::kDgammaPartials, KernelParamId::kSemaphores, KernelParamId::kNumRows,
              KernelParamId::kHiddenDim, KernelParamId::kEps}));
  d.warp_sums = f.AddShared("warp_sums", 8 * (tiling.threads / 32), 16);
  d.last_flag = f.AddShared("last_flag", 4, 4);
  return d;
}

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
                                    DType dtype, bool has_gamma) {
  RowKernelValues v;
  v.tid = b.Mov(SpecialReg::kTidX);
  v.block = b.Mov(SpecialReg::kCtaidX);
  v.grid = b.Mov(SpecialReg::kNctaidX);
  std::tie(v.rows, v.hidden, v.eps, v.x_base, v.gamma_base, v.dy_base, v.dx_base, v.rms_base) =
      std::tuple_cat(b.LdParams(
          {d.num_rows, d.hidden_dim, d.eps, d.input, d.gamma, d.grad_output, d.grad_input, d.rms}));
  v.hidden_f = b.Cvt(PtxType::kF32, v.hidden, Rounding::kRn);
  v.have_rms = b.Setp(CmpOp::kNe, v.rms_base, Value::U64(0));

  // 16-byte vectors only when every row start of x, dy, dx and gamma (if read) is 16-byte
  // aligned: hidden_dim * elem_bytes % 16 == 0 and the base pointers aligned. vec_limit is
  // hidden_dim then, 0 otherwise (no slot passes `slot_end <= vec_limit`).
  const Value ptr_or1 = b.Or(v.x_base, v.dy_base);
  const Value ptr_or2 = b.Or(ptr_or1, v.dx_base);
  const Value ptr_or = has_gamma ? b.Or(ptr_or2, v.gamma_base) : ptr_or2;
  const Value ptr_low64 = b.And(ptr_or, Value::U64(kVectorBytes - 1));
  const Value ptr_low = b.Cvt(PtxType::kU32, ptr_low64);
  const Value row_bytes32 = b.Mul(v.hidden, Value::U32(DTypeBytes(dtype)));
  const Value row_low = b.And(row_bytes32, Value::U32(kVectorBytes - 1));
  const Value misaligned = b.Or(ptr_low, row_low);
  const Value aligned = b.Setp(CmpOp::kEq, misaligned, Value::U32(0));
  v.vec_limit = b.Selp(v.hidden, Value::U32(0), aligned);

  // This thread's first column and its byte offset in a row; slot k adds k*T*V columns.
  v.col0 = b.Mul(v.tid, Value::U32(tiling.vector_elements));
  v.thread_bytes = b.MulWide(v.tid, Value::U32(kVectorBytes));
  if (has_gamma) v.gamma_thread = b.Add(v.gamma_base, v.thread_bytes);
  const Value lane = b.And(v.tid, Value::U32(31));
  const Value warp = b.Shr(v.tid, Value::U32(5));
  v.is_lane0 = b.Setp(CmpOp::kEq, lane, Value::U32(0));
  v.sums_base = b.AddressOf(d.warp_sums);
  const Value warp_off = b.MulWide(warp, Value::U32(8));
  v.warp_slot = b.Add(v.sums_base, warp_off);
  return v;
}

// This thread's first x, dy and dx element in row `row`.
struct ThreadRowPointers {
  Value x, dy, dx;
};
ThreadRowPointers RowPointers(Builder& b, const RowKernelValues& v, Value row,
                              uint32_t elem_bytes) {
  const Value row_elems = b.MulWide(row, v.hidden);
  const Value row_off = b.Shl(row_elems, Value::U32(elem_bytes == 4 ? 2 : 1));
  const Value thread_off = b.Add(row_off, v.thread_bytes);
  return {b.Add(v.x_base, thread_off), b.Add(v.dy_base, thread_off), b.Add(v.dx_base, thread_off)};
}

// Adds one slot's columns to the thread's sums of x^2 and x*m (m = ScaledDy), in column order.
void AddRowSums(Builder& b, const VariantMath& math, const std::vector<Value>& xs,
                const std::vector<Value>& dys, const std::vector<Value>& gs, Value sum_sq,
                Value sum_dot) {
  for (size_t j = 0; j < xs.size(); ++j) {
    b.FmaTo(sum_sq, xs[j], xs[j]);
    const Value m = ScaledDy(b, math, gs, dys, j);
    b.FmaTo(sum_dot, xs[j], m);
  }
}

// The row's 1/rms and correction = mean(x*gamma*dy) / rms^2 from the threads' sums: a butterfly
// per warp (every lane the same bits), lane 0's pair to shared memory, every thread adds the
// warps' pairs in warp order (deterministic), a second barrier so the next row's stores wait for
// every read. 1/rms from the forward's rms when given (used as is: it contains eps), else
// recomputed.
struct RowScale {
  Value inv_rms, correction;
};
RowScale ReduceRowSums(Builder& b, const RowKernelValues& v, uint32_t warps, Value sum_sq,
                       Value sum_dot, Value row) {
  const Value warp_sq = WarpAllSum(b, sum_sq);
  const Value warp_dot = WarpAllSum(b, sum_dot);
  {
    auto lane0 = b.If(v.is_lane0);
    b.St(StateSpace::kShared, Address{v.warp_slot, 0}, warp_sq);
    b.St(StateSpace::kShared, Address{v.warp_slot, 4}, warp_dot);
  }
  b.BarSync(0);
  const Value total_sq = b.Ld(StateSpace::kShared, PtxType::kF32, Address{v.sums_base, 0});
  const Value total_dot = b.Ld(StateSpace::kShared, PtxType::kF32, Address{v.sums_base, 4});
  for (uint32_t w = 1; w < warps; ++w) {
    const Value sq = b.Ld(StateSpace::kShared, PtxType::kF32, Address{v.sums_base, 8 * w});
    b.AddTo(total_sq, sq);
    const Value dot = b.Ld(StateSpace::kShared, PtxType::kF32, Address{v.sums_base, 8 * w + 4});
    b.AddTo(total_dot, dot);
  }
  b.BarSync(0);

  const Value mean_sq = b.Div(total_sq, v.hidden_f, Rounding::kRn);
  const Value variance = b.Add(mean_sq, v.eps);
  const Value rms_recomputed = b.Sqrt(variance, Rounding::kRn);
  const Value inv_recomputed = b.Rcp(rms_recomputed, Rounding::kRn);
  const Value rms_off = b.MulWide(row, Value::U32(4));
  const Value rms_addr = b.Add(v.rms_base, rms_off);
  const Value rms_given =
      b.LdOr(StateSpace::kGlobal, v.have_rms, Address{rms_addr, 0}, Value::F32(1.0f));
  const Value inv_given = b.Rcp(rms_given, Rounding::kRn);
  RowScale out;
  out.inv_rms = b.Selp(inv_given, inv_recomputed, v.have_rms);
  const Value mean_dot = b.Div(total_dot, v.hidden_f, Rounding::kRn);
  const Value mean_inv = b.Mul(mean_dot, out.inv_rms);
  out.correction = b.Mul(mean_inv, out.inv_rms);
  return out;
}

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

}  // namespace

// ---------------------------------------------------------------------------------------------
// rms_norm_backward_row_resident

RowTiling RowResidentRmsNormBackwardKernel::TilingFor(const KernelConfig& config) {
  RowTiling t;
  t.vector_elements = kVectorBytes / DTypeBytes(config.dtype);
  const uint32_t hidden = std::max<uint32_t>(config.hidden_dim, 1);
  // kResidentThreadsPerSm threads per SM at up to kPreferredElementsPerThread elements each
  // (64 registers), in the fewest blocks that keep two per SM where the row allows: fewer blocks
  // are fewer grad_gamma partial rows.
  for (const uint32_t threads : {256u, 512u, 1024u}) {
    const uint32_t k = CeilDiv(hidden, threads * t.vector_elements);
    if (k * t.vector_elements <= kPreferredElementsPerThread) {
      t.threads = threads;
      t.vectors_per_thread = k;
      t.blocks_per_sm = kResidentThreadsPerSm / threads;
      return t;
    }
  }
  if (hidden > kMaxHeldHiddenDim) {  // streamed: K segments of one vector per thread
    t.threads = kStreamedThreads;
    t.vectors_per_thread = CeilDiv(hidden, t.threads * t.vector_elements);
    t.blocks_per_sm = 1;
    t.streamed = true;
    return t;
  }
  // Wider rows: 512 threads with up to kMaxElementsPerThread elements, one block per SM (128
  // registers each).
  t.threads = kWideRowThreads;
  t.vectors_per_thread = CeilDiv(hidden, t.threads * t.vector_elements);
  t.blocks_per_sm = 1;
  return t;
}

uint32_t RowResidentRmsNormBackwardKernel::TreeRows(uint32_t blocks) {
  uint32_t rows = 0;
  for (uint32_t count = blocks; count > 1; count = CeilDiv(count, kFanIn)) rows += count;
  return rows;
}

uint32_t RowResidentRmsNormBackwardKernel::WorkspaceRows(const KernelConfig& config,
                                                         uint32_t blocks) {
  const uint32_t rows = TreeRows(blocks);
  return TilingFor(config).streamed ? std::max<uint32_t>(rows, 1) : rows;
}

uint32_t RowResidentRmsNormBackwardKernel::TreeSemaphores(uint32_t blocks) {
  uint32_t counters = 0;
  for (uint32_t count = blocks; count > 1; count = CeilDiv(count, kFanIn)) {
    counters += CeilDiv(count, kFanIn);
  }
  return counters;
}

RowResidentRmsNormBackwardKernel::RowResidentRmsNormBackwardKernel()
    : BuiltKernel(kEntryName, kMaxHiddenDim,
                  absl::StrCat(" (rows held in registers up to ", kMaxHeldHiddenDim,
                               ", streamed through a ", kStreamedThreads,
                               "-thread block above); use batched_rms_norm_backward")) {}

uint32_t RowResidentRmsNormBackwardKernel::BlockThreads(const KernelConfig& config) const {
  return TilingFor(config).threads;
}

LaunchGeometry RowResidentRmsNormBackwardKernel::Geometry(const KernelConfig& config,
                                                          uint64_t num_rows) const {
  const RowTiling t = TilingFor(config);
  const uint64_t sms = config.sm_count == 0 ? kDefaultSmCount : config.sm_count;
  LaunchGeometry g;
  g.grid[0] = static_cast<uint32_t>(
      std::clamp<uint64_t>(std::min(num_rows, sms * t.blocks_per_sm), 1, kMaxGridX));
  g.block[0] = t.threads;
  return g;
}

std::string RowResidentRmsNormBackwardKernel::ConfigKey(const KernelConfig& config) const {
  const RowTiling t = TilingFor(config);
  KernelConfig emitted = config;
  emitted.variant = EmittedVariant(config);
  return absl::StrCat(BuiltKernel::ConfigKey(emitted), "|tile=", t.threads, "x",
                      t.vectors_per_thread, "x", t.blocks_per_sm, t.streamed ? "s" : "");
}

absl::StatusOr<Module> RowResidentRmsNormBackwardKernel::Build(const KernelConfig& config) const {
  NORMGRAD_ASSIGN_OR_RETURN(Module m, StartModule(config));
  const DType dtype = config.dtype;
  const VariantMath math = MathFor(config);
  const bool has_gamma = math.variant.has_gamma;
  const RowTiling tiling = TilingFor(config);
  Function& f = m.mutable_functions().front();
  const RowKernelDecl d = DeclareRowKernel(f, tiling);
  Builder b(&f);
  const Label row_loop = b.CreateLabel("row_loop");
  const Label rows_done = b.CreateLabel("rows_done");
  const RowKernelValues v = LoadRowKernelValues(b, d, tiling, dtype, has_gamma);
  if (tiling.streamed) {
    BuildStreamedRows(b, config, d, v, row_loop, rows_done);
    return m;
  }
  const uint32_t T = tiling.threads;
  const uint32_t K = tiling.vectors_per_thread;
  const uint32_t V = tiling.vector_elements;
  const uint32_t elem_bytes = DTypeBytes(dtype);

  // fp32 grad_gamma accumulators for this thread's columns, over all rows of this block (none
  // without gamma).
  std::vector<Value> acc;
  for (uint32_t e = 0; has_gamma && e < K * V; ++e) acc.push_back(b.Mov(Value::F32(0.0f)));

  // Grid-stride loop over rows; the trip count is the same for every thread of the block.
  const Value row = b.Mov(v.block);
  b.Bind(row_loop);
  b.BraIf(b.Setp(CmpOp::kGe, row, v.rows), rows_done);
  {
    // Named values, not a structured binding: the lambdas below capture them (C++17).
    const ThreadRowPointers ptrs = RowPointers(b, v, row, elem_bytes);
    const Value x_thread = ptrs.x, dy_thread = ptrs.dy, dx_thread = ptrs.dx;

    // x and dy stay in registers until the output; gamma (the same for every row, so cache
    // resident) is loaded again after the reduction instead of holding it, to save registers.
    std::vector<std::vector<Value>> x_raw(K), dy_raw(K);
    const Value sum_sq = b.Mov(Value::F32(0.0f));
    const Value sum_dot = b.Mov(Value::F32(0.0f));
    for (uint32_t k = 0; k < K; ++k) {
      const SlotPredicates p = MakeSlotPredicates(b, v.col0, k * T * V, V, v.vec_limit, v.hidden);
      const int64_t off = int64_t{k} * T * kVectorBytes;
      {
        auto streamed = b.WithCache(CacheOp::kCs);  // read once: evict first, keep gamma
        x_raw[k] = LoadSlotRaw(b, dtype, Address{x_thread, off}, p.vec, p.elem);
        dy_raw[k] = LoadSlotRaw(b, dtype, Address{dy_thread, off}, p.vec, p.elem);
      }
      const std::vector<Value> gs =
          LoadScales(b, math, Address{v.gamma_thread, off}, p.vec, p.elem);
      const std::vector<Value> xs = SlotToF32(b, dtype, x_raw[k]);
      const std::vector<Value> dys = SlotToF32(b, dtype, dy_raw[k]);
      AddRowSums(b, math, xs, dys, gs, sum_sq, sum_dot);
    }
    const RowScale scale = ReduceRowSums(b, v, T / 32, sum_sq, sum_dot, row);

    for (uint32_t k = 0; k < K; ++k) {
      const SlotPredicates p = MakeSlotPredicates(b, v.col0, k * T * V, V, v.vec_limit, v.hidden);
      const int64_t off = int64_t{k} * T * kVectorBytes;
      const std::vector<Value> gs =
          LoadScales(b, math, Address{v.gamma_thread, off}, p.vec, p.elem);
      const std::vector<Value> xs = SlotToF32(b, dtype, x_raw[k]);
      const std::vector<Value> dys = SlotToF32(b, dtype, dy_raw[k]);
      const std::vector<Value> dx = SlotDx(b, math, xs, dys, gs, scale, [&](size_t j, Value part) {
        b.AddTo(acc[k * V + j], part);
      });
      auto streamed = b.WithCache(CacheOp::kCs);  // written once, read by nobody here
      StoreSlot(b, dtype, Address{dx_thread, off}, p.vec, p.elem, dx);
    }
    b.AddTo(row, v.grid);
    b.Bra(row_loop);
  }
  b.Bind(rows_done);
  if (!has_gamma) {
    b.Ret();
    return m;
  }
  BuildDgammaTree(b, tiling, v.col0, v.tid, d.last_flag, acc,
                  DgammaTreeParams{d.dgamma, d.partials, d.semaphores, v.hidden});
  return m;
}

// ---------------------------------------------------------------------------------------------
// Launches

BackwardDataFlow RowResidentRmsNormBackwardKernel::DataFlow() const {
  return {.reads_rms = true, .requires_rms = false, .writes_dgamma = true,
          .reproducible_dgamma = true};
}

uint64_t RowResidentRmsNormBackwardKernel::WorkspaceBytes(const KernelConfig& config,
                                                          uint64_t rows) const {
  if (!config.variant.has_gamma) return 0;  // no grad_gamma, no tree
  const uint32_t blocks = Geometry(config, rows).grid[0];
  return uint64_t{WorkspaceRows(config, blocks)} * TilingFor(config).capacity() * sizeof(float);
}

uint64_t RowResidentRmsNormBackwardKernel::SemaphoreBytes(const KernelConfig& config,
                                                          uint64_t rows) const {
  if (!config.variant.has_gamma) return 0;
  return uint64_t{TreeSemaphores(Geometry(config, rows).grid[0])} * sizeof(uint32_t);
}

bool RowResidentRmsNormBackwardKernel::ImplementsVariant(const NormVariant& variant) const {
  return true;
}

uint64_t RowResidentRmsNormBackwardKernel::MaxRows() const {
  return std::numeric_limits<uint32_t>::max();
}

absl::Status RowResidentRmsNormBackwardKernel::Launch(const KernelConfig& config,
                                                      const BackwardArgs& args,
                                                      KernelLauncher& launcher) const {
  KernelParamValues values = RowValues(config, args, 0, args.rows);
  values.dgamma = args.dgamma;
  values.dgamma_partials = args.workspace;
  values.semaphores = args.semaphores;
  return LaunchWith(Geometry(config, args.rows), values, launcher);
}

}  // namespace normgrad::kernels
