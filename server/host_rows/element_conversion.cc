#include "server/host_rows/element_conversion.h"

#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "server/host_rows/element_conversion.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "server/host_rows/element_rounding-inl.h"

HWY_BEFORE_NAMESPACE();
namespace normgrad::server::host_rows {
namespace HWY_NAMESPACE {

void ConvertToF32Impl(kernels::DType dtype, const uint8_t* src, float* dst, size_t n) {
  switch (dtype) {
    case kernels::DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case kernels::DType::kBF16:
      rounding::PromoteToF32(reinterpret_cast<const hwy::bfloat16_t*>(src), dst, n);
      return;
    case kernels::DType::kF16:
      rounding::PromoteToF32(reinterpret_cast<const hwy::float16_t*>(src), dst, n);
      return;
  }
}

void ConvertFromF32Impl(kernels::DType dtype, const float* src, uint8_t* dst, size_t n) {
  switch (dtype) {
    case kernels::DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case kernels::DType::kBF16:
      rounding::DemoteFromF32(src, reinterpret_cast<hwy::bfloat16_t*>(dst), n);
      return;
    case kernels::DType::kF16:
      rounding::DemoteFromF32(src, reinterpret_cast<hwy::float16_t*>(dst), n);
      return;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace normgrad::server::host_rows
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace normgrad::server::host_rows {

HWY_EXPORT(ConvertToF32Impl);
HWY_EXPORT(ConvertFromF32Impl);

void ConvertToF32(kernels::DType dtype, const uint8_t* src, float* dst, size_t n) {
  if (n == 0) return;  // empty buffers may be null (no gamma)
  HWY_DYNAMIC_DISPATCH(ConvertToF32Impl)(dtype, src, dst, n);
}

void ConvertFromF32(kernels::DType dtype, const float* src, uint8_t* dst, size_t n) {
  if (n == 0) return;  // empty buffers may be null (no gamma)
  HWY_DYNAMIC_DISPATCH(ConvertFromF32Impl)(dtype, src, dst, n);
}

}  // namespace normgrad::server::host_rows
#endif  // HWY_ONCE
