// Where a chunk's rows are, checked alone: the refusals of shared-memory and device-memory
// chunks (no regions, a remote client, another GPU, bad handles, ranges outside the region,
// grad_input over an input other than exactly dy) name the field and the numbers; good ranges
// give the offsets, and grad_input exactly over dy is taken (in place).
#include "server/service/remote_rows.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

// 16 rows of 64 f32 values (256 bytes a row), rms provided.
const RowLayout kLayout{.row_bytes = 256, .element_bytes = 4, .rms_provided = true};
const ValidatedChunk kChunk{.index = 3, .first_row = 32, .num_rows = 16};
constexpr uint64_t kRowsBytes = 16 * 256;

class RegionRowsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int fd = memfd_create("chunk-rows-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(posix_fallocate(fd, 0, kRegionBytes), 0);
    ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    absl::StatusOr<RegionGrant> g = registry_.Register(OwnedFd(fd), {.connection = 1});
    ASSERT_TRUE(g.ok()) << g.status();
    grant_ = *g;
  }
  // x, dy, rms and grad_input one after the other.
  v1::SharedMemoryChunk Shm() const {
    v1::SharedMemoryChunk shm;
    shm.set_region_id(grant_.id);
    shm.set_region_key(std::string(grant_.key.begin(), grant_.key.end()));
    shm.set_num_rows(kChunk.num_rows);
    shm.set_x_offset(0);
    shm.set_dy_offset(kRowsBytes);
    shm.set_rms_offset(2 * kRowsBytes);
    shm.set_grad_input_offset(2 * kRowsBytes + 64);
    return shm;
  }

  static constexpr off_t kRegionBytes = 4 * kRowsBytes;
  RegionRegistry registry_{RegionLimits{}};
  RegionGrant grant_;
};

TEST_F(RegionRowsTest, GoodOffsetsGiveTheRegionAndWhereEachTensorIs) {
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, Shm(), kChunk, kLayout);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->region->size(), uint64_t{kRegionBytes});
  EXPECT_EQ(rows->dy, kRowsBytes);
  EXPECT_EQ(rows->rms, 2 * kRowsBytes);
  EXPECT_EQ(rows->grad_input, 2 * kRowsBytes + 64);
}

TEST_F(RegionRowsTest, NoRegionsOrARemoteClientIsFailedPrecondition) {
  absl::StatusOr<RegionRows> none = FindRegionRows(nullptr, true, Shm(), kChunk, kLayout);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("chunk 3: carries shm but this server takes no"));
  absl::StatusOr<RegionRows> remote = FindRegionRows(&registry_, false, Shm(), kChunk, kLayout);
  EXPECT_EQ(remote.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(remote.status().message(), HasSubstr("the client is not on this machine"));
}

TEST_F(RegionRowsTest, AWrongKeyIsNotFoundNamingTheChunk) {
  v1::SharedMemoryChunk shm = Shm();
  shm.set_region_key(std::string(16, 'k'));
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, shm, kChunk, kLayout);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(rows.status().message(), HasSubstr("chunk 3: "));
}

TEST_F(RegionRowsTest, ARangePastTheRegionOrMisalignedIsInvalidArgumentNamingTheField) {
  v1::SharedMemoryChunk past = Shm();
  past.set_x_offset(3 * kRowsBytes + 4);
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, past, kChunk, kLayout);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rows.status().message(), HasSubstr("chunk 3: shm.x_offset"));
  v1::SharedMemoryChunk misaligned = Shm();
  misaligned.set_dy_offset(kRowsBytes + 2);
  rows = FindRegionRows(&registry_, true, misaligned, kChunk, kLayout);
  EXPECT_THAT(rows.status().message(), HasSubstr("shm.dy_offset"));
}

TEST_F(RegionRowsTest, GradInputOverAnInputIsInvalidArgumentNamingBoth) {
  v1::SharedMemoryChunk shm = Shm();
  shm.set_grad_input_offset(kRowsBytes / 2);  // half over x, half over dy
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, shm, kChunk, kLayout);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rows.status().message(),
              HasSubstr("shm.grad_input_offset = 2048 (4096 bytes) overlaps shm.x_offset = 0"));
}

// As a bytes chunk that carries rms without header.rms_provided.
TEST_F(RegionRowsTest, AnRmsOffsetWithoutRmsProvidedIsInvalidArgument) {
  RowLayout no_rms = kLayout;
  no_rms.rms_provided = false;
  v1::SharedMemoryChunk shm = Shm();
  ASSERT_NE(shm.rms_offset(), 0u);
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, shm, kChunk, no_rms);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rows.status().message(),
              HasSubstr(absl::StrCat("shm.rms_offset = ", shm.rms_offset(),
                                     " but header.rms_provided is false")));
  shm.set_rms_offset(0);  // unset: the chunk is fine
  EXPECT_TRUE(FindRegionRows(&registry_, true, shm, kChunk, no_rms).ok());
}

TEST_F(RegionRowsTest, GradInputExactlyOverDyIsTakenAsInPlace) {
  v1::SharedMemoryChunk shm = Shm();
  shm.set_grad_input_offset(shm.dy_offset());
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, shm, kChunk, kLayout);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->grad_input, rows->dy);
}

