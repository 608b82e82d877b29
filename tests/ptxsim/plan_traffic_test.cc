// The row-resident plan's global-memory traffic on the interpreter (RunPlanTraffic) at small
// shapes with the issue's ratio of rows to grid (about 62 rows per block, as 16384 x 4096 and
// 32768 x 896 have on 132 SMs; here 62 rows per block on 9 SMs, so the grad_gamma tree has two
// or three levels), held exactly to what the kernel moves: one launch; x and dy read once and dx
// written once, gamma read and grad_gamma written once per chunk; the tree's rows (hidden_dim
// rounded up to V f32 each) written once and read once and its semaphores counted (8 bytes per
// column per tree row); every access in whole sectors (efficiency >= 0.99).
#include <cstdint>
#include <ostream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
#include "kernels/rms_norm_backward_row_resident.h"
#include "tests/ptxsim/traffic.h"

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

class RowResidentPlanTraffic : public ::testing::TestWithParam<Shape> {};

TEST_P(RowResidentPlanTraffic, MovesEachElementOnceAndTheTreeRowsTwiceInOneLaunch) {
  using kernels::RowResidentRmsNormBackwardKernel;
  const Shape shape = GetParam();
  PlanTrafficOptions options;
  options.dtype = shape.dtype;
  options.hidden = shape.hidden;
  options.sm_count = 9;
  kernels::KernelConfig config;
  config.hidden_dim = shape.hidden;
  config.dtype = shape.dtype;
  config.target_sm = options.target_sm;
  config.sm_count = options.sm_count;
  const kernels::Kernel* main = kernels::FindKernel("rms_norm_backward_row_resident");
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
  const uint64_t semaphore_bytes =
      (uint64_t{RowResidentRmsNormBackwardKernel::TreeSemaphores(grid)} * 4 + 31) / 32 * 32;
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

INSTANTIATE_TEST_SUITE_P(IssueRatios, RowResidentPlanTraffic,
                         ::testing::Values(Shape{DType::kF32, 896}, Shape{DType::kF32, 4096},
                                           Shape{DType::kBF16, 896}, Shape{DType::kBF16, 4096}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::string(info.param.dtype == DType::kF32 ? "f32_" : "bf16_") +
                                  std::to_string(info.param.hidden);
                         });

// Above the row-resident kernel's hidden sizes the backend runs the batched kernel: one launch,
// no workspace, grad_gamma by f32 atomics (read and written: 4 + 4 bytes per column per chunk
// distinct, 8 bytes per element requested), x, dy and gamma requested 7 elements per element over
// its passes (at most today's), every access coalesced.
TEST(PlanTraffic, BatchedPlanAtHidden65536IsOneCoalescedLaunch) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype == DType::kF32 ? "f32" : "bf16");
    PlanTrafficOptions options;
    options.dtype = dtype;
    options.hidden = 65536;
    options.rows = 4;
    absl::StatusOr<PlanTraffic> t = RunPlanTraffic(options);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->launches.size(), 1u);
    EXPECT_EQ(t->launches[0].entry, "batched_rms_norm_backward");
    const double elem = static_cast<double>(kernels::DTypeBytes(dtype));
    EXPECT_DOUBLE_EQ(t->BytesPerElement(), 3.0 * elem + (elem + 8.0) / options.rows);
    EXPECT_EQ(t->PartialBytesPerElement(), 0.0);
    EXPECT_LE(t->L2BytesPerElement(), 7.0 * elem + 8.0);
    EXPECT_EQ(t->total.SectorEfficiency(), 1.0);
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
