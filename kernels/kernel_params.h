// The parameters normgrad's kernels take: each has one name and one PTX type, written here once.
// A kernel's Build declares its entry's parameters from this table, in the order it chooses;
// PackArgs fills them from the built kernel's own list (EmittedPtx::params) by looking each name
// up here, for the backward kernels' launches (kernels/backward_kernel.h) and anyone launching a
// kernel alone. So a parameter's name is never written twice, and no code outside kernels/ needs
// to know it.
//
//   Function& f = m.AddEntry(EntryName());
//   const auto [x, rows] = AddKernelParams(f, {KernelParamId::kInput, KernelParamId::kNumRows});
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/kernel_config.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

enum class KernelParamId : uint8_t {
  kInput,           // input_ptr: x, rows x hidden_dim elements of the dtype
  kGamma,           // gamma_ptr: hidden_dim elements of the dtype
  kRms,             // rms_ptr: the forward's rms per row (f32, contains eps)
  kGradOutput,      // grad_output_ptr: dy
  kGradInput,       // grad_input_ptr: dx (written)
  kGradGamma,       // grad_gamma_ptr: f32 [hidden_dim], accumulated with atomics
  kDgammaPartials,  // dgamma_partials_ptr: f32 [partial rows, hidden_dim]
  kDgamma,          // dgamma_ptr: [hidden_dim] f32 (written)
  kSemaphores,      // semaphores_ptr: u32 counters, zero before a launch and left zero after it
  kNumRows,         // num_rows
  kHiddenDim,       // hidden_dim
  kEps,             // eps
};
inline constexpr int kNumKernelParamIds = 12;

struct KernelParamSpec {
  KernelParamId id;
  absl::string_view name;
  PtxType type;
};

const KernelParamSpec& SpecOf(KernelParamId id);
// The id of a parameter by its declared name; nullopt for a name no kernel of ours declares.
std::optional<KernelParamId> FindKernelParam(absl::string_view name);

// Declares parameter `id` on `f` (next in order) and returns its handle.
Param AddKernelParam(Function& f, KernelParamId id);

// Declares the entry's whole parameter list in order:
//   const auto [x, n] = AddKernelParams(f, {KernelParamId::kInput, KernelParamId::kNumRows});
template <size_t N>
std::array<Param, N> AddKernelParams(Function& f, const KernelParamId (&ids)[N]) {
  std::array<Param, N> params;
  for (size_t i = 0; i < N; ++i) params[i] = AddKernelParam(f, ids[i]);
  return params;
}

// The value of every parameter a kernel of ours can declare (kernels/kernel_params.h); a kernel
// reads the ones it declares. Pointers are device addresses.
struct KernelParamValues {
  uint64_t input = 0;
  uint64_t gamma = 0;
  uint64_t rms = 0;
  uint64_t grad_output = 0;
  uint64_t grad_input = 0;
  uint64_t grad_gamma = 0;
  uint64_t dgamma_partials = 0;
  uint64_t dgamma = 0;
  uint64_t semaphores = 0;
  uint32_t num_rows = 0;
  uint32_t hidden_dim = 0;
  float eps = 0;
};

// The ordered argument array cuLaunchKernel takes (`void** kernelParams`): one pointer per
// parameter, each to an 8-byte slot holding the value of the parameter's PTX type in its low
// bytes (so a caller may copy the slots to replay a launch). Owns the values; movable.
class PackedArgs {
 public:
  void** pointers() { return pointers_.data(); }
  size_t size() const { return pointers_.size(); }

 private:
  friend absl::StatusOr<PackedArgs> PackArgs(absl::Span<const KernelParam>,
                                             const KernelParamValues&);
  std::vector<uint64_t> storage_;  // one 8-byte slot per parameter (u64, u32 or f32 in place)
  std::vector<void*> pointers_;
};

// Packs `values` in the order of `params` (a built kernel's own list: EmittedPtx::params).
// INTERNAL naming the parameter when it is not one of ours or its type is not the one ours has.
absl::StatusOr<PackedArgs> PackArgs(absl::Span<const KernelParam> params,
                                    const KernelParamValues& values);

// The inverse, for test doubles of the driver: the values an argument array carries.
absl::StatusOr<KernelParamValues> UnpackArgs(absl::Span<const KernelParam> params,
                                             void* const* args);

}  // namespace normgrad::kernels
