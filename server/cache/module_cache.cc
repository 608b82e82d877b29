#include "server/cache/module_cache.h"

#include <chrono>
#include <optional>
#include <vector>

namespace normgrad::server::cache_internal {

struct ErasedCache::Flight {
  // Both written once, under mu_, by the compiling thread; read-only once `done`.
  bool done = false;
  std::optional<absl::StatusOr<std::shared_ptr<const void>>> result;
};

ErasedCache::ErasedCache(ModuleCacheOptions options) : options_(options) {
  stats_.max_entries = options.max_entries;
  stats_.max_bytes = options.max_bytes;
}

ErasedCache::~ErasedCache() = default;

absl::StatusOr<std::shared_ptr<const void>> ErasedCache::GetOrCompile(absl::string_view key,
                                                                      const CompileFn& compile) {
  std::shared_ptr<Flight> flight;
  bool leader = false;
  const std::string key_string(key);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(key_string); it != index_.end()) {
      ++stats_.hits;
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->value;
    }
    ++stats_.misses;
    auto [it, inserted] = flights_.try_emplace(key_string);
    if (inserted) {
      it->second = std::make_shared<Flight>();
      leader = true;
    }
    flight = it->second;
  }

  if (!leader) {
    std::unique_lock<std::mutex> lock(mu_);
    flight_done_.wait(lock, [&] { return flight->done; });
    return OwnCopy(*flight->result);
  }

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Compiled> compiled = compile();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (compiled.ok() && compiled->value == nullptr) {
    compiled = absl::InternalError("module cache: compile function returned a null value");
  }

  std::vector<std::shared_ptr<const void>> evicted;  // released after the lock
  absl::StatusOr<std::shared_ptr<const void>> result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.compiles;
    stats_.compile_seconds += seconds;
    if (compiled.ok()) {
      InsertLocked(key_string, compiled->value, compiled->bytes, evicted);
      flight->result.emplace(compiled->value);
    } else {
      ++stats_.compile_failures;
      flight->result.emplace(OwnCopy(compiled.status()));
    }
    flights_.erase(key_string);
    flight->done = true;
    result = OwnCopy(*flight->result);
  }
  flight_done_.notify_all();
  return result;
}

// A failure shared by several waiters is copied into a status of its own for each: absl::Status
// counts references to its message inside libabsl_status, which ThreadSanitizer cannot see, so
// one status released on several threads reads as a race there (docs/testing.md).
absl::StatusOr<std::shared_ptr<const void>> ErasedCache::OwnCopy(
    const absl::StatusOr<std::shared_ptr<const void>>& result) {
  if (result.ok()) return result;
  return absl::Status(result.status().code(), std::string(result.status().message()));
}

std::shared_ptr<const void> ErasedCache::Find(absl::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(std::string(key));
  if (it == index_.end()) return nullptr;
  ++stats_.hits;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->value;
}

void ErasedCache::InsertLocked(const std::string& key, const std::shared_ptr<const void>& value,
                               uint64_t bytes, std::vector<std::shared_ptr<const void>>& evicted) {
  if (options_.max_entries == 0 || bytes > options_.max_bytes) return;  // not retained
  lru_.push_front(Entry{key, value, bytes});
  index_[key] = lru_.begin();
  stats_.entries = lru_.size();
  stats_.bytes += bytes;
  while (lru_.size() > options_.max_entries || stats_.bytes > options_.max_bytes) {
    Entry& victim = lru_.back();  // never the entry just inserted: it alone fits the bounds
    stats_.bytes -= victim.bytes;
    evicted.push_back(std::move(victim.value));
    index_.erase(victim.key);
    lru_.pop_back();
    ++stats_.evictions;
  }
  stats_.entries = lru_.size();
}

ModuleCacheStats ErasedCache::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void ErasedCache::Clear() {
  Lru dropped;  // destroyed outside the lock: a value's destructor may be slow (cuModuleUnload)
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(lru_);
    index_.clear();
    stats_.entries = 0;
    stats_.bytes = 0;
  }
}

}  // namespace normgrad::server::cache_internal
