// The parameters normgrad's kernels take: each has one name and one PTX type, written here once.
// A kernel's Build declares its entry's parameters from this table, in the order it chooses; the
// launch contract (kernels/launch.h) fills them from the built kernel's own list by looking each
// name up here. So a parameter's name is never written twice, and no code outside kernels/ needs
// to know it.
//
//   Function& f = m.AddEntry(EntryName());
//   const auto [x, rows] = AddKernelParams(f, {KernelParamId::kInput, KernelParamId::kNumRows});
#ifndef NORMGRAD_KERNELS_KERNEL_PARAMS_H_
#define NORMGRAD_KERNELS_KERNEL_PARAMS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"
#include "kernels/ptx_ir.h"

namespace normgrad::kernels {

enum class KernelParamId : uint8_t {
  kInput,           // input_ptr: x, rows x hidden_dim elements of the dtype
  kGamma,           // gamma_ptr: hidden_dim elements of the dtype
  kRms,             // rms_ptr: the forward's rms per row (f32, contains eps)
  kGradOutput,      // grad_output_ptr: dy
  kGradInput,       // grad_input_ptr: dx (written)
  kGradGamma,       // grad_gamma_ptr: f32 [hidden_dim], accumulated with atomics
  kDgammaPartials,  // dgamma_partials_ptr: f32 [partial rows, hidden_dim]
  kDgamma,          // dgamma_ptr: [hidden_dim] of the reduce's dtype (written)
  kNumRows,         // num_rows
  kNumPartials,     // num_partials
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

}  // namespace normgrad::kernels

#endif  // NORMGRAD_KERNELS_KERNEL_PARAMS_H_
