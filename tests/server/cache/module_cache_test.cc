#include "server/cache/module_cache.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using Cache = ModuleCache<std::string>;

// Holds compile functions open until released (at most 10 s). std primitives, so that
// ThreadSanitizer follows them.
class Gate {
 public:
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Waits (at most 5 s) until `cache` has counted `n` misses.
void WaitForMisses(const Cache& cache, uint64_t n) {
  for (int spin = 0; spin < 1000 && cache.Stats().misses < n; ++spin) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// What `n` threads got when they all asked for key "k" at once. The one compile, which returns
// `compiled` (as a value of 8 bytes, or the error), is held open until every thread has asked
// (bounded wait), so that the others really are concurrent first requests, not later hits.
struct ConcurrentFirstRequests {
  int compiles = 0;
  std::vector<std::string> results;  // per thread: the value, or the status as text
};
ConcurrentFirstRequests AskAtOnce(Cache& cache, int n,
                                  const absl::StatusOr<std::string>& compiled) {
  std::atomic<int> compiles{0};
  Gate release;
  auto compile = [&]() -> absl::StatusOr<Cache::Compiled> {
    compiles.fetch_add(1);
    release.Wait();
    if (!compiled.ok()) return compiled.status();
    return Cache::Compiled{std::make_shared<const std::string>(*compiled), 8};
  };
  ConcurrentFirstRequests out;
  out.results.resize(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      absl::StatusOr<std::shared_ptr<const std::string>> v = cache.GetOrCompile("k", compile);
      out.results[i] = v.ok() ? **v : v.status().ToString();
    });
  }
  WaitForMisses(cache, n);
  release.Open();
  for (std::thread& t : threads) t.join();
  out.compiles = compiles.load();
  return out;
}

Cache::CompileFn Returns(std::string value, uint64_t bytes, int* calls = nullptr) {
  return [value, bytes, calls]() -> absl::StatusOr<Cache::Compiled> {
    if (calls != nullptr) ++*calls;
    return Cache::Compiled{std::make_shared<const std::string>(value), bytes};
  };
}

std::string Get(Cache& cache, const std::string& key, uint64_t bytes = 1, int* calls = nullptr) {
  absl::StatusOr<std::shared_ptr<const std::string>> v =
      cache.GetOrCompile(key, Returns("value of " + key, bytes, calls));
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? **v : "";
}

TEST(ModuleCacheTest, SecondRequestIsAHitWithoutCompiling) {
  Cache cache({.max_entries = 4, .max_bytes = 1000});
  int calls = 0;
  EXPECT_EQ(Get(cache, "a", 10, &calls), "value of a");
  EXPECT_EQ(Get(cache, "a", 10, &calls), "value of a");
  EXPECT_EQ(calls, 1);
  ModuleCacheStats s = cache.Stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 10u);
  EXPECT_EQ(s.max_entries, 4u);
  EXPECT_EQ(s.max_bytes, 1000u);
  EXPECT_GE(s.compile_seconds, 0.0);
}

TEST(ModuleCacheTest, EntryBoundEvictsLeastRecentlyUsed) {
  Cache cache({.max_entries = 2, .max_bytes = 1000});
  Get(cache, "a");
  Get(cache, "b");
  Get(cache, "a");  // a is now more recent than b
  Get(cache, "c");  // evicts b
  EXPECT_NE(cache.Find("a"), nullptr);
  EXPECT_EQ(cache.Find("b"), nullptr);
  EXPECT_NE(cache.Find("c"), nullptr);
  EXPECT_EQ(cache.Stats().evictions, 1u);
  EXPECT_EQ(cache.Stats().entries, 2u);
}

TEST(ModuleCacheTest, FindRefreshesRecency) {
  Cache cache({.max_entries = 2, .max_bytes = 1000});
  Get(cache, "a");
  Get(cache, "b");
  ASSERT_NE(cache.Find("a"), nullptr);
  Get(cache, "c");  // evicts b, not a
  EXPECT_NE(cache.Find("a"), nullptr);
  EXPECT_EQ(cache.Find("b"), nullptr);
}

