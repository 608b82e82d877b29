// Global-memory traffic of a whole backward plan on the PTX interpreter (docs/ptxsim.md, "Memory
// traffic"): every launch the CUDA backend would make for one chunk, run with
// LaunchConfig::count_traffic, its dx checked against the CPU reference, and the figures per
// element that docs/kernels.md quotes.
//
//   PlanTrafficOptions options;
//   options.rows = 16384;
//   options.hidden = 4096;
//   options.dtype = kernels::DType::kBF16;
//   absl::StatusOr<PlanTraffic> t = RunPlanTraffic(options);
//   // t->BytesPerElement(): distinct sectors read + written per element (ideal 6 for bf16)
//   std::printf("%s\n", SummaryLine(*t).c_str());
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"
#include "kernels/backward_kernel.h"
#include "tests/ptxsim/sim/interpreter.h"
#include "tests/ptxsim/sim/memory_map.h"
#include "tests/ptxsim/sim/module.h"

namespace normgrad::ptxsim {

// Device memory as cuMemAlloc hands it out: every allocation starts on a 256-byte boundary, so
// sector figures are those of a real device (no allocation shares a 32-byte sector with another).
// Zero-filled, registered for exactly the bytes asked for.
class AlignedDeviceMemory {
 public:
  static constexpr uint64_t kAlignment = 256;
  uint64_t Alloc(size_t bytes);
  template <typename T>
  static T* Pointer(uint64_t address) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
  }
  const MemoryMap& memory() const { return memory_; }

 private:
  MemoryMap memory_;
  std::deque<std::vector<uint8_t>> buffers_;
};

// One launch and what it moved.
struct LaunchTraffic {
  std::string entry;
  kernels::LaunchGeometry geometry;
  LaunchReport report;  // report.traffic: the launch's traffic
};

// A kernels::KernelLauncher that runs the plan's emitted PTX (parsed once) on the interpreter
// with traffic counting, `marked` reported apart in every launch. Zero fills are host memsets,
// not counted.
class TrafficLauncher : public kernels::KernelLauncher {
 public:
  static absl::StatusOr<TrafficLauncher> ForPlan(const kernels::BackwardPlan& plan,
                                                 const MemoryMap* memory,
                                                 std::vector<MemoryRange> marked);

  const std::vector<LaunchTraffic>& launches() const { return launches_; }

  absl::Span<const kernels::KernelParam> Params() const override { return ptx_.params; }
  absl::Status Launch(const kernels::LaunchGeometry& g, void** args) override;
  absl::Status ZeroFill(uint64_t address, uint64_t bytes) override;

 private:
  TrafficLauncher(const MemoryMap* memory, std::vector<MemoryRange> marked)
      : memory_(memory), marked_(std::move(marked)) {}

  const MemoryMap* memory_;
  std::vector<MemoryRange> marked_;
  kernels::EmittedPtx ptx_;
  Module module_;
  std::vector<LaunchTraffic> launches_;
};

struct PlanTrafficOptions {
  uint32_t rows = 0;
  uint32_t hidden = 0;
  kernels::DType dtype = kernels::DType::kF32;
  int target_sm = 90;
  uint32_t sm_count = 132;  // sizes the row-resident kernel's grid, as the backend's device does
  // Without gamma neither gamma nor dgamma is passed. dx and dgamma are checked against the
  // variant's reference with rms recomputed, which is exact for casting gemma and none only.
  kernels::NormVariant variant;
};

struct PlanTraffic {
  uint32_t rows = 0;
  uint32_t hidden = 0;
  std::string kernel;            // the plan's kernel (the one the backend chooses)
  uint64_t workspace_bytes = 0;  // the plan's workspace (grad_gamma partial rows)
  std::vector<LaunchTraffic> launches;
  TrafficReport total;      // sum over the launches
  double max_dx_error = 0;  // relative to max(1, |ref|), within DxTolerance

  double Elements() const { return static_cast<double>(rows) * hidden; }
  // Distinct sectors' bytes read + written, summed over the launches, per element.
  double BytesPerElement() const {
    return static_cast<double>(total.read_bytes + total.written_bytes) / Elements();
  }
  // The part of BytesPerElement in the workspace.
  double PartialBytesPerElement() const {
    return static_cast<double>(total.marked_read_bytes + total.marked_written_bytes) / Elements();
  }
  // Requested sectors' bytes (re-reads included) per element.
  double L2BytesPerElement() const {
    return static_cast<double>(total.requested_sector_bytes) / Elements();
  }
};

// Runs the plan the CUDA backend would choose for a chunk of options.rows x options.hidden (no
// rms given: kernels::ChooseBackwardKernel's choice), on deterministic inputs, in 256-byte-aligned memory with the
// workspace marked. INVALID_ARGUMENT naming the field for a zero or unimplementable shape;
// INTERNAL when a launch fails or dx is not within DxTolerance of the reference.
absl::StatusOr<PlanTraffic> RunPlanTraffic(const PlanTrafficOptions& options);

// "launches=N bytes_per_element=B partial_bytes_per_element=P l2_bytes_per_element=L
// sector_efficiency=E" (4 decimals).
std::string SummaryLine(const PlanTraffic& traffic);
// One launch: entry, geometry and its traffic per element of the chunk.
std::string LaunchLine(const LaunchTraffic& launch, double elements);

}  // namespace normgrad::ptxsim