TEST_F(RegionRowsTest, GradInputPartlyOverDyOrOverDyAndXIsInvalidArgumentNamingBoth) {
  v1::SharedMemoryChunk shm = Shm();
  shm.set_grad_input_offset(kRowsBytes + 256);  // one row past dy's start
  absl::StatusOr<RegionRows> rows = FindRegionRows(&registry_, true, shm, kChunk, kLayout);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      rows.status().message(),
      HasSubstr("shm.grad_input_offset = 4352 (4096 bytes) overlaps shm.dy_offset = 4096 "
                "(4096 bytes); grad_input may overlap an input only as exactly dy's range"));
  shm.set_x_offset(kRowsBytes);  // x, dy and grad_input all one range: x is overwritten
  shm.set_grad_input_offset(kRowsBytes);
  rows = FindRegionRows(&registry_, true, shm, kChunk, kLayout);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rows.status().message(),
              HasSubstr("shm.grad_input_offset = 4096 (4096 bytes) overlaps shm.x_offset = 4096"));
}

const std::string kServerUuid(16, '\x11');

v1::CudaIpcChunk Ipc() {
  v1::CudaIpcChunk ipc;
  ipc.set_device_uuid(kServerUuid);
  ipc.mutable_x()->set_handle(std::string(kCudaIpcHandleBytes, 'a'));
  ipc.mutable_dy()->set_handle(std::string(kCudaIpcHandleBytes, 'b'));
  ipc.mutable_rms()->set_handle(std::string(kCudaIpcHandleBytes, 'c'));
  ipc.mutable_grad_input()->set_handle(std::string(kCudaIpcHandleBytes, 'd'));
  return ipc;
}

TEST(DeviceChunkTest, ChunksOnTheServersGpuWithWellFormedHandlesPass) {
  EXPECT_TRUE(CheckDeviceChunk(kServerUuid, true, Ipc(), kChunk, kLayout).ok());
}

TEST(DeviceChunkTest, NoCudaIpcARemoteClientOrAnotherGpuIsFailedPrecondition) {
  absl::Status none = CheckDeviceChunk("", true, Ipc(), kChunk, kLayout);
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.message(), HasSubstr("this server takes no CUDA IPC"));
  EXPECT_THAT(CheckDeviceChunk(kServerUuid, false, Ipc(), kChunk, kLayout).message(),
              HasSubstr("the client is not on this machine"));
  v1::CudaIpcChunk other = Ipc();
  other.set_device_uuid(std::string(16, '\x22'));
  absl::Status gpu = CheckDeviceChunk(kServerUuid, true, other, kChunk, kLayout);
  EXPECT_EQ(gpu.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(gpu.message(), HasSubstr("cuda_ipc.device_uuid = 22222222222222222222222222222222 "
                                       "is not this server's GPU (11111111111111111111111111111111)"));
}

TEST(DeviceChunkTest, AShortHandleOrAnUndeclaredRmsIsInvalidArgument) {
  v1::CudaIpcChunk short_handle = Ipc();
  short_handle.mutable_dy()->set_handle("abc");
  EXPECT_THAT(CheckDeviceChunk(kServerUuid, true, short_handle, kChunk, kLayout).message(),
              HasSubstr("chunk 3: cuda_ipc.dy.handle has 3 bytes, not 64"));
  RowLayout no_rms = kLayout;
  no_rms.rms_provided = false;
  EXPECT_THAT(CheckDeviceChunk(kServerUuid, true, Ipc(), kChunk, no_rms).message(),
              HasSubstr("cuda_ipc.rms is set but header.rms_provided is false"));
}

TEST(DeviceChunkTest, GradInputOverAnInputOfTheSameHandleIsInvalidArgument) {
  v1::CudaIpcChunk ipc = Ipc();
  ipc.mutable_grad_input()->set_handle(ipc.x().handle());
  ipc.mutable_grad_input()->set_offset(kRowsBytes - 256);
  absl::Status s = CheckDeviceChunk(kServerUuid, true, ipc, kChunk, kLayout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cuda_ipc.grad_input.offset = 3840 (4096 bytes) overlaps "
                                     "cuda_ipc.x.offset = 0 (4096 bytes) in the same allocation"));
  ipc.mutable_grad_input()->set_offset(kRowsBytes);  // right after x: apart
  EXPECT_TRUE(CheckDeviceChunk(kServerUuid, true, ipc, kChunk, kLayout).ok());
}

TEST(DeviceChunkTest, GradInputExactlyOverDyOfTheSameHandleIsTakenPartlyIsNot) {
  v1::CudaIpcChunk ipc = Ipc();
  ipc.mutable_dy()->set_offset(512);
  *ipc.mutable_grad_input() = ipc.dy();
  EXPECT_TRUE(CheckDeviceChunk(kServerUuid, true, ipc, kChunk, kLayout).ok());
  ipc.mutable_grad_input()->set_offset(512 + 256);
  absl::Status s = CheckDeviceChunk(kServerUuid, true, ipc, kChunk, kLayout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cuda_ipc.grad_input.offset = 768 (4096 bytes) overlaps "
                                     "cuda_ipc.dy.offset = 512 (4096 bytes) in the same "
                                     "allocation; grad_input may overlap an input only as "
                                     "exactly dy's range (in place)"));
}

}  // namespace
}  // namespace normgrad::server
