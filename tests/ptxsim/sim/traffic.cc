#include "tests/ptxsim/sim/traffic.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/rmsnorm/kernel_choice.h"
#include "tests/ptxsim/backward_problem.h"
#include "tests/ptxsim/sim/parser.h"

namespace normgrad::ptxsim {

uint64_t AlignedDeviceMemory::Alloc(size_t bytes) {
  buffers_.emplace_back(bytes + kAlignment, 0);
  const uint64_t base = reinterpret_cast<uint64_t>(buffers_.back().data());
  const uint64_t aligned = (base + kAlignment - 1) / kAlignment * kAlignment;
  memory_.Add(aligned, bytes);
  return aligned;
}

absl::StatusOr<TrafficLauncher> TrafficLauncher::ForPlan(const kernels::BackwardPlan& plan,
                                                         const MemoryMap* memory,
                                                         std::vector<MemoryRange> marked) {
  TrafficLauncher launcher(memory, std::move(marked));
  absl::StatusOr<kernels::EmittedPtx> ptx = plan.kernel().Emit(plan.config());
  if (!ptx.ok()) return ptx.status();
  absl::StatusOr<Module> module = ParsePtx(ptx->text);
  if (!module.ok()) return module.status();
  if (module->FindEntry(ptx->entry) == nullptr) {
    return absl::InternalError(absl::StrCat("the emitted module lacks its entry ", ptx->entry));
  }
  launcher.ptx_ = *std::move(ptx);
  launcher.module_ = *std::move(module);
  return launcher;
}

absl::Status TrafficLauncher::ZeroFill(uint64_t address, uint64_t bytes) {
  std::memset(AlignedDeviceMemory::Pointer<uint8_t>(address), 0, bytes);
  return absl::OkStatus();
}

absl::Status TrafficLauncher::Launch(const kernels::LaunchGeometry& g, void** args) {
  LaunchConfig config;
  config.grid = {g.grid[0], g.grid[1], g.grid[2]};
  config.block = {g.block[0], g.block[1], g.block[2]};
  config.dynamic_shared_bytes = g.shared_bytes;
  config.count_traffic = true;
  config.traffic_marked = marked_;
  LaunchTraffic& launch = launches_.emplace_back();
  launch.entry = ptx_.entry;
  launch.geometry = g;
  return ptxsim::Launch(*module_.FindEntry(ptx_.entry), config, args, *memory_, &launch.report);
}

absl::StatusOr<PlanTraffic> RunPlanTraffic(const PlanTrafficOptions& options) {
  if (options.rows == 0 || options.hidden == 0) {
    return absl::InvalidArgumentError(absl::StrCat("rows (", options.rows, ") and hidden (",
                                                   options.hidden, ") must be at least 1"));
  }
  kernels::KernelConfig config;
  config.hidden_dim = options.hidden;
  config.dtype = options.dtype;
  config.target_sm = options.target_sm;
  config.sm_count = options.sm_count;
  config.variant = options.variant;
  // The CUDA backend's choice for a request without rms.
  kernels::BackwardRequest request;
  request.dtype = options.dtype;
  request.hidden_dim = options.hidden;
  request.variant = options.variant;
  absl::StatusOr<const kernels::BackwardKernel*> kernel = kernels::ChooseBackwardKernel(
      request, kernels::BackwardDevice{options.target_sm, options.sm_count});
  if (!kernel.ok()) return kernel.status();
  if (*kernel == nullptr) return absl::InternalError("no kernel takes a request without rms");
  if (absl::Status s = (*kernel)->CanImplement(config); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("hidden ", options.hidden, ": ", s.message()));
  }
  absl::StatusOr<kernels::BackwardPlan> plan = kernels::BackwardPlan::Create(**kernel, config);
  if (!plan.ok()) return plan.status();

