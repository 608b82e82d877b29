// StagingPool: an idle slot that fits is lent again (the smallest such), the pool's pinned and
// device bytes stay within its bound (idle slots freed to make room), a slot larger than the bound
// is lent alone and freed when it comes back, and a dropped slot's memory is freed.
#include "server/cuda/staging_pool.h"

#include <memory>

#include "gtest/gtest.h"
#include "tests/server/cuda/test_device.h"

namespace normgrad::server::cuda_internal {
namespace {

size_t HeldDeviceBytes() { return ScriptedCounter<size_t>("device_bytes"); }
size_t HeldPinnedBytes() { return ScriptedCounter<size_t>("host_bytes"); }

TEST(StagingPool, LendsTheSmallestIdleSlotThatFits) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  StagingPool pool(ctx, 1 << 20);
  absl::StatusOr<std::unique_ptr<StagingSlot>> small = pool.Acquire(1000, 2000);
  absl::StatusOr<std::unique_ptr<StagingSlot>> large = pool.Acquire(10000, 20000);
  ASSERT_TRUE(small.ok() && large.ok());
  StagingSlot* const small_slot = small->get();
  EXPECT_GE((*small)->host_bytes, 1000u);
  EXPECT_NE((*small)->streams[0], nullptr);
  EXPECT_NE((*small)->semaphores[1], 0u);
  pool.Return(*std::move(large));
  pool.Return(*std::move(small));
  absl::StatusOr<std::unique_ptr<StagingSlot>> again = pool.Acquire(500, 500);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), small_slot);
  pool.Return(*std::move(again));
}

TEST(StagingPool, StaysWithinItsBoundAndFreesASlotAboveItWhenItComesBack) {
  std::shared_ptr<const DeviceContext> ctx = ScriptedDevice();
  ASSERT_NE(ctx, nullptr);
  const size_t device_before = HeldDeviceBytes();
  const size_t pinned_before = HeldPinnedBytes();
  {
    StagingPool pool(ctx, 100000);
    absl::StatusOr<std::unique_ptr<StagingSlot>> a = pool.Acquire(60000, 60000);
    ASSERT_TRUE(a.ok());
    pool.Return(*std::move(a));
    // A second slot of 60000 would pass the bound: the idle one is freed first.
    absl::StatusOr<std::unique_ptr<StagingSlot>> b = pool.Acquire(70000, 70000);
    ASSERT_TRUE(b.ok());
    EXPECT_LE(HeldPinnedBytes() - pinned_before, 100000u);
    // Alone above the bound: lent, and freed when it comes back.
    absl::StatusOr<std::unique_ptr<StagingSlot>> huge = [&] {
      pool.Return(*std::move(b));
      return pool.Acquire(500000, 500000);
    }();
    ASSERT_TRUE(huge.ok());
    EXPECT_GE(HeldPinnedBytes() - pinned_before, 500000u);
    pool.Return(*std::move(huge));
    EXPECT_EQ(HeldPinnedBytes(), pinned_before);
    // A dropped slot (after a failed chunk) is freed, not kept.
    absl::StatusOr<std::unique_ptr<StagingSlot>> dropped = pool.Acquire(1000, 1000);
    ASSERT_TRUE(dropped.ok());
    pool.Drop(*std::move(dropped));
    EXPECT_EQ(HeldPinnedBytes(), pinned_before);
  }
  EXPECT_EQ(HeldDeviceBytes(), device_before);
}

}  // namespace
}  // namespace normgrad::server::cuda_internal
