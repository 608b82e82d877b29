// Backward chunks in a shared-memory region on the backend under test (on the CUDA backend over the
// emulated driver too: sim.cuda.shared_memory_service_test).
#include "tests/server/service/service_suite.h"

namespace normgrad::server::service_test {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

class ServiceSharedMemoryTest : public testing::InProcessServerTest {};

// Shared-memory chunks on the backend under test (sim.cuda.shared_memory_service_test runs this on
// the CUDA backend over the emulated driver): the region is computed in place, and on CUDA the
// backend registered the region with the driver and copied straight from and to it (the
// emulator counts async copies whose host side is registered memory).
TEST_F(ServiceSharedMemoryTest, ChunksInARegionAreComputedInPlaceStraightFromTheRegion) {
  const std::string dir = absl::StrCat("/tmp/normgrad-svc-shm-", getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  ServerOptions options = testing::TestServerOptions();
  options.listen.push_back("unix:" + dir + "/grpc.sock");
  options.shared_memory = true;
  ASSERT_TRUE(Start(options));
  const testing::Batch b = testing::RandomBatch(96, 256, 9);
  const uint64_t n = b.rows * b.hidden, bytes = n * 4;
  const int fd = memfd_create("test-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(3 * bytes)), 0);
  // The server refuses a region whose pages are not all allocated (it would be charged for them).
  ASSERT_EQ(posix_fallocate(fd, 0, static_cast<off_t>(3 * bytes)), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  auto* base = static_cast<uint8_t*>(mmap(nullptr, 3 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(base, MAP_FAILED);
  std::memcpy(base, b.x.data(), bytes);
  std::memcpy(base + bytes, b.dy.data(), bytes);
  absl::StatusOr<RegionGrant> grant = server_->regions()->Register(OwnedFd(fd), {.connection = 1});
  ASSERT_TRUE(grant.ok()) << grant.status();

  using CopyCount = uint64_t (*)();
  CopyCount registered_copies = nullptr;
  if (testing::TestBackendIsCuda()) {
    const char* driver = std::getenv("NORMGRAD_CUDA_DRIVER");
    void* lib = driver != nullptr ? dlopen(driver, RTLD_NOW | RTLD_NOLOAD) : nullptr;
    if (lib != nullptr) {
      registered_copies =
          reinterpret_cast<CopyCount>(dlsym(lib, "normgrad_emulated_registered_copies"));
    }
  }
  const uint64_t copies_before = registered_copies != nullptr ? registered_copies() : 0;

  std::vector<v1::BackwardRequest> messages = {testing::HeaderFor(b)};
  const uint64_t rows_per_chunk = 40;  // 40, 40, 16
  for (uint64_t first = 0; first < b.rows; first += rows_per_chunk) {
    const uint64_t rows = std::min(rows_per_chunk, b.rows - first);
    v1::BackwardRequest m;
    v1::SharedMemoryChunk* shm = m.mutable_shm();
    shm->set_region_id(grant->id);
    shm->set_region_key(grant->key.data(), grant->key.size());
    shm->set_num_rows(rows);
    shm->set_x_offset(first * b.hidden * 4);
    shm->set_dy_offset(bytes + first * b.hidden * 4);
    shm->set_grad_input_offset(2 * bytes + first * b.hidden * 4);
    messages.push_back(std::move(m));
  }
  int responses = 0;
  const grpc::Status status = testing::SendMessages(*stub_, messages, &responses);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(responses, 4);
  std::vector<float> want_dx, want_dgamma, dx(n);
  testing::ReferenceFor(b, want_dx, want_dgamma);
  std::memcpy(dx.data(), base + 2 * bytes, bytes);
  EXPECT_LT(testing::MaxScaledError(dx, want_dx), 1e-4);
  if (registered_copies != nullptr) {
    // x, dy in and dx out for each of the 3 chunks, none through the pinned staging buffers.
    EXPECT_EQ(registered_copies() - copies_before, 9u);
  } else {
    EXPECT_FALSE(testing::TestBackendIsCuda()) << "the emulated driver's copy counter is missing";
  }
  server_->Shutdown(absl::ZeroDuration());
  server_.reset();
  munmap(base, 3 * bytes);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace normgrad::server::service_test
