// Fuzzes the .npy reader (client/tools/npy.*) with arbitrary file bytes.
//
// Contract checked beyond "no crash": a parsed array holds exactly as many values as its shape
// says, and serializing it and parsing the result gives back the same shape and bit patterns.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "client/tools/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<normgrad::npy::Header> header = normgrad::npy::ParseHeader(bytes, "fuzz");
  if (header.ok() && header->data_offset > size) std::abort();
  absl::StatusOr<normgrad::npy::Array> array = normgrad::npy::ParseF32(bytes, "fuzz");
  if (!array.ok()) {
    if (array.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  uint64_t elements = 1;
  for (uint64_t d : array->shape) elements *= d;
  if (elements != array->data.size()) std::abort();
  const std::string again = normgrad::npy::SerializeF32(array->shape, array->data);
  absl::StatusOr<normgrad::npy::Array> round_trip = normgrad::npy::ParseF32(again, "again");
  if (!round_trip.ok() || round_trip->shape != array->shape ||
      round_trip->data.size() != array->data.size() ||
      (!array->data.empty() && std::memcmp(round_trip->data.data(), array->data.data(),
                  array->data.size() * sizeof(float)) != 0)) {
    std::abort();
  }
  return 0;
}
