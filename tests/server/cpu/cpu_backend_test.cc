// CPU-backend specifics: grad_gamma bits independent of the thread count, streaming stores,
// partitions by shape, accuracy over many rows, misaligned buffers, rows grouped by host_rows.
// (What every backend must do: tests/server/backend/backend_test.cc.)
#include "server/cpu/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/rmsnorm/reference.h"
#include "server/host_rows/element_conversion.h"
#include "server/host_rows/host_rows.h"
#include "server/host_rows/row_grouping.h"
#include "server/host_rows/simd_target.h"
#include "tests/server/backend/backend_test_util.h"

// In the test utilities' namespace: Batch, MakeBatch, RunF32... without qualification.
namespace normgrad::server::testing {
namespace {

std::unique_ptr<Backend> Cpu(int threads) {
  CpuBackendOptions options;
  options.threads = threads;
  return NewCpuBackend(options);
}

TEST(CpuBackendTest, SameBitsWhateverTheThreadCount) {
  const Batch b = MakeBatch(5003, 896, /*with_rms=*/false);
  std::vector<Gradients> results;
  for (int threads : {1, 2, 4}) {
    absl::StatusOr<Gradients> g = RunF32(*Cpu(threads), b, 2048);
    ASSERT_TRUE(g.ok()) << g.status();
    results.push_back(*std::move(g));
  }
  for (size_t k = 1; k < results.size(); ++k) {
    EXPECT_EQ(0, std::memcmp(results[0].dgamma.data(), results[k].dgamma.data(), 896 * 4)) << k;
    EXPECT_EQ(0, std::memcmp(results[0].dx.data(), results[k].dx.data(), results[0].dx.size() * 4))
        << k;
  }
}

TEST(CpuBackendTest, LargeChunksWrittenWithStreamingStoresGiveTheSameBits) {
  // 520 x 4099 f32 = 8.5 MB per buffer: above kStreamDxBytes as one chunk, below it in chunks
  // of 100 rows. The odd hidden_dim puts most rows off the vector alignment (scalar heads).
  const Batch b = MakeBatch(520, 4099, /*with_rms=*/false);
  ASSERT_GE(b.x.size() * 4, cpu_internal::kStreamDxBytes);
  absl::StatusOr<Gradients> streamed = RunF32(*Cpu(2), b, 520);
  absl::StatusOr<Gradients> cached = RunF32(*Cpu(2), b, 100);
  ASSERT_TRUE(streamed.ok() && cached.ok());
  EXPECT_EQ(0, std::memcmp(streamed->dx.data(), cached->dx.data(), b.x.size() * 4));
  std::vector<float> dx(b.x.size()), dgamma(b.hidden);
  kernels::ReferenceBackward({b.x, b.dy, b.gamma, {}, b.rows, b.hidden, b.eps}, absl::MakeSpan(dx),
                             absl::MakeSpan(dgamma));
  int bad = 0;
  for (size_t i = 0; i < dx.size(); ++i) {
    if (!(std::fabs(streamed->dx[i] - dx[i]) <= 1e-5 * std::fabs(dx[i]) + 1e-30)) ++bad;
  }
  EXPECT_EQ(bad, 0);
}

TEST(CpuBackendTest, PartitionsDependOnlyOnTheShape) {
  EXPECT_EQ(cpu_internal::RowsPerPartition(4096, 4096), 64u);  // 64 partitions
  EXPECT_EQ(cpu_internal::RowsPerPartition(4096, 1024), 128u);  // >= 131072 elements each
  EXPECT_EQ(cpu_internal::RowsPerPartition(1024, 16384), 64u);  // >= 64 rows each
  EXPECT_EQ(cpu_internal::RowsPerPartition(100, 896), 147u);   // a single partition
  EXPECT_EQ(cpu_internal::RowsPerPartition(1, 1), 131072u);
  EXPECT_EQ(cpu_internal::RowsPerPartition(10000000, 8), 156250u);  // at most 64 partitions
}

TEST(CpuBackendTest, HundredThousandRowsGradGammaWithin1e5OfReference) {
  const Batch b = MakeBatch(100000, 33, /*with_rms=*/false);
  std::vector<float> dx(b.x.size()), dgamma(b.hidden);
  kernels::ReferenceBackward({b.x, b.dy, b.gamma, {}, b.rows, b.hidden, b.eps}, absl::MakeSpan(dx),
                             absl::MakeSpan(dgamma));
  absl::StatusOr<Gradients> got = RunF32(*Cpu(2), b, 30000);
  ASSERT_TRUE(got.ok()) << got.status();
  for (uint32_t i = 0; i < b.hidden; ++i) {
    EXPECT_LE(std::fabs(got->dgamma[i] - dgamma[i]), 1e-5 * std::fabs(dgamma[i])) << i;
  }
}

// Misaligned f32 goes through the f32 staging (as bf16/f16 do), aligned f32 is used in place:
// both give the same bits, with the partition staged whole (50 x 37) or a few rows at a time
// (600 x 100, with a given rms: StagingRows(100) = 163 rows per step, 4 steps).
void ExpectMisalignedSameAsAligned(uint64_t rows, uint32_t hidden, bool with_rms) {
  const Batch b = MakeBatch(rows, hidden, with_rms);
  absl::StatusOr<Gradients> aligned = RunF32(*Cpu(2), b, rows);
  ASSERT_TRUE(aligned.ok());
  // The same bytes one byte into their buffers.
  const size_t n = b.x.size() * 4;
  std::vector<uint8_t> x(n + 1), dy(n + 1), dx(n + 1);
  std::memcpy(x.data() + 1, b.x.data(), n);
  std::memcpy(dy.data() + 1, b.dy.data(), n);
  kernels::BackwardRequest spec;
  spec.num_rows = rows;
  spec.hidden_dim = hidden;
  spec.eps = b.eps;
  spec.rms_provided = with_rms;
  std::unique_ptr<Backend> cpu = Cpu(2);
  auto session = cpu->StartBackward(spec, Bytes(b.gamma));
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)
                  ->ProcessChunk(absl::MakeConstSpan(x).subspan(1),
                                 absl::MakeConstSpan(dy).subspan(1), b.rms, rows,
                                 absl::MakeSpan(dx).subspan(1))
                  .ok());
  std::vector<float> dgamma(hidden);
  ASSERT_TRUE((*session)->Finish(MutableBytes(dgamma)).ok());
  EXPECT_EQ(0, std::memcmp(dx.data() + 1, aligned->dx.data(), n));
  EXPECT_EQ(0, std::memcmp(dgamma.data(), aligned->dgamma.data(), hidden * 4));
}

