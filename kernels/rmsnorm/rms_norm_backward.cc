#include "kernels/rmsnorm/rms_norm_backward.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"
#include "base/status_macros.h"

namespace normgrad::kernels {
namespace {

// Sum over the 32 lanes of a warp, in a fixed order, broadcast from lane 0 so every lane holds the
// same bits. All five steps always run: lanes holding no element contribute 0.
Value WarpSum(Builder& b, Value v) {
  Value sum = v;
  for (uint32_t offset : {16u, 8u, 4u, 2u, 1u}) {
    Value other = b.Shfl(ShflMode::kDown, sum, Value::U32(offset), kFullMask);
    sum = b.Add(sum, other);
  }
  return b.Shfl(ShflMode::kIdx, sum, Value::U32(0), kFullMask);
}

PtxType StorageType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return PtxType::kF32;
    case DType::kBF16:
      return PtxType::kU16;
    case DType::kF16:
      return PtxType::kB16;
  }
  return PtxType::kF32;
}

// A loaded element (of StorageType) as f32; every conversion is exact.
Value ToF32(Builder& b, DType dtype, Value raw) {
  switch (dtype) {
    case DType::kF32:
      return raw;
    case DType::kF16:
      return b.CvtFrom(PtxType::kF32, PtxType::kF16, raw);  // cvt.f32.f16
    case DType::kBF16: {
      // bf16 is the high half of an f32: widen, shift, reinterpret (works on every target).
      const Value wide = b.Cvt(PtxType::kU32, raw);
      const Value bits = b.Shl(wide, Value::U32(16));
      return b.Bitcast(PtxType::kF32, bits);
    }
  }
  return raw;
}

// Loads one element of `dtype` as f32.
Value LoadAsF32(Builder& b, DType dtype, Address addr) {
  return ToF32(b, dtype, b.Ld(StateSpace::kGlobal, StorageType(dtype), addr));
}

// Loads one element of `dtype` as f32 where `pred` holds, else 0.
Value LoadAsF32Or0(Builder& b, DType dtype, Value pred, Address addr) {
  const Value zero = dtype == DType::kF32 ? Value::F32(0.0f) : Value::Imm(StorageType(dtype), 0);
  return ToF32(b, dtype, b.LdOr(StateSpace::kGlobal, pred, addr, zero));
}

// An f32 result rounded to `dtype` (to nearest even), ready for StoreElement.
Value FromF32(Builder& b, DType dtype, Value v) {
  switch (dtype) {
    case DType::kF32:
      return v;
    case DType::kF16:
      return b.Cvt(PtxType::kF16, v, Rounding::kRn);  // cvt.rn.f16.f32
    case DType::kBF16:
      return b.Cvt(PtxType::kBF16, v, Rounding::kRn);  // cvt.rn.bf16.f32 (sm_80+)
  }
  return v;
}

void StoreElement(Builder& b, DType dtype, Address addr, Value converted) {
  if (dtype == DType::kF32) {
    b.St(StateSpace::kGlobal, addr, converted);
  } else {
    b.StAs(StateSpace::kGlobal, PtxType::kB16, addr, converted);
  }
}

// Column `col` of a row of the batched kernel: its byte offset, and x, dy and gamma as f32.
struct Column {
  Value offset, x, dy, gamma;
};
Column LoadColumn(Builder& b, DType dtype, Value col, Value x_row, Value dy_row, Value gamma) {
  Column c;
  c.offset = b.MulWide(col, Value::U32(DTypeBytes(dtype)));
  c.x = LoadAsF32(b, dtype, Address{b.Add(x_row, c.offset)});
  c.dy = LoadAsF32(b, dtype, Address{b.Add(dy_row, c.offset)});
  c.gamma = LoadAsF32(b, dtype, Address{b.Add(gamma, c.offset)});
  return c;
}

