// The row-resident plan's global-memory traffic on the interpreter (RunPlanTraffic) at small
// shapes with the issue's ratio of rows to grid (about 31 rows per block, as 16384 x 4096 and
// 32768 x 896 have on 132 SMs; here 32 rows per block on one SM), held to what the current
// kernels achieve: x and dy read once and dx written once, gamma read and grad_gamma written once
// per chunk, the f32 partial rows written once and read once (8 bytes per column per partial
// row), the requested (L2) bytes, sector efficiency >= 0.98 (f32) / 0.92 (bf16: scalar partial
// stores), and two launches (row-resident + dgamma reduce).
#include <cstdint>
#include <ostream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
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

TEST_P(RowResidentPlanTraffic, MovesEachElementOnceAndThePartialRowsTwice) {
  const Shape shape = GetParam();
  PlanTrafficOptions options;
  options.dtype = shape.dtype;
  options.hidden = shape.hidden;
  options.sm_count = 1;
  kernels::KernelConfig config;
  config.hidden_dim = shape.hidden;
  config.dtype = shape.dtype;
  config.target_sm = options.target_sm;
  config.sm_count = options.sm_count;
  const kernels::Kernel* main = kernels::FindKernel("rms_norm_backward_row_resident");
  ASSERT_NE(main, nullptr);
  const uint32_t grid = main->Geometry(config, uint64_t{1} << 20).grid[0];
  options.rows = 32 * grid;
  absl::StatusOr<PlanTraffic> t = RunPlanTraffic(options);
  ASSERT_TRUE(t.ok()) << t.status();

  ASSERT_EQ(t->launches.size(), 2u);
  EXPECT_EQ(t->launches[0].entry, "rms_norm_backward_row_resident");
  EXPECT_EQ(t->launches[1].entry, "rms_norm_backward_dgamma_reduce");
  EXPECT_EQ(t->launches[0].geometry.grid[0], grid);
  const double rows = options.rows;
  const double elem = static_cast<double>(kernels::DTypeBytes(shape.dtype));
  // Partial rows: grid x hidden f32, written by the first launch, read by the second.
  EXPECT_DOUBLE_EQ(t->PartialBytesPerElement(), 8.0 * grid / rows);
  EXPECT_EQ(t->launches[0].report.traffic.marked_written_bytes, 4ull * grid * shape.hidden);
  EXPECT_EQ(t->launches[1].report.traffic.marked_read_bytes, 4ull * grid * shape.hidden);
  // The rest: x, dy read and dx written once (3 elements), gamma read and grad_gamma (f32)
  // written once per chunk.
  EXPECT_DOUBLE_EQ(t->BytesPerElement() - t->PartialBytesPerElement(),
                   3.0 * elem + (elem + 4.0) / rows);
  // Requested (L2) bytes: per row x, dy and gamma twice read and dx written (5 elements); each
  // thread stores its partial row as scalar f32 stores one 16-byte vector (f32) or 32 bytes
  // (16-bit types) apart from the next lane's, so a warp's store requests 4x (f32) / 8x (bf16)
  // its bytes; the reduce reads the partials once and writes grad_gamma. Equal today; a kernel
  // that moves less passes.
  const double partial_store_inflation = shape.dtype == DType::kF32 ? 4.0 : 8.0;
  EXPECT_LE(t->L2BytesPerElement(),
            5.0 * elem + (4.0 * partial_store_inflation + 4.0) * grid / rows + 4.0 / rows + 1e-9);
  // What those partial stores cost: >= 0.98 at f32, >= 0.92 at 16-bit types (the issue's 0.98
  // needs vectorized partial stores).
  EXPECT_GE(t->total.SectorEfficiency(), shape.dtype == DType::kF32 ? 0.98 : 0.92);
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