TEST(CpuBackendTest, MisalignedF32BuffersGiveTheSameResult) {
  ExpectMisalignedSameAsAligned(50, 37, false);
}

TEST(CpuBackendTest, StagingAFewRowsAtATimeGivesTheSameBits) {
  ASSERT_EQ(cpu_internal::StagingRows(100), 163u);
  ExpectMisalignedSameAsAligned(600, 100, true);
}

TEST(CpuBackendTest, StagingIsBoundedPerThreadWhateverTheChunk) {
  EXPECT_EQ(cpu_internal::StagingRows(4096), 4u);   // 16384 elements: 192 KiB of f32 x, dy, dx
  EXPECT_EQ(cpu_internal::StagingRows(65536), 1u);  // one row when rows are wider
  EXPECT_EQ(cpu_internal::StagingRows(1), 16384u);
}

// bf16/f16 buffers aligned to their element are read and written where they lie (converted in
// registers, tails through padded vectors); the same bytes one byte into their buffers are staged
// (copied aligned, a few rows at a time). Both must give the same bits: dx, and
// grad_gamma, for rows with and without a tail shorter than a vector, with and without rms, with
// an offset gamma, and in NaN/inf/subnormal-free data of wide dynamic range.
void ExpectDirectSameAsStaged(kernels::DType dtype, uint64_t rows, uint32_t hidden, bool with_rms,
                              float gamma_offset) {
  SCOPED_TRACE(::testing::Message()
               << "dtype " << static_cast<int>(dtype) << " rows " << rows << " hidden " << hidden
               << " rms " << with_rms << " offset " << gamma_offset);
  const Batch b = MakeBatch(rows, hidden, with_rms);
  // Values scaled by 2^-12 .. 2^12 by column so that x^2 sums span a wide range.
  std::vector<float> x = b.x, dy = b.dy;
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::ldexp(x[i], static_cast<int>(i % 25) - 12);
    dy[i] = std::ldexp(dy[i], 12 - static_cast<int>(i % 23));
  }
  const size_t n = x.size() * 2;
  std::vector<uint8_t> xb(n + 2), dyb(n + 2), gb(hidden * 2);
  host_rows::ConvertFromF32(dtype, x.data(), xb.data(), x.size());
  host_rows::ConvertFromF32(dtype, dy.data(), dyb.data(), dy.size());
  host_rows::ConvertFromF32(dtype, b.gamma.data(), gb.data(), hidden);
  kernels::BackwardRequest spec;
  spec.num_rows = rows;
  spec.hidden_dim = hidden;
  spec.eps = b.eps;
  spec.dtype = dtype;
  spec.rms_provided = with_rms;
  spec.variant.gamma_offset = gamma_offset;
  auto run = [&](size_t shift, std::vector<uint8_t>& dx, std::vector<uint8_t>& dgamma) {
    std::vector<uint8_t> xs(n + 2), dys(n + 2);
    std::memcpy(xs.data() + shift, xb.data(), n);
    std::memcpy(dys.data() + shift, dyb.data(), n);
    dx.assign(n + 2, 0);
    std::unique_ptr<Backend> cpu = Cpu(2);
    auto session = cpu->StartBackward(spec, absl::MakeConstSpan(gb));
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE((*session)
                    ->ProcessChunk(absl::MakeConstSpan(xs).subspan(shift, n),
                                   absl::MakeConstSpan(dys).subspan(shift, n), b.rms, rows,
                                   absl::MakeSpan(dx).subspan(shift, n))
                    .ok());
    dgamma.assign(hidden * 2, 0);
    const absl::Status finished = (*session)->Finish(absl::MakeSpan(dgamma));
    ASSERT_TRUE(finished.ok()) << finished;
    dx.erase(dx.begin(), dx.begin() + shift);
    dx.resize(n);
  };
  std::vector<uint8_t> dx_direct, dx_staged;
  std::vector<uint8_t> dgamma_direct, dgamma_staged;
  run(0, dx_direct, dgamma_direct);
  run(1, dx_staged, dgamma_staged);
  int differ = 0;
  for (size_t i = 0; i < n; i += 2) differ += std::memcmp(&dx_direct[i], &dx_staged[i], 2) != 0;
  EXPECT_EQ(differ, 0) << "of " << n / 2 << " dx elements";
  EXPECT_EQ(dgamma_direct, dgamma_staged);
}

