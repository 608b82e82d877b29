#include "kernels/rmsnorm/row_resident_parts.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"

namespace normgrad::kernels::row_resident_internal {

Value WarpAllSum(Builder& b, Value v) {
  Value sum = v;
  for (uint32_t mask : {16u, 8u, 4u, 2u, 1u}) {
    const Value other = b.Shfl(ShflMode::kBfly, sum, Value::U32(mask), kFullMask);
    sum = b.Add(sum, other);
  }
  return sum;
}

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

NormVariant EmittedVariant(const KernelConfig& config) {
  NormVariant v = config.variant;
  if (!v.has_gamma) v = NormVariant{.gamma_offset = 0.0f, .has_gamma = false};
  if (config.dtype == DType::kF32) v.casting = CastingMode::kGemma;
  return v;
}

Value RoundToElement(Builder& b, DType dtype, Value v) {
  const Value bits = F32ToU16(b, dtype, v);
  if (dtype == DType::kF16) {
    return b.CvtFrom(PtxType::kF32, PtxType::kF16, b.Bitcast(PtxType::kB16, bits));
  }
  const Value wide = b.Cvt(PtxType::kU32, bits);
  return b.Bitcast(PtxType::kF32, b.Shl(wide, Value::U32(16)));
}

std::vector<Value> LoadScales(Builder& b, const VariantMath& math, Address addr, Value vec,
                              const std::vector<Value>& scalar) {
  if (!math.variant.has_gamma) return {};
  std::vector<Value> gs = LoadSlot(b, math.dtype, addr, vec, scalar);
  if (math.variant.gamma_offset != 0.0f) {
    for (Value& g : gs) g = b.Add(g, Value::F32(math.variant.gamma_offset));
  }
  return gs;
}

Value ScaledDy(Builder& b, const VariantMath& math, const std::vector<Value>& gs,
               const std::vector<Value>& dys, size_t j) {
  if (!math.variant.has_gamma) return dys[j];
  const Value m = b.Mul(gs[j], dys[j]);
  return math.round_scaled() ? RoundToElement(b, math.dtype, m) : m;
}

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

ThreadRowPointers RowPointers(Builder& b, const RowKernelValues& v, Value row,
                              uint32_t elem_bytes) {
  const Value row_elems = b.MulWide(row, v.hidden);
  const Value row_off = b.Shl(row_elems, Value::U32(elem_bytes == 4 ? 2 : 1));
  const Value thread_off = b.Add(row_off, v.thread_bytes);
  return {b.Add(v.x_base, thread_off), b.Add(v.dy_base, thread_off), b.Add(v.dx_base, thread_off)};
}

void AddRowSums(Builder& b, const VariantMath& math, const std::vector<Value>& xs,
                const std::vector<Value>& dys, const std::vector<Value>& gs, Value sum_sq,
                Value sum_dot) {
  for (size_t j = 0; j < xs.size(); ++j) {
    b.FmaTo(sum_sq, xs[j], xs[j]);
    const Value m = ScaledDy(b, math, gs, dys, j);
    b.FmaTo(sum_dot, xs[j], m);
  }
}

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

}  // namespace normgrad::kernels::row_resident_internal
