// BackwardJobRunner alone, on the CPU backend: a chunk's gradients are the reference's wherever
// its rows are (in the message, in a region), each chunk is counted once, the finish reports the
// stream's totals, and device-memory chunks fail as the backend says, naming the field.
#include "server/service/backward_job.h"

#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cpu/cpu_backend.h"
#include "tests/server/service/batch_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

class BackwardJobTest : public ::testing::Test {
 protected:
  BackwardJobTest()
      : backend_(NewCpuBackend({.threads = 1})),
        runner_(*backend_, [this] { ++chunks_counted_; }),
        batch_(testing::RandomBatch(8, 32, 3)) {
    spec_.num_rows = batch_.rows;
    spec_.hidden_dim = batch_.hidden;
    spec_.eps = batch_.eps;
    testing::ReferenceFor(batch_, want_dx_, want_dgamma_);
  }

  void StartSession() {
    BackwardJob start;
    start.kind = BackwardJob::kStart;
    start.request = std::make_unique<v1::BackwardRequest>(testing::HeaderFor(batch_));
    absl::StatusOr<std::unique_ptr<Outgoing>> out = runner_.Run(start, spec_);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, nullptr) << "a session start writes nothing";
  }

  BackwardJob Chunk(uint64_t first_row, uint64_t rows) {
    BackwardJob job;
    job.kind = BackwardJob::kChunk;
    job.request =
        std::make_unique<v1::BackwardRequest>(testing::ChunkFor(batch_, first_row, rows));
    job.chunk = {.index = first_row / rows, .first_row = first_row, .num_rows = rows};
    job.reserved = 123;
    return job;
  }

  std::vector<float> Floats(const std::string& bytes) {
    std::vector<float> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }

  std::unique_ptr<Backend> backend_;
  int chunks_counted_ = 0;
  BackwardJobRunner runner_;
  testing::Batch batch_;
  kernels::BackwardRequest spec_;
  std::vector<float> want_dx_, want_dgamma_;
};

TEST_F(BackwardJobTest, ChunksInMessagesThenTheFinishGiveTheReferenceAndTheTotals) {
  StartSession();
  std::vector<float> dx;
  for (uint64_t first = 0; first < 8; first += 4) {
    BackwardJob job = Chunk(first, 4);
    absl::StatusOr<std::unique_ptr<Outgoing>> out = runner_.Run(job, spec_);
    ASSERT_TRUE(out.ok()) << out.status();
    const Outgoing& o = **out;
    EXPECT_TRUE(o.is_chunk);
    EXPECT_EQ(o.rows, 4u);
    EXPECT_EQ(o.reserved, 123u);
    EXPECT_EQ(o.response.first_row(), first);
    EXPECT_EQ(o.payload_bytes, 4u * 32 * 4);
    const std::vector<float> part = Floats(o.ToProto().grad_input());
    dx.insert(dx.end(), part.begin(), part.end());
  }
  EXPECT_EQ(chunks_counted_, 2);
  EXPECT_LT(testing::MaxScaledError(dx, want_dx_), 1e-5);

  BackwardJob finish;
  finish.kind = BackwardJob::kFinish;
  finish.rows = 8;
  finish.chunks = 2;
  finish.header_time = absl::Now();
  absl::StatusOr<std::unique_ptr<Outgoing>> out = runner_.Run(finish, spec_);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE((*out)->is_final);
  EXPECT_LT(testing::MaxScaledError(Floats((*out)->response.grad_gamma()), want_dgamma_), 1e-5);
  const v1::BackwardSummary& summary = (*out)->response.summary();
  EXPECT_EQ(summary.backend(), "cpu");
  EXPECT_EQ(summary.rows(), 8u);
  EXPECT_EQ(summary.chunks(), 2u);
  EXPECT_EQ(chunks_counted_, 2) << "the finish is not a chunk";
}

TEST_F(BackwardJobTest, AChunkInARegionIsReadAndWrittenThereAndSendsNoBytes) {
  StartSession();
  const uint64_t bytes = batch_.x.size() * 4;
  void* base = mmap(nullptr, 3 * bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(base, MAP_FAILED);
  auto region = std::make_shared<const MappedRegion>(static_cast<uint8_t*>(base), 3 * bytes);
  std::memcpy(region->data(), batch_.x.data(), bytes);
  std::memcpy(region->data() + bytes, batch_.dy.data(), bytes);
  BackwardJob job = Chunk(0, 8);
  job.request->clear_x();
  job.request->clear_dy();
  job.request->mutable_shm()->set_region_id(1);
  job.in_region = RegionRows{.region = region, .x = 0, .dy = bytes, .rms = 0,
                             .grad_input = 2 * bytes};
  absl::StatusOr<std::unique_ptr<Outgoing>> out = runner_.Run(job, spec_);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)->payload_bytes, 0u);
  EXPECT_EQ((*out)->grad_input_bytes, 0u);
  EXPECT_TRUE((*out)->ToProto().grad_input().empty());
  std::vector<float> dx(batch_.x.size());
  std::memcpy(dx.data(), region->data() + 2 * bytes, bytes);
  EXPECT_LT(testing::MaxScaledError(dx, want_dx_), 1e-5);
  EXPECT_EQ(chunks_counted_, 1);
}

TEST_F(BackwardJobTest, ADeviceChunkOnABackendWithoutIpcFailsNamingTheBuffer) {
  StartSession();
  BackwardJob job = Chunk(0, 8);
  job.request->clear_x();
  job.request->clear_dy();
  job.request->mutable_cuda_ipc()->mutable_x()->set_handle(std::string(kCudaIpcHandleBytes, 'a'));
  absl::StatusOr<std::unique_ptr<Outgoing>> out = runner_.Run(job, spec_);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(out.status().message(), HasSubstr("chunk 0: cuda_ipc.x.handle: "));
  EXPECT_EQ(chunks_counted_, 0);
}

}  // namespace
}  // namespace normgrad::server
