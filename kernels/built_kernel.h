// What every builder-made kernel shares: Emit() = CanImplement + Build + Verify + divergence
// analysis + EmitPtx; CanImplement's hidden_dim range, target, dtype and PTX-version checks; the
// opening of every Build (the module at the resolved PTX version with the kernel's entry); the
// parameter list, taken from what Build declares (kernels/kernel_params.h), never written twice.
//
//   class MyKernel : public BuiltKernel {
//    public:
//     MyKernel() : BuiltKernel("my_kernel", /*max_hidden_dim=*/4096) {}
//     BackwardDataFlow DataFlow() const override { ... }
//     absl::Status Launch(...) const override { ... }   // kernels/backward_kernel.h
//     absl::StatusOr<Module> Build(const KernelConfig& config) const override {
//       NORMGRAD_ASSIGN_OR_RETURN(Module m, StartModule(config));
//       Function& f = m.mutable_functions().front();
//       const auto [rows, x] = AddKernelParams(f, {KernelParamId::kNumRows,
//       KernelParamId::kInput});
//       ...
//     }
//   };
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backward_kernel.h"
#include "kernels/kernel_config.h"
#include "kernels/ptx/ptx_builder.h"

namespace normgrad::kernels {

// Kernel objects are stateless (the registry holds process-lifetime singletons): every method
// may be called concurrently from any thread. Every builder-made kernel of ours is a backward
// kernel; each says how it is launched (BackwardKernel::DataFlow, Launch).
class BuiltKernel : public BackwardKernel {
 public:
  // hidden_dim_limit_note is appended to CanImplement's hidden_dim message: why the limit, and
  // what to use instead.
  BuiltKernel(absl::string_view entry_name, uint32_t max_hidden_dim,
              std::string hidden_dim_limit_note = "")
      : entry_name_(entry_name),
        max_hidden_dim_(max_hidden_dim),
        hidden_dim_limit_note_(std::move(hidden_dim_limit_note)) {}

  absl::string_view EntryName() const final { return entry_name_; }
  // The entry's parameters as Build declares them (built once per process at a small config:
  // no kernel of ours declares different parameters for different configs).
  std::vector<KernelParam> Params() const final;
  // hidden_dim in 1..max_hidden_dim (INVALID_ARGUMENT: "hidden_dim H is outside 1..M, the
  // limit of <entry><hidden_dim_limit_note>"), bf16 only on sm_80+, then the PTX version.
  // A variant other than the default only where ImplementsVariant says so.
  absl::Status CanImplement(const KernelConfig& config) const final;
  // Entry, dtype, target, PTX version and generator version: the key of a kernel that reads
  // every parameter (hidden_dim, eps, ...) at run time. A kernel that bakes more into its PTX
  // adds it (the row-resident kernel's tiling).
  std::string ConfigKey(const KernelConfig& config) const override;
  absl::StatusOr<EmittedPtx> Emit(const KernelConfig& config) const override;

  // The verified module (before text emission): what tests and the analysis look at.
  virtual absl::StatusOr<Module> Build(const KernelConfig& config) const = 0;

 protected:
  // Whether Build emits `variant` (gamma offset, no gamma, casting mode); the default only,
  // unless a kernel says more.
  virtual bool ImplementsVariant(const NormVariant& variant) const { return variant.is_default(); }
  // Build's opening: CanImplement, then a module at the lowest PTX version the target and the
  // dtype's instructions allow (or the requested one) with one entry named EntryName() that
  // declares `.maxntid BlockThreads(config), 1, 1`.
  absl::StatusOr<Module> StartModule(const KernelConfig& config) const;

 private:
  const absl::string_view entry_name_;
  const uint32_t max_hidden_dim_;
  const std::string hidden_dim_limit_note_;
};

// Every lane of a warp, for shfl.sync.
inline constexpr uint32_t kFullMask = 0xffffffffu;

// The PTX ISA version a dtype's instructions need: shfl.sync (member mask) is 6.0; cvt to and
// from .bf16 is 7.0 (sm_80).
PtxVersion InstructionsVersion(DType dtype);

// f32 rounded to nearest even in a 16-bit dtype (f16 or bf16), as a u16 register.
Value F32ToU16(Builder& b, DType dtype, Value v);

}  // namespace normgrad::kernels
