// The registry of every kernel normgrad serves, by entry name. Kernels are process-lifetime
// singletons, stateless, safe to use from any thread. Every one is a backward kernel
// (kernels/backward_kernel.h); which one a request gets is kernels/rmsnorm/kernel_choice.h's choice.
//
//   const BackwardKernel* k = FindKernel("batched_rms_norm_backward");  // nullptr: unknown name
//   for (const BackwardKernel* each : AllKernels())
//   names.push_back(std::string(each->EntryName()));
#pragma once

#include <vector>

#include "absl/strings/string_view.h"
#include "kernels/backward_kernel.h"

namespace normgrad::kernels {

// The kernel whose entry is `entry_name`; nullptr for an unknown name.
const BackwardKernel* FindKernel(absl::string_view entry_name);

// Every kernel, in a fixed order (the order `normgrad-ptx --list` prints).
std::vector<const BackwardKernel*> AllKernels();

}  // namespace normgrad::kernels
