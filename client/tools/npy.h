// NumPy .npy files of float32 (little-endian, C order): parse, read, serialize, write.
// Headers of format versions 1.0, 2.0 and 3.0 are read; 1.0 is written (2.0 when the header
// needs more than 65535 bytes).
//
//   absl::StatusOr<npy::Array> x = npy::ReadF32("x.npy");   // shape {rows, hidden}
//   if (!x.ok()) return x.status();
//   absl::Status s = npy::WriteF32("dx.npy", x->shape, dx);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace normgrad::npy {

struct Header {
  int major_version = 1;
  std::string descr;  // e.g. "<f4"
  bool fortran_order = false;
  std::vector<uint64_t> shape;  // () is a scalar: one element
  uint64_t data_offset = 0;     // bytes before the array data
  uint64_t NumElements() const;
};

struct Array {
  std::vector<uint64_t> shape;
  std::vector<float> data;  // row-major, NumElements(shape) values
};

// The header of a .npy file's bytes. INVALID_ARGUMENT (message starting with `name`) for a bad
// magic string, an unknown version, a truncated header or a header dictionary that is not
// {'descr': str, 'fortran_order': bool, 'shape': tuple of ints}.
absl::StatusOr<Header> ParseHeader(absl::string_view bytes, absl::string_view name = "npy");

// A float32 array from a file's bytes. Besides ParseHeader's errors, INVALID_ARGUMENT for any
// dtype but '<f4', for Fortran order, and for data shorter or longer than the shape says.
absl::StatusOr<Array> ParseF32(absl::string_view bytes, absl::string_view name = "npy");

// ParseF32 of a file; NOT_FOUND when it cannot be opened. Messages start with the path.
absl::StatusOr<Array> ReadF32(const std::string& path);

// The bytes of a .npy file holding `data` (row-major) with `shape`.
// Precondition: data.size() equals the product of shape.
std::string SerializeF32(absl::Span<const uint64_t> shape, absl::Span<const float> data);

// SerializeF32 to a file; PERMISSION_DENIED/NOT_FOUND-style errors name the path.
absl::Status WriteF32(const std::string& path, absl::Span<const uint64_t> shape,
                      absl::Span<const float> data);

// "(3, 4)" as NumPy prints shapes.
std::string ShapeString(absl::Span<const uint64_t> shape);

}  // namespace normgrad::npy
