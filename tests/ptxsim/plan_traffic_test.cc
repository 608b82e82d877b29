// The row-resident plan's global-memory traffic on the interpreter (RunPlanTraffic) at small
// shapes with the ratio of rows to grid (about 62 rows per block, as 16384 x 4096 and
// 32768 x 896 have on 132 SMs; here 62 rows per block on 9 SMs, so the grad_gamma tree has two
// or three levels), held exactly to what the kernel moves: one launch; x and dy read once and dx
// written once, gamma read and grad_gamma written once per chunk; the tree's rows (hidden_dim
// rounded up to V f32 each) written once and read once and its semaphores counted (8 bytes per
// column per tree row); every access in whole sectors (efficiency >= 0.99).
#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"
#include "tests/ptxsim/sim/traffic.h"

namespace normgrad::ptxsim {
namespace {

using kernels::DType;

struct Shape {
  DType dtype;
  uint32_t hidden;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << (s.dtype == DType::kF32 ? "f32" : "bf16") << "_" << s.hidden;
}

// RunPlanTraffic's options for `dtype` at `hidden` on `sm_count` SMs; the rows are the test's.
PlanTrafficOptions OptionsFor(DType dtype, uint32_t hidden, uint32_t sm_count) {
  PlanTrafficOptions options;
  options.dtype = dtype;
  options.hidden = hidden;
  options.sm_count = sm_count;
  return options;
}

// The kernel configuration RunPlanTraffic plans for `options`.
kernels::KernelConfig ConfigFor(const PlanTrafficOptions& options) {
  kernels::KernelConfig config;
  config.hidden_dim = options.hidden;
  config.dtype = options.dtype;
  config.target_sm = options.target_sm;
  config.sm_count = options.sm_count;
  return config;
}

// The tree's semaphores of a grid of `grid` blocks (one u32 per group, contiguous), in sectors.
uint64_t SemaphoreSectorBytes(uint32_t grid) {
  return (uint64_t{kernels::RowResidentRmsNormBackwardKernel::TreeSemaphores(grid)} * 4 + 31) / 32 *
         32;
}

class RowResidentPlanTraffic : public ::testing::TestWithParam<Shape> {};

TEST_P(RowResidentPlanTraffic, MovesEachElementOnceAndTheTreeRowsTwiceInOneLaunch) {
  using kernels::RowResidentRmsNormBackwardKernel;
  const Shape shape = GetParam();
  PlanTrafficOptions options = OptionsFor(shape.dtype, shape.hidden, /*sm_count=*/9);
  const kernels::KernelConfig config = ConfigFor(options);
  const kernels::BackwardKernel* main = kernels::FindKernel("rms_norm_backward_row_resident");
  ASSERT_NE(main, nullptr);
  const uint32_t grid = main->Geometry(config, uint64_t{1} << 20).grid[0];
  ASSERT_GT(grid, RowResidentRmsNormBackwardKernel::kFanIn);  // a tree of more than one group
  options.rows = 62 * grid;
  absl::StatusOr<PlanTraffic> t = RunPlanTraffic(options);
  ASSERT_TRUE(t.ok()) << t.status();

  ASSERT_EQ(t->launches.size(), 1u);
  EXPECT_EQ(t->launches[0].entry, "rms_norm_backward_row_resident");
  EXPECT_EQ(t->launches[0].geometry.grid[0], grid);
  const double rows = options.rows;
  const double elements = rows * shape.hidden;
  const double elem = static_cast<double>(kernels::DTypeBytes(shape.dtype));
  // The tree: TreeRows(grid) rows of the hidden_dim rounded up to V f32, written once and read
  // once; its semaphores (one u32 per group, contiguous) read and written by the counts.
  const uint32_t v = RowResidentRmsNormBackwardKernel::TilingFor(config).vector_elements;
  const uint64_t stride = (shape.hidden + v - 1) / v * v;
  const uint64_t tree_bytes =
      uint64_t{RowResidentRmsNormBackwardKernel::TreeRows(grid)} * stride * 4;
  const uint64_t semaphore_bytes = SemaphoreSectorBytes(grid);
  const TrafficReport& traffic = t->launches[0].report.traffic;
  EXPECT_EQ(traffic.marked_written_bytes, tree_bytes + semaphore_bytes);
  EXPECT_EQ(traffic.marked_read_bytes, tree_bytes + semaphore_bytes);
  EXPECT_DOUBLE_EQ(t->PartialBytesPerElement(), 2.0 * (tree_bytes + semaphore_bytes) / elements);
  // The rest: x, dy read and dx written once (3 elements), gamma read and grad_gamma (f32)
  // written once per chunk.
  EXPECT_DOUBLE_EQ(t->BytesPerElement() - t->PartialBytesPerElement(),
                   3.0 * elem + (elem + 4.0) / rows);
  // Requested (L2) bytes: per row x, dy, gamma twice and dx (5 elements); the tree rows once
  // each way; one sector per count and reset of the semaphores; grad_gamma once, in sectors
  // half used at 16-bit types (a thread's two f32 quads of its 8 columns are 32 bytes apart from
  // the next lane's).
  const double semaphore_accesses = 3.0 * grid * 32;  // atom (2) + reset (1) at most per block
  const double dgamma_requested = 4.0 * shape.hidden * (v / 4);
  EXPECT_LE(t->L2BytesPerElement(),
            5.0 * elem + (2.0 * tree_bytes + semaphore_accesses + dgamma_requested) / elements);
  EXPECT_GE(t->total.SectorEfficiency(), 0.99);
}

INSTANTIATE_TEST_SUITE_P(ModelShapes, RowResidentPlanTraffic,
                         ::testing::Values(Shape{DType::kF32, 896}, Shape{DType::kF32, 4096},
                                           Shape{DType::kBF16, 896}, Shape{DType::kBF16, 4096}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::string(info.param.dtype == DType::kF32 ? "f32_" : "bf16_") +
                                  std::to_string(info.param.hidden);
                         });

// Streamed rows (hidden_dim > 16384, up to 65536): still one launch, and in DRAM terms (distinct
// sectors) x and dy are read once, dx written once, the tree's rows written once and read once,
// as for the held rows; what the second pass costs is requested (L2) traffic: x, dy and
// gamma read twice each (7 elements per element with dx), and each block's workspace row read
// and written once per row after its first (8 bytes per column per such row). Shapes: 16 rows
// of 65536 (16 blocks, one group) and 80 rows of 16400 on 20 SMs (20 blocks: 20 -> 2 -> 1, four
// rows per block, a last segment of 16 columns), f32 and bf16.
struct StreamedShape {
  DType dtype;
  uint32_t hidden, rows, sm_count;
};

std::ostream& operator<<(std::ostream& os, const StreamedShape& s) {
  return os << (s.dtype == DType::kF32 ? "f32" : "bf16") << "_" << s.hidden << "x" << s.rows;
}

class StreamedPlanTraffic : public ::testing::TestWithParam<StreamedShape> {};

TEST_P(StreamedPlanTraffic, IsOneLaunchMovingEachElementOnceInDram) {
  using kernels::RowResidentRmsNormBackwardKernel;
  const StreamedShape shape = GetParam();
  PlanTrafficOptions options = OptionsFor(shape.dtype, shape.hidden, shape.sm_count);
  options.rows = shape.rows;
  const kernels::KernelConfig config = ConfigFor(options);
  ASSERT_TRUE(RowResidentRmsNormBackwardKernel::TilingFor(config).streamed);
  absl::StatusOr<PlanTraffic> t = RunPlanTraffic(options);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->launches.size(), 1u);
  EXPECT_EQ(t->launches[0].entry, "rms_norm_backward_row_resident");
  const uint32_t grid = t->launches[0].geometry.grid[0];
  EXPECT_EQ(grid, std::min(shape.rows, shape.sm_count));
  const double rows = options.rows;
  const double elements = rows * shape.hidden;
  const double elem = static_cast<double>(kernels::DTypeBytes(shape.dtype));
  const kernels::RowTiling tiling = RowResidentRmsNormBackwardKernel::TilingFor(config);
  const uint32_t v = tiling.vector_elements;
  const uint64_t stride = (shape.hidden + v - 1) / v * v;
  // A workspace row in sectors: per segment and quad, the threads whose columns start below
  // the stride write 16 contiguous bytes each (a partial last segment ends mid-sector).
  uint64_t ws_row_bytes = 0;
  for (uint64_t seg = 0; seg < shape.hidden; seg += uint64_t{tiling.threads} * v) {
    const uint64_t threads = std::min<uint64_t>(tiling.threads, (stride - seg + v - 1) / v);
    ws_row_bytes += (v / 4) * ((16 * threads + 31) / 32 * 32);
  }
  const uint64_t tree_bytes =
      uint64_t{RowResidentRmsNormBackwardKernel::WorkspaceRows(config, grid)} * ws_row_bytes;
  const uint64_t semaphore_bytes = SemaphoreSectorBytes(grid);
  const TrafficReport& traffic = t->launches[0].report.traffic;
  EXPECT_EQ(traffic.marked_written_bytes, tree_bytes + semaphore_bytes);
  EXPECT_EQ(traffic.marked_read_bytes, tree_bytes + semaphore_bytes);
  // x, dy and dx rows start on sector boundaries at these shapes (rows of whole sectors).
  EXPECT_DOUBLE_EQ(t->BytesPerElement() - t->PartialBytesPerElement(),
                   3.0 * elem + (elem + 4.0) / rows);
  const double rmw_rows = rows - grid;  // rows after each block's first
  const double semaphore_accesses = 3.0 * grid * 32;
  const double dgamma_requested = 4.0 * shape.hidden * (v / 4);
  EXPECT_LE(t->L2BytesPerElement(), 7.0 * elem + (2.0 * ws_row_bytes * rmw_rows + 2.0 * tree_bytes +
                                                  semaphore_accesses + dgamma_requested) /
                                                     elements);
  // The bound on aligned shapes. What is lost is grad_gamma's store at 16-bit types (a
  // thread's two f32 quads 16 bytes apart, once per launch: 4 bytes per column per chunk at half
  // efficiency) and the tail of a partial last segment.
  EXPECT_GE(t->total.SectorEfficiency(), 0.98);
}

INSTANTIATE_TEST_SUITE_P(WideRows, StreamedPlanTraffic,
                         ::testing::Values(StreamedShape{DType::kF32, 65536, 16, 132},
                                           StreamedShape{DType::kBF16, 65536, 16, 132},
                                           StreamedShape{DType::kF32, 16400, 80, 20},
                                           StreamedShape{DType::kBF16, 16400, 80, 20}),
                         [](const ::testing::TestParamInfo<StreamedShape>& info) {
                           return std::string(info.param.dtype == DType::kF32 ? "f32_" : "bf16_") +
                                  std::to_string(info.param.hidden) + "x" +
                                  std::to_string(info.param.rows);
                         });

// The variants: an offset and a casting mode change the arithmetic, not one access (the same
// sectors, the same bytes); without gamma there is no gamma read, no grad_gamma written and no
// tree, so x and dy read and dx written once are all (3 elements per element). Held rows (bf16
// 896, a tree of more than one group) and streamed ones (bf16 16400 on 20 SMs).
TEST(PlanTraffic, VariantsMoveTheSameBytesAndNoGammaMovesLess) {
  for (const StreamedShape& shape : {StreamedShape{DType::kBF16, 896, 62 * 36, 9},
                                     StreamedShape{DType::kBF16, 16400, 80, 20}}) {
    PlanTrafficOptions options = OptionsFor(shape.dtype, shape.hidden, shape.sm_count);
    options.rows = shape.rows;
    absl::StatusOr<PlanTraffic> plain = RunPlanTraffic(options);
    ASSERT_TRUE(plain.ok()) << plain.status();
    options.variant = {.gamma_offset = 1.0f, .casting = kernels::CastingMode::kNone};
    absl::StatusOr<PlanTraffic> offset = RunPlanTraffic(options);
    ASSERT_TRUE(offset.ok()) << offset.status();
    EXPECT_EQ(offset->total.read_bytes, plain->total.read_bytes) << shape;
    EXPECT_EQ(offset->total.written_bytes, plain->total.written_bytes) << shape;
    EXPECT_EQ(offset->total.marked_read_bytes, plain->total.marked_read_bytes) << shape;
    EXPECT_EQ(offset->total.requested_sector_bytes, plain->total.requested_sector_bytes) << shape;

    options.variant = {.has_gamma = false};
    absl::StatusOr<PlanTraffic> no_gamma = RunPlanTraffic(options);
    ASSERT_TRUE(no_gamma.ok()) << no_gamma.status();
    ASSERT_EQ(no_gamma->launches.size(), 1u);
    EXPECT_EQ(no_gamma->workspace_bytes, 0u) << shape;
    EXPECT_EQ(no_gamma->PartialBytesPerElement(), 0.0) << shape;
    const double elem = static_cast<double>(kernels::DTypeBytes(shape.dtype));
    EXPECT_DOUBLE_EQ(no_gamma->BytesPerElement(), 3.0 * elem) << shape;
    EXPECT_LT(no_gamma->BytesPerElement(), plain->BytesPerElement()) << shape;
    EXPECT_LT(no_gamma->L2BytesPerElement(), plain->L2BytesPerElement()) << shape;
  }
}

TEST(PlanTraffic, RejectsAnEmptyShape) {
  PlanTrafficOptions options;
  options.rows = 0;
  options.hidden = 4096;
  absl::StatusOr<PlanTraffic> t = RunPlanTraffic(options);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), ::testing::HasSubstr("rows (0)"));
}

}  // namespace
}  // namespace normgrad::ptxsim