TEST(ModuleCacheTest, ByteBoundEvictsUntilTheNewEntryFits) {
  Cache cache({.max_entries = 100, .max_bytes = 100});
  Get(cache, "a", 40);
  Get(cache, "b", 40);
  Get(cache, "c", 40);  // 120 > 100: evicts a (the oldest) only
  EXPECT_EQ(cache.Find("a"), nullptr);
  EXPECT_NE(cache.Find("b"), nullptr);
  EXPECT_NE(cache.Find("c"), nullptr);
  EXPECT_EQ(cache.Stats().bytes, 80u);
  Get(cache, "d", 90);  // evicts b and c
  ModuleCacheStats s = cache.Stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 90u);
  EXPECT_EQ(s.evictions, 3u);
}

TEST(ModuleCacheTest, ValueLargerThanTheByteBoundIsReturnedButNotRetained) {
  Cache cache({.max_entries = 100, .max_bytes = 100});
  Get(cache, "small", 10);
  int calls = 0;
  EXPECT_EQ(Get(cache, "huge", 101, &calls), "value of huge");
  EXPECT_EQ(Get(cache, "huge", 101, &calls), "value of huge");
  EXPECT_EQ(calls, 2);
  EXPECT_NE(cache.Find("small"), nullptr);  // not evicted for a value that could never fit
  EXPECT_EQ(cache.Stats().entries, 1u);
}

TEST(ModuleCacheTest, ErrorsReachTheCallerAndAreNotCached) {
  Cache cache({.max_entries = 4, .max_bytes = 1000});
  int calls = 0;
  auto failing = [&]() -> absl::StatusOr<Cache::Compiled> {
    ++calls;
    return absl::InternalError("ptxas: syntax error");
  };
  absl::StatusOr<std::shared_ptr<const std::string>> v = cache.GetOrCompile("k", failing);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(v.status().message(), "ptxas: syntax error");
  EXPECT_EQ(cache.Find("k"), nullptr);
  EXPECT_EQ(Get(cache, "k", 1, &calls), "value of k");  // compiles again, now successfully
  EXPECT_EQ(calls, 2);
  ModuleCacheStats s = cache.Stats();
  EXPECT_EQ(s.compiles, 2u);
  EXPECT_EQ(s.compile_failures, 1u);
  EXPECT_EQ(s.entries, 1u);
}

TEST(ModuleCacheTest, EvictedValueStaysAliveWhileHeld) {
  Cache cache({.max_entries = 1, .max_bytes = 1000});
  std::weak_ptr<const std::string> weak;
  {
    absl::StatusOr<std::shared_ptr<const std::string>> held =
        cache.GetOrCompile("a", Returns("alpha", 1));
    ASSERT_TRUE(held.ok());
    weak = *held;
    Get(cache, "b");  // evicts a
    EXPECT_EQ(cache.Find("a"), nullptr);
    ASSERT_FALSE(weak.expired());
    EXPECT_EQ(**held, "alpha");
  }
  EXPECT_TRUE(weak.expired());  // released once the last holder let go
}

TEST(ModuleCacheTest, ConcurrentFirstRequestsCompileOnce) {
  constexpr int kThreads = 16;
  Cache cache({.max_entries = 4, .max_bytes = 1000});
  const ConcurrentFirstRequests asked = AskAtOnce(cache, kThreads, std::string("module"));
  EXPECT_EQ(asked.compiles, 1);
  for (const std::string& r : asked.results) EXPECT_EQ(r, "module");
  ModuleCacheStats s = cache.Stats();
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.misses, static_cast<uint64_t>(kThreads));
  EXPECT_EQ(s.hits, 0u);
}

TEST(ModuleCacheTest, ConcurrentRequestsShareOneFailure) {
  constexpr int kThreads = 8;
  Cache cache({.max_entries = 4, .max_bytes = 1000});
  const ConcurrentFirstRequests asked =
      AskAtOnce(cache, kThreads, absl::InternalError("jit failed"));
  EXPECT_EQ(asked.compiles, 1);
  for (const std::string& r : asked.results) EXPECT_EQ(r, "INTERNAL: jit failed");
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(ModuleCacheTest, ZeroEntryBoundRetainsNothing) {
  Cache cache({.max_entries = 0, .max_bytes = 1000});
  int calls = 0;
  Get(cache, "a", 1, &calls);
  Get(cache, "a", 1, &calls);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(ModuleCacheTest, ClearDropsEntriesButKeepsCounters) {
  Cache cache({.max_entries = 4, .max_bytes = 1000});
  Get(cache, "a", 5);
  Get(cache, "a", 5);
  cache.Clear();
  EXPECT_EQ(cache.Find("a"), nullptr);
  ModuleCacheStats s = cache.Stats();
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.evictions, 0u);
}

}  // namespace
}  // namespace normgrad::server
