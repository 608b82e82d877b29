#include <mutex>
#include "tests/ptxsim/sim/memory_map.h"

namespace normgrad::ptxsim {

void MemoryMap::Add(uint64_t base, uint64_t size) {
  if (size == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  ranges_[base] = size;
  bytes_ += size;
}

bool MemoryMap::Remove(uint64_t base) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.find(base);
  if (it == ranges_.end()) return false;
  bytes_ -= it->second;
  ranges_.erase(it);
  return true;
}

MemoryRange MemoryMap::Find(uint64_t address) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.upper_bound(address);
  if (it == ranges_.begin()) return {};
  --it;
  if (address - it->first >= it->second) return {};
  return {it->first, it->second};
}

bool MemoryMap::Contains(uint64_t address, uint64_t size) const {
  const MemoryRange r = Find(address);
  return r.size != 0 && size <= r.size && address - r.base <= r.size - size;
}

std::vector<MemoryRange> MemoryMap::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MemoryRange> out;
  out.reserve(ranges_.size());
  for (const auto& [base, size] : ranges_) out.push_back({base, size});
  return out;
}

uint64_t MemoryMap::BytesInUse() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace normgrad::ptxsim
