// Bounded LRU cache of compiled artefacts (CUDA modules, emitted PTX, cubins) keyed by a
// kernel's ConfigKey, with single-flight compilation: N concurrent first requests for one key
// run the compile function once and all get its result (or its error; errors are not cached).
//
//   ModuleCache<CompiledModule> cache({.max_entries = 256, .max_bytes = 256 << 20});
//   absl::StatusOr<std::shared_ptr<const CompiledModule>> m = cache.GetOrCompile(key, [&] {
//     return CompileIt();   // -> absl::StatusOr<ModuleCache<CompiledModule>::Compiled>
//   });
//
// Thread-safe. Evicted values stay alive while a caller holds their shared_ptr.
//
// Bounds: after every insertion the least recently used entries are evicted until both
// `entries <= max_entries` and `bytes <= max_bytes`. A value larger than max_bytes by itself
// (or any value when max_entries == 0) is returned to its caller but not retained.
//
// Counters: a request that finds a finished value is a hit; any other request is a miss (it
// either runs the compile function or waits for the one already running for its key), so
// `compiles <= misses`. Evictions count entries removed to honour the bounds (not Clear()).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"

namespace normgrad::server {

struct ModuleCacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t compiles = 0;  // compile functions actually run (successful or not)
  uint64_t compile_failures = 0;
  uint64_t entries = 0;
  uint64_t bytes = 0;
  double compile_seconds = 0;  // total time inside compile functions
  uint64_t max_entries = 0;
  uint64_t max_bytes = 0;
};

struct ModuleCacheOptions {
  uint64_t max_entries = 256;
  uint64_t max_bytes = 256ull << 20;
};

namespace cache_internal {

// The type-erased cache behind ModuleCache<T>: all bookkeeping lives here, compiled once.
class ErasedCache {
 public:
  struct Compiled {
    std::shared_ptr<const void> value;
    uint64_t bytes = 0;
  };
  using CompileFn = std::function<absl::StatusOr<Compiled>()>;

  explicit ErasedCache(ModuleCacheOptions options);
  ErasedCache(const ErasedCache&) = delete;
  ErasedCache& operator=(const ErasedCache&) = delete;
  ~ErasedCache();

  absl::StatusOr<std::shared_ptr<const void>> GetOrCompile(absl::string_view key,
                                                           const CompileFn& compile);
  std::shared_ptr<const void> Find(absl::string_view key);
  ModuleCacheStats Stats() const;
  void Clear();

 private:
  struct Flight;  // one compile in progress and the requests waiting for it
  static absl::StatusOr<std::shared_ptr<const void>> OwnCopy(
      const absl::StatusOr<std::shared_ptr<const void>>& result);
  struct Entry {
    std::string key;
    std::shared_ptr<const void> value;
    uint64_t bytes = 0;
  };
  using Lru = std::list<Entry>;  // front = most recently used

  // Inserts and evicts down to the bounds; evicted values are handed to `evicted` so that
  // their destructors run after the lock is released.
  // Requires mu_ held.
  void InsertLocked(const std::string& key, const std::shared_ptr<const void>& value,
                    uint64_t bytes, std::vector<std::shared_ptr<const void>>& evicted);

  const ModuleCacheOptions options_;
  // std::mutex rather than absl::Mutex: ThreadSanitizer understands it without an abseil built
  // for it. Everything below is guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable flight_done_;  // signalled when any flight finishes
  Lru lru_;
  absl::flat_hash_map<std::string, Lru::iterator> index_;
  absl::flat_hash_map<std::string, std::shared_ptr<Flight>> flights_;
  ModuleCacheStats stats_;
};

}  // namespace cache_internal

template <typename T>
class ModuleCache {
 public:
  // What a compile function returns: the value and the bytes it accounts for (module image
  // size, PTX length...).
  struct Compiled {
    std::shared_ptr<const T> value;
    uint64_t bytes = 0;
  };
  using CompileFn = std::function<absl::StatusOr<Compiled>()>;

  explicit ModuleCache(ModuleCacheOptions options) : impl_(options) {}

  // The cached value for `key`, or the result of `compile` (run at most once at a time per
  // key, outside the cache's lock; concurrent requests for the key wait for it). Errors
  // reach every waiting request and are not cached: the next request compiles again.
  absl::StatusOr<std::shared_ptr<const T>> GetOrCompile(absl::string_view key,
                                                        const CompileFn& compile) {
    auto compile_erased = [&]() -> absl::StatusOr<cache_internal::ErasedCache::Compiled> {
      NORMGRAD_ASSIGN_OR_RETURN(Compiled compiled, compile());
      return cache_internal::ErasedCache::Compiled{std::move(compiled.value), compiled.bytes};
    };
    NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const void> erased,
                              impl_.GetOrCompile(key, compile_erased));
    return std::static_pointer_cast<const T>(std::move(erased));
  }

  // The cached value for `key` (counts a hit and refreshes it), or nullptr (counts nothing).
  std::shared_ptr<const T> Find(absl::string_view key) {
    return std::static_pointer_cast<const T>(impl_.Find(key));
  }

  ModuleCacheStats Stats() const { return impl_.Stats(); }

  // Drops every entry (values live on while held). Counters are kept.
  void Clear() { impl_.Clear(); }

 private:
  cache_internal::ErasedCache impl_;
};

}  // namespace normgrad::server
