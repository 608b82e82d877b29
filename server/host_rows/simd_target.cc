#include "server/host_rows/simd_target.h"

#include <cstdint>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "server/host_rows/simd_target.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace normgrad::server::host_rows {
namespace HWY_NAMESPACE {

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace normgrad::server::host_rows
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace normgrad::server::host_rows {

HWY_EXPORT(TargetNameImpl);

std::string SimdTargetName() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

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
#endif  // HWY_ONCE