// On every SIMD target this CPU runs (AVX2 on an AVX-512 machine too: other vector widths).
TEST(CpuBackendTest, Bf16AndF16MisalignedBuffersGiveTheBitsOfAlignedOnes) {
  const std::vector<std::string> targets = host_rows::SupportedSimdTargets();
  ASSERT_FALSE(targets.empty());
  for (const std::string& target : targets) {
    SCOPED_TRACE(target);
    ASSERT_TRUE(host_rows::LimitSimdTarget(target));
    ASSERT_EQ(host_rows::SimdTargetName(), target);
    for (kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kF16}) {
      for (uint32_t hidden : {1u, 7u, 37u, 896u, 1000u, 2049u, 4101u}) {
        ExpectDirectSameAsStaged(dtype, 41, hidden, /*with_rms=*/false, 0.0f);
        ExpectDirectSameAsStaged(dtype, 41, hidden, /*with_rms=*/true, 1.0f);
      }
    }
  }
  ASSERT_TRUE(host_rows::LimitSimdTarget(""));
  EXPECT_EQ(host_rows::SimdTargetName(), targets.front());
}

// host_rows runs rows four or two at a time (pass 2 of a group shares the gamma and grad_gamma
// loads). A row's dx and the grad_gamma partial must not depend on the grouping, nor on whether
// gamma comes promoted: 7 rows in one block (4 + 2 + 1, or 2 + 2 + 2 + 1 for rows wider than
// host_rows::FourRowsMaxElements()) against 7 blocks of one row, with and without streaming
// stores, dx off the vector alignment (heads).
void ExpectGroupingKeepsBits(uint32_t hidden, bool stream, bool with_rms) {
  SCOPED_TRACE(::testing::Message()
               << "hidden " << hidden << " stream " << stream << " rms " << with_rms);
  constexpr uint64_t kRows = 7;
  const Batch b = MakeBatch(kRows, hidden, with_rms);
  const std::vector<double> gamma_f64(b.gamma.begin(), b.gamma.end());
  auto run = [&](bool one_by_one, bool promoted, std::vector<float>& dx_buffer,
                 std::vector<double>& dgamma) {
    dx_buffer.assign(b.x.size() + 3, 0.0f);
    float* dx = dx_buffer.data() + 3;  // 12 bytes past the allocation's alignment
    dgamma.assign(hidden, 0.0);
    host_rows::RowBlock block;
    block.gamma = b.gamma.data();
    block.gamma_f64 = promoted ? gamma_f64.data() : nullptr;
    block.dgamma = dgamma.data();
    block.hidden_dim = hidden;
    block.eps = b.eps;
    block.stream_dx = stream;
    const uint64_t step = one_by_one ? 1 : kRows;
    for (uint64_t first = 0; first < kRows; first += step) {
      block.x = b.x.data() + first * hidden;
      block.dy = b.dy.data() + first * hidden;
      block.rms = with_rms ? b.rms.data() + first : nullptr;
      block.dx = dx + first * hidden;
      block.num_rows = step;
      host_rows::BackwardRows(block);
    }
  };
  std::vector<float> dx_grouped, dx_single;
  std::vector<double> dgamma_grouped, dgamma_single;
  run(/*one_by_one=*/false, /*promoted=*/true, dx_grouped, dgamma_grouped);
  run(/*one_by_one=*/true, /*promoted=*/false, dx_single, dgamma_single);
  EXPECT_EQ(0, std::memcmp(dx_grouped.data(), dx_single.data(), dx_grouped.size() * 4));
  EXPECT_EQ(0, std::memcmp(dgamma_grouped.data(), dgamma_single.data(), hidden * 8));
}

