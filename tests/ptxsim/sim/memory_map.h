// The set of live "device" allocations a launch may touch. Device memory is host memory: an
// allocation's base is its host address. The interpreter checks every global access against a
// snapshot of this map taken when the launch starts.
//
//   MemoryMap memory;
//   std::vector<float> x(1024);
//   memory.Add(reinterpret_cast<uint64_t>(x.data()), x.size() * sizeof(float));
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace normgrad::ptxsim {

struct MemoryRange {
  uint64_t base = 0;
  uint64_t size = 0;
};

class MemoryMap {
 public:
  // Registers [base, base + size). size 0 registers nothing.
  void Add(uint64_t base, uint64_t size);
  // False when no allocation starts at `base`.
  bool Remove(uint64_t base);
  // The allocation containing `address`, or nullopt-like {0, 0}.
  MemoryRange Find(uint64_t address) const;
  // True when [address, address + size) lies inside one allocation.
  bool Contains(uint64_t address, uint64_t size) const;
  // Sorted by base.
  std::vector<MemoryRange> Snapshot() const;
  uint64_t BytesInUse() const;

 private:
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> ranges_;  // base -> size (guarded by mu_)
  uint64_t bytes_ = 0;                   // guarded by mu_
};

}  // namespace normgrad::ptxsim
