#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_params.h"
#include "kernels/rmsnorm/row_resident_parts.h"
#include "base/status_macros.h"

namespace normgrad::kernels {

// The parts (kernels/rmsnorm/row_resident_parts.h).
using row_resident_internal::AddRowSums;
using row_resident_internal::BuildDgammaTree;
using row_resident_internal::BuildStreamedRows;
using row_resident_internal::CeilDiv;
using row_resident_internal::DeclareRowKernel;
using row_resident_internal::DgammaTreeParams;
using row_resident_internal::EmittedVariant;
using row_resident_internal::LoadRowKernelValues;
using row_resident_internal::LoadScales;
using row_resident_internal::LoadSlotRaw;
using row_resident_internal::MakeSlotPredicates;
using row_resident_internal::MathFor;
using row_resident_internal::ReduceRowSums;
using row_resident_internal::RowKernelDecl;
using row_resident_internal::RowKernelValues;
using row_resident_internal::RowPointers;
using row_resident_internal::RowScale;
using row_resident_internal::SlotDx;
using row_resident_internal::SlotPredicates;
using row_resident_internal::SlotToF32;
using row_resident_internal::StoreSlot;
using row_resident_internal::ThreadRowPointers;
using row_resident_internal::VariantMath;
using row_resident_internal::kVectorBytes;

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