TEST(CpuBackendTest, RowGroupingDoesNotChangeBits) {
  for (uint32_t hidden : {1u, 33u, 896u, 1000u, 1024u, 2048u, 2049u, 2056u, 4096u}) {
    for (bool stream : {false, true}) {
      ExpectGroupingKeepsBits(hidden, stream, /*with_rms=*/false);
      ExpectGroupingKeepsBits(hidden, stream, /*with_rms=*/true);
    }
  }
}

// Four wide rows at a time only where four rows' x, dy and dx fit the ways of one L1 set; fewer or
// unknown ways (0) keep the earlier limit.
TEST(CpuBackendTest, FourWideRowsAtATimeOnlyWithTwelveL1Ways) {
  EXPECT_EQ(host_rows::FourRowsMaxElementsWithL1Ways(0), 2048u);
  EXPECT_EQ(host_rows::FourRowsMaxElementsWithL1Ways(8), 2048u);
  EXPECT_EQ(host_rows::FourRowsMaxElementsWithL1Ways(11), 2048u);
  EXPECT_EQ(host_rows::FourRowsMaxElementsWithL1Ways(12), SIZE_MAX);
  EXPECT_EQ(host_rows::FourRowsMaxElementsWithL1Ways(16), SIZE_MAX);
  EXPECT_GE(host_rows::L1DataCacheWays(), 0);
}

// Rows alias when two rows of a group start within 128 bytes of each other modulo 4 KiB: f32
// rows of 1024 (4 KiB), 1000 (96 bytes short of it), 1536 (rows k and k + 2 one page apart), not
// 896 (rows 512 bytes apart modulo 4 KiB) or 992 (128 bytes: not within).
TEST(CpuBackendTest, GroupRowsAliasModulo4KiB) {
  EXPECT_TRUE(host_rows::GroupRowsAlias(1024 * 4, 4));
  EXPECT_TRUE(host_rows::GroupRowsAlias(1024 * 4, 2));
  EXPECT_TRUE(host_rows::GroupRowsAlias(65536 * 4, 2));
  EXPECT_TRUE(host_rows::GroupRowsAlias(1000 * 4, 2));
  EXPECT_TRUE(host_rows::GroupRowsAlias(1016 * 4, 4));
  EXPECT_TRUE(host_rows::GroupRowsAlias(1536 * 4, 4));   // rows 0 and 2: 12 KiB apart
  EXPECT_FALSE(host_rows::GroupRowsAlias(1536 * 4, 2));  // rows 0 and 1: 2 KiB apart
  EXPECT_TRUE(host_rows::GroupRowsAlias(2048 * 2, 4));   // bf16 rows of 2048
  EXPECT_FALSE(host_rows::GroupRowsAlias(1024 * 2, 2));  // bf16 rows of 1024, two at a time
  EXPECT_FALSE(host_rows::GroupRowsAlias(896 * 4, 4));
  EXPECT_FALSE(host_rows::GroupRowsAlias(992 * 4, 4));
  EXPECT_FALSE(host_rows::GroupRowsAlias(1280 * 4, 4));
  EXPECT_FALSE(host_rows::GroupRowsAlias(64 * 4, 4));
  EXPECT_FALSE(host_rows::GroupRowsAlias(1024 * 4, 1));  // one row aliases nothing
}

// Aliasing rows stream dx and go four at a time only where the L1 has 12 or more ways; fewer or
// unknown ways (0) take ordinary stores and two rows.
TEST(CpuBackendTest, AliasedRowsStreamOnlyWithTwelveL1Ways) {
  EXPECT_FALSE(host_rows::ToleratesAliasedRowsFor(0));
  EXPECT_FALSE(host_rows::ToleratesAliasedRowsFor(8));
  EXPECT_FALSE(host_rows::ToleratesAliasedRowsFor(11));
  EXPECT_TRUE(host_rows::ToleratesAliasedRowsFor(12));
  EXPECT_TRUE(host_rows::ToleratesAliasedRowsFor(16));
}

TEST(CpuBackendTest, DeviceNamesThreadsAndSimdTarget) {
  const DeviceDescription d = Cpu(3)->Device();
  EXPECT_EQ(d.name.rfind("cpu: 3 threads, ", 0), 0u) << d.name;
  EXPECT_EQ(d.sm_count, 3u);
  EXPECT_GT(d.total_memory_bytes, 0u);
  EXPECT_TRUE(d.driver_version.empty());
}

}  // namespace
}  // namespace normgrad::server::testing