// log2 of the element size, for byte offsets.
uint32_t ElementShift(DType dtype) { return dtype == DType::kF32 ? 2 : 1; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// rms_norm_backward

LaunchGeometry RmsNormBackwardKernel::Geometry(const KernelConfig& config,
                                               uint64_t num_rows) const {
  LaunchGeometry g;
  const uint64_t blocks = (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  g.grid[0] = static_cast<uint32_t>(std::clamp<uint64_t>(blocks, 1, kMaxGridX));
  g.block[0] = BlockThreads(config);
  return g;
}

absl::StatusOr<Module> RmsNormBackwardKernel::Build(const KernelConfig& config) const {
  NORMGRAD_ASSIGN_OR_RETURN(Module m, StartModule(config));
  Function& f = m.mutable_functions().front();
  const auto [input_ptr, gamma_ptr, rms_ptr, grad_output_ptr, grad_input_ptr, num_rows,
              hidden_dim] =
      AddKernelParams(f, {KernelParamId::kInput, KernelParamId::kGamma, KernelParamId::kRms,
                          KernelParamId::kGradOutput, KernelParamId::kGradInput,
                          KernelParamId::kNumRows, KernelParamId::kHiddenDim});

  Builder b(&f);
  const Label exit = b.CreateLabel("exit");

  // row = ctaid.x * (ntid.x / 32) + tid.x / 32: the same for the 32 lanes of a warp.
  const Value tid = b.Mov(SpecialReg::kTidX);
  const Value ctaid = b.Mov(SpecialReg::kCtaidX);
  const Value ntid = b.Mov(SpecialReg::kNtidX);
  const Value warps_per_block = b.Shr(ntid, Value::U32(5));
  const Value row = b.Mad(ctaid, warps_per_block, b.Shr(tid, Value::U32(5)));
  const Value lane = b.And(tid, Value::U32(31));

  // Whole warps leave together: no lane exits before the shuffles below.
  const Value rows = b.LdParam(num_rows);
  b.BraIfNot(b.Setp(CmpOp::kLt, row, rows), exit);

  const auto [hidden, x_base, gamma_base, rms_base, dy_base, dx_base] =
      b.LdParams({hidden_dim, input_ptr, gamma_ptr, rms_ptr, grad_output_ptr, grad_input_ptr});

  const Value lane_valid = b.Setp(CmpOp::kLt, lane, hidden);
  // Element offset in 64 bits: row * hidden_dim may exceed 2^32.
  const Value elem = b.MadWide(row, hidden, b.Cvt(PtxType::kU64, lane));
  const DType dtype = config.dtype;
  const Value elem_bytes = b.Shl(elem, Value::U32(ElementShift(dtype)));
  const Value lane_bytes = b.MulWide(lane, Value::U32(DTypeBytes(dtype)));

  const Value rms = b.Ld(StateSpace::kGlobal, PtxType::kF32,
                         Address{b.Add(rms_base, b.MulWide(row, Value::U32(4)))});
  const Value x = LoadAsF32Or0(b, dtype, lane_valid, Address{b.Add(x_base, elem_bytes)});
  const Value gamma = LoadAsF32Or0(b, dtype, lane_valid, Address{b.Add(gamma_base, lane_bytes)});
  const Value dy = LoadAsF32Or0(b, dtype, lane_valid, Address{b.Add(dy_base, elem_bytes)});

  const Value gamma_dy = b.Mul(gamma, dy);
  const Value total = WarpSum(b, b.Mul(x, gamma_dy));
  const Value mean = b.Div(total, b.Cvt(PtxType::kF32, hidden, Rounding::kRn), Rounding::kRn);

  // The forward's rms already contains eps: used as is (adding eps again would be wrong).
  const Value inv_rms = b.Rcp(rms, Rounding::kRn);
  const Value correction = b.Mul(b.Mul(mean, inv_rms), inv_rms);
  const Value dx = b.Mul(inv_rms, b.Sub(gamma_dy, b.Mul(x, correction)));
  const Value dx_out = FromF32(b, dtype, dx);
  const Value dx_addr = b.Add(dx_base, elem_bytes);
  {
    auto only_valid_lanes = b.If(lane_valid);
    StoreElement(b, dtype, Address{dx_addr}, dx_out);
  }
  b.Bind(exit);
  b.Ret();
  return m;
}

// ---------------------------------------------------------------------------------------------
// batched_rms_norm_backward

LaunchGeometry BatchedRmsNormBackwardKernel::Geometry(const KernelConfig& config,
                                                      uint64_t num_rows) const {
  LaunchGeometry g;
  g.grid[0] = static_cast<uint32_t>(std::clamp<uint64_t>(num_rows, 1, kMaxGridX));
  g.block[0] = BlockThreads(config);
  return g;
}

absl::StatusOr<Module> BatchedRmsNormBackwardKernel::Build(const KernelConfig& config) const {
  NORMGRAD_ASSIGN_OR_RETURN(Module m, StartModule(config));
  Function& f = m.mutable_functions().front();
  const auto [input_ptr, gamma_ptr, grad_output_ptr, grad_input_ptr, grad_gamma_ptr, num_rows,
              hidden_dim, eps_param] =
      AddKernelParams(f, {KernelParamId::kInput, KernelParamId::kGamma, KernelParamId::kGradOutput,
                          KernelParamId::kGradInput, KernelParamId::kGradGamma,
                          KernelParamId::kNumRows, KernelParamId::kHiddenDim, KernelParamId::kEps});

  Builder b(&f);
  const Label exit = b.CreateLabel("exit");
  const Label sum_loop = b.CreateLabel("sum_loop");
  const Label sum_done = b.CreateLabel("sum_done");
  const Label grad_loop = b.CreateLabel("grad_loop");

  // One block per row: the row test is the same for every thread of the block.
  const Value row = b.Mov(SpecialReg::kCtaidX);
  const Value tid = b.Mov(SpecialReg::kTidX);
  const Value rows = b.LdParam(num_rows);
  b.BraIfNot(b.Setp(CmpOp::kLt, row, rows), exit);

  const auto [hidden, eps, x_base, gamma_base, dy_base, dx_base, dgamma_base] =
      b.LdParams({hidden_dim, eps_param, input_ptr, gamma_ptr, grad_output_ptr, grad_input_ptr,
                  grad_gamma_ptr});

  const DType dtype = config.dtype;
  const Value row_bytes = b.Shl(b.MulWide(row, hidden), Value::U32(ElementShift(dtype)));
  const Value x_row = b.Add(x_base, row_bytes);
  const Value dy_row = b.Add(dy_base, row_bytes);
  const Value dx_row = b.Add(dx_base, row_bytes);

  // Pass 1: per-lane partial sums of x^2 and x*dy*gamma over i = lane, lane+32, ...
  const Value sum_sq = b.Mov(Value::F32(0.0f));
  const Value sum_xdyg = b.Mov(Value::F32(0.0f));
  const Value i = b.Mov(tid);
  b.Bind(sum_loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, hidden), sum_done);
  {
    const auto [off, x, dy, gamma] = LoadColumn(b, dtype, i, x_row, dy_row, gamma_base);
    b.FmaTo(sum_sq, x, x);
    b.FmaTo(sum_xdyg, x, b.Mul(gamma, dy));
    b.AddTo(i, Value::U32(32));
    b.Bra(sum_loop);
  }
  b.Bind(sum_done);

  // Every lane is back here (the loop's exit post-dominates it): full-mask shuffles are safe.
  const Value total_sq = WarpSum(b, sum_sq);
  const Value total_xdyg = WarpSum(b, sum_xdyg);
  const Value hidden_f = b.Cvt(PtxType::kF32, hidden, Rounding::kRn);
  const Value variance = b.Add(b.Div(total_sq, hidden_f, Rounding::kRn), eps);
  const Value inv_rms = b.Rcp(b.Sqrt(variance, Rounding::kRn), Rounding::kRn);
  const Value mean_xdyg = b.Div(total_xdyg, hidden_f, Rounding::kRn);
  const Value correction = b.Mul(b.Mul(mean_xdyg, inv_rms), inv_rms);

  // Pass 2: dx and this row's share of dgamma.
  const Value j = b.Mov(tid);
  b.Bind(grad_loop);
  b.BraIf(b.Setp(CmpOp::kGe, j, hidden), exit);
  {
    const auto [off, x, dy, gamma] = LoadColumn(b, dtype, j, x_row, dy_row, gamma_base);
    // One emitting call per statement: argument evaluation order is unspecified in C++, and
    // the instruction order must not depend on the compiler.
    const Value gamma_dy = b.Mul(gamma, dy);
    const Value dx = b.Mul(inv_rms, b.Sub(gamma_dy, b.Mul(x, correction)));
    const Value dx_out = FromF32(b, dtype, dx);
    StoreElement(b, dtype, Address{b.Add(dx_row, off)}, dx_out);
    const Value dgamma_part = b.Mul(b.Mul(dy, x), inv_rms);
    // grad_gamma is an f32 accumulator for every dtype.
    const Value dgamma_off = dtype == DType::kF32 ? off : b.MulWide(j, Value::U32(4));
    b.AtomAdd(StateSpace::kGlobal, Address{b.Add(dgamma_base, dgamma_off)}, dgamma_part);
    b.AddTo(j, Value::U32(32));
    b.Bra(grad_loop);
  }
  b.Bind(exit);
  b.Ret();
  return m;
}

// ---------------------------------------------------------------------------------------------
// Launches

BackwardDataFlow RmsNormBackwardKernel::DataFlow() const {
  return {.reads_rms = true, .requires_rms = true, .writes_dgamma = false};
}

absl::Status RmsNormBackwardKernel::Launch(const KernelConfig& config, const BackwardArgs& args,
                                           KernelLauncher& launcher) const {
  return LaunchInPieces(config, args, launcher, [](KernelParamValues&) {});
}

BackwardDataFlow BatchedRmsNormBackwardKernel::DataFlow() const {
  return {.reads_rms = false, .requires_rms = false, .writes_dgamma = true,
          .reproducible_dgamma = false};
}

absl::Status BatchedRmsNormBackwardKernel::Launch(const KernelConfig& config,
                                                  const BackwardArgs& args,
                                                  KernelLauncher& launcher) const {
  // Every piece adds its rows' grad_gamma with atomics: the sum starts at zero.
  NORMGRAD_RETURN_IF_ERROR(
      launcher.ZeroFill(args.dgamma, uint64_t{args.hidden_dim} * sizeof(float)));
  return LaunchInPieces(config, args, launcher,
                        [&](KernelParamValues& values) { values.grad_gamma = args.dgamma; });
}

}  // namespace normgrad::kernels
