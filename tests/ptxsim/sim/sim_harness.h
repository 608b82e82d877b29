// Test harness: device buffers registered in a MemoryMap, kernel arguments packed the way
// cuLaunchKernel takes them, and one call that parses + launches.
//
//   SimHarness sim;
//   float* out = sim.Alloc<float>(64);
//   KernelArgs args;
//   args.Add(sim.Address(out)).Add(uint32_t{64});
//   LaunchReport report;
//   absl::Status s = sim.Run(ptx, "entry", {1, 1, 1}, {64, 1, 1}, args, &report);
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tests/ptxsim/sim/interpreter.h"
#include "tests/ptxsim/sim/memory_map.h"
#include "tests/ptxsim/sim/parser.h"

namespace normgrad::ptxsim {

class KernelArgs {
 public:
  template <typename T>
  KernelArgs& Add(T value) {
    auto storage = std::make_unique<uint64_t>(0);
    static_assert(sizeof(T) <= sizeof(uint64_t), "scalar parameters only");
    std::memcpy(storage.get(), &value, sizeof(T));
    pointers_.push_back(storage.get());
    storage_.push_back(std::move(storage));
    return *this;
  }
  void* const* Pointers() const { return pointers_.data(); }

 private:
  std::vector<std::unique_ptr<uint64_t>> storage_;
  std::vector<void*> pointers_;
};

class SimHarness {
 public:
  // Zero-filled, registered for exactly n elements (no slack: one past the end is out of bounds).
  template <typename T>
  T* Alloc(size_t n) {
    buffers_.emplace_back(n * sizeof(T) + 64, 0);
    uint8_t* base = buffers_.back().data();
    // 16-byte aligned start; the slack after the registered range stays unregistered.
    uint8_t* aligned = base + ((16 - reinterpret_cast<uintptr_t>(base) % 16) % 16);
    memory_.Add(reinterpret_cast<uint64_t>(aligned), n * sizeof(T));
    return reinterpret_cast<T*>(aligned);
  }
  template <typename T>
  static uint64_t Address(T* p) {
    return reinterpret_cast<uint64_t>(p);
  }
  MemoryMap& memory() { return memory_; }
  // Every later Run executes its blocks from the last to the first (LaunchConfig).
  void set_reverse_block_order(bool reverse) { reverse_block_order_ = reverse; }

  absl::Status Run(absl::string_view ptx, absl::string_view entry_name, Dim3 grid, Dim3 block,
                   const KernelArgs& args, LaunchReport* report = nullptr,
                   uint32_t dynamic_shared = 0,
                   uint64_t max_warp_instructions = uint64_t{1} << 32) {
    return Run(ptx, entry_name, grid, block, args.Pointers(), report, dynamic_shared,
               max_warp_instructions);
  }

  // The same with an argument array packed elsewhere (kernels::PackArgs).
  absl::Status Run(absl::string_view ptx, absl::string_view entry_name, Dim3 grid, Dim3 block,
                   void* const* args, LaunchReport* report = nullptr, uint32_t dynamic_shared = 0,
                   uint64_t max_warp_instructions = uint64_t{1} << 32) {
    absl::StatusOr<Module> module = ParsePtx(ptx);
    if (!module.ok()) return module.status();
    const Entry* entry = module->FindEntry(entry_name);
    if (entry == nullptr) return absl::NotFoundError(absl::StrCat("no entry ", entry_name));
    LaunchConfig config;
    config.grid = grid;
    config.block = block;
    config.dynamic_shared_bytes = dynamic_shared;
    config.max_warp_instructions = max_warp_instructions;
    config.reverse_block_order = reverse_block_order_;
    return Launch(*entry, config, args, memory_, report);
  }

 private:
  MemoryMap memory_;
  std::deque<std::vector<uint8_t>> buffers_;
  bool reverse_block_order_ = false;
};

}  // namespace normgrad::ptxsim
