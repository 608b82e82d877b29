// The thread pool shared by the CPU backend and the service: ParallelFor from concurrent callers,
// Schedule from many producers, and the destructor draining tasks that schedule more. These run
// in the `tsan` stage (docs/testing.md): every handoff goes through the pool's own locks, so any
// report is ours. Each test also checks the counts that a lost or repeated task would break.
#include "server/thread_pool/thread_pool.h"

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

constexpr int kThreads = 6;

TEST(ThreadPoolTest, RunsEveryIndexOnceAcrossConcurrentCallers) {
  ThreadPool pool(2);  // with each caller, 3 threads per call
  constexpr size_t kN = 1000;
  std::vector<std::atomic<int>> a(kN), b(kN);
  std::thread other([&] { pool.ParallelFor(kN, [&](size_t i) { b[i].fetch_add(1); }); });
  pool.ParallelFor(kN, [&](size_t i) { a[i].fetch_add(1); });
  other.join();
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(a[i].load(), 1) << i;
    ASSERT_EQ(b[i].load(), 1) << i;
  }
}

TEST(ThreadPoolTest, ParallelForWithoutWorkersRunsOnTheCaller) {
  ThreadPool pool(0);
  EXPECT_EQ(pool.size(), 0u);
  const std::thread::id caller = std::this_thread::get_id();
  int ran = 0;
  pool.ParallelFor(10, [&](size_t) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    ++ran;
  });
  EXPECT_EQ(ran, 10);
}

TEST(ThreadPoolTest, TasksFromManyProducersRunOnceEachBeforeTheDestructorReturns) {
  constexpr int kPerProducer = 1500;
  std::vector<int> runs(kThreads * kPerProducer, 0);  // each slot written by its own task only
  std::mutex seen_mu;
  std::vector<std::thread::id> seen;  // threads that ran tasks
  {
    ThreadPool pool(3);
    std::vector<std::thread> producers;
    for (int p = 0; p < kThreads; ++p) {
      producers.emplace_back([&, p] {
        for (int i = 0; i < kPerProducer; ++i) {
          const int slot = p * kPerProducer + i;
          pool.Schedule([&runs, &seen_mu, &seen, slot] {
            ++runs[slot];
            if (slot % 500 == 0) {
              std::lock_guard<std::mutex> lock(seen_mu);
              seen.push_back(std::this_thread::get_id());
            }
          });
        }
      });
    }
    for (std::thread& t : producers) t.join();
  }  // the destructor runs what is queued, then joins
  for (size_t slot = 0; slot < runs.size(); ++slot) ASSERT_EQ(runs[slot], 1) << "task " << slot;
  EXPECT_EQ(seen.size(), runs.size() / 500);
}

TEST(ThreadPoolTest, TasksThatScheduleFollowUpsAllRunWhileThePoolDrains) {
  std::atomic<int> ran{0};
  constexpr int kChains = 8, kLength = 200;
  std::function<void(int)> step;  // outlives the pool, whose destructor still runs steps
  {
    ThreadPool pool(2);
    step = [&](int left) {
      ran.fetch_add(1);
      if (left > 1) pool.Schedule([&step, left] { step(left - 1); });
    };
    for (int c = 0; c < kChains; ++c) pool.Schedule([&step] { step(kLength); });
    // Destroyed at once: the chains are still growing while the pool drains.
  }
  EXPECT_EQ(ran.load(), kChains * kLength);
}

}  // namespace
}  // namespace normgrad::server
