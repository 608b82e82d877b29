// f32 <-> bf16/f16 conversions of whole buffers (Google Highway, dynamic dispatch), round to
// nearest even on every SIMD target (element_rounding-inl.h). `src`/`dst` hold n elements of
// `dtype` as little-endian bytes; f32 is copied as is.
//
//   host_rows::ConvertToF32(DType::kBF16, bytes.data(), floats.data(), n);
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernel_config.h"

namespace normgrad::server::host_rows {

void ConvertToF32(kernels::DType dtype, const uint8_t* src, float* dst, size_t n);
void ConvertFromF32(kernels::DType dtype, const float* src, uint8_t* dst, size_t n);

}  // namespace normgrad::server::host_rows
