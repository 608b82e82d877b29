#include "server/host_rows/simd_target.h"

#include <cstdint>

#include "hwy/targets.h"
#include "server/host_rows/half_rows.h"

namespace normgrad::server::host_rows {

// The target host_rows' own dispatch picks (internal::DispatchedTargetName), not a guess at it.
std::string SimdTargetName() { return internal::DispatchedTargetName(); }

bool LimitSimdTarget(const std::string& name) {
  if (name.empty()) {
    hwy::DisableTargets(0);
    return true;
  }
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (name == hwy::TargetName(target)) {
      // Targets are single bits, the better ones lower: disable every bit below this one.
      hwy::DisableTargets(target - 1);
      return true;
    }
  }
  return false;
}

std::vector<std::string> SupportedSimdTargets() {
  std::vector<std::string> names;
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    names.push_back(hwy::TargetName(target));
  }
  return names;
}

}  // namespace normgrad::server::host_rows