  const kernel_testing::BackwardProblem p =
      kernel_testing::MakeBackwardProblem(options.dtype, options.rows, options.hidden);
  AlignedDeviceMemory device;
  auto store = [&](const std::vector<float>& values) {
    const std::vector<uint8_t> bytes = kernel_testing::EncodeElements(values, options.dtype);
    const uint64_t at = device.Alloc(bytes.size());
    std::copy(bytes.begin(), bytes.end(), AlignedDeviceMemory::Pointer<uint8_t>(at));
    return at;
  };
  const size_t n = size_t{options.rows} * options.hidden;
  const size_t dx_bytes = n * kernels::DTypeBytes(options.dtype);
  kernels::BackwardArgs args;
  const bool has_gamma = options.variant.has_gamma;
  args.gamma = has_gamma ? store(p.gamma) : 0;
  args.x = store(p.x);
  args.dy = store(p.dy);
  args.dx = device.Alloc(dx_bytes);
  const uint64_t workspace_bytes = plan->WorkspaceBytes(options.rows);
  args.workspace = workspace_bytes == 0 ? 0 : device.Alloc(workspace_bytes);
  // Zeroed: the semaphores' state before a first launch, and dgamma for kAccumulated.
  const uint64_t semaphore_bytes = plan->SemaphoreBytes(options.rows);
  args.semaphores = semaphore_bytes == 0 ? 0 : device.Alloc(semaphore_bytes);
  args.dgamma = has_gamma ? device.Alloc(size_t{options.hidden} * sizeof(float)) : 0;
  args.rows = options.rows;
  args.hidden_dim = options.hidden;
  args.eps = p.eps;

  std::vector<MemoryRange> marked;
  if (workspace_bytes != 0) marked.push_back({args.workspace, workspace_bytes});
  if (semaphore_bytes != 0) marked.push_back({args.semaphores, semaphore_bytes});
  absl::StatusOr<TrafficLauncher> launcher =
      TrafficLauncher::ForPlan(*plan, &device.memory(), std::move(marked));
  if (!launcher.ok()) return launcher.status();
  if (absl::Status s = plan->Run(args, *launcher); !s.ok()) {
    return absl::InternalError(absl::StrCat("the plan failed: ", s.message()));
  }

  const uint8_t* dx = AlignedDeviceMemory::Pointer<uint8_t>(args.dx);
  const std::vector<float> got =
      kernel_testing::DecodeElements(absl::MakeConstSpan(dx, dx_bytes), options.dtype);
  const kernel_testing::BackwardReference want =
      options.variant.is_default()
          ? kernel_testing::ReferenceFor(p, /*with_rms=*/false)
          : kernel_testing::VariantReferenceFor(p, options.variant, /*with_rms=*/false);
  if (absl::Status s = kernel_testing::CheckClose(got, want.dx,
                                                  kernel_testing::DxTolerance(options.dtype), "dx");
      !s.ok()) {
    return s;
  }
  if (plan->DataFlow().writes_dgamma) {
    const float* dgamma = AlignedDeviceMemory::Pointer<float>(args.dgamma);
    if (absl::Status s = kernel_testing::CheckClose(
            std::vector<float>(dgamma, dgamma + options.hidden), want.dgamma,
            kernel_testing::DgammaTolerance(options.rows), "dgamma");
        !s.ok()) {
      return s;
    }
  }

  PlanTraffic out;
  out.rows = options.rows;
  out.hidden = options.hidden;
  out.kernel = std::string(plan->kernel().EntryName());
  out.workspace_bytes = workspace_bytes;
  out.launches = launcher->launches();
  for (const LaunchTraffic& l : out.launches) out.total += l.report.traffic;
  out.max_dx_error = kernel_testing::MaxRelativeError(got, want.dx);
  return out;
}

std::string SummaryLine(const PlanTraffic& t) {
  return absl::StrFormat(
      "launches=%u bytes_per_element=%.4f partial_bytes_per_element=%.4f "
      "l2_bytes_per_element=%.4f sector_efficiency=%.4f",
      t.launches.size(), t.BytesPerElement(), t.PartialBytesPerElement(), t.L2BytesPerElement(),
      t.total.SectorEfficiency());
}

std::string LaunchLine(const LaunchTraffic& l, double elements) {
  const TrafficReport& t = l.report.traffic;
  return absl::StrFormat(
      "%s grid %u block %u: read %u B, written %u B (workspace: read %u B, written %u B), "
      "%.4f distinct bytes/element, %.4f requested bytes/element, sector efficiency %.4f, "
      "%u warp-instructions",
      l.entry, l.geometry.grid[0], l.geometry.block[0], t.read_bytes, t.written_bytes,
      t.marked_read_bytes, t.marked_written_bytes,
      static_cast<double>(t.read_bytes + t.written_bytes) / elements,
      static_cast<double>(t.requested_sector_bytes) / elements, t.SectorEfficiency(),
      l.report.warp_instructions);
}

}  // namespace normgrad::ptxsim
