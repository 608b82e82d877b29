#include "kernels/kernel_registry.h"

#include "kernels/rms_norm_backward.h"
#include "kernels/rms_norm_backward_row_resident.h"

namespace normgrad::kernels {

const Kernel* FindKernel(absl::string_view entry_name) {
  for (const Kernel* k : AllKernels()) {
    if (k->EntryName() == entry_name) return k;
  }
  return nullptr;
}

std::vector<const Kernel*> AllKernels() {
  static const RmsNormBackwardKernel* const kSmall = new RmsNormBackwardKernel();
  static const BatchedRmsNormBackwardKernel* const kBatched = new BatchedRmsNormBackwardKernel();
  static const RowResidentRmsNormBackwardKernel* const kRowResident =
      new RowResidentRmsNormBackwardKernel();
  static const RmsNormBackwardDgammaReduceKernel* const kDgammaReduce =
      new RmsNormBackwardDgammaReduceKernel();
  return {kSmall, kBatched, kRowResident, kDgammaReduce};
}

}  // namespace normgrad::kernels
