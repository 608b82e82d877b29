#include "kernels/rmsnorm/kernel_registry.h"

#include "kernels/rmsnorm/rms_norm_backward.h"
#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"

namespace normgrad::kernels {

const BackwardKernel* FindKernel(absl::string_view entry_name) {
  for (const BackwardKernel* k : AllKernels()) {
    if (k->EntryName() == entry_name) return k;
  }
  return nullptr;
}

std::vector<const BackwardKernel*> AllKernels() {
  static const RmsNormBackwardKernel* const kWarp = new RmsNormBackwardKernel();
  static const BatchedRmsNormBackwardKernel* const kBatched = new BatchedRmsNormBackwardKernel();
  static const RowResidentRmsNormBackwardKernel* const kRowResident =
      new RowResidentRmsNormBackwardKernel();
  return {kWarp, kBatched, kRowResident};
}

}  // namespace normgrad::kernels
