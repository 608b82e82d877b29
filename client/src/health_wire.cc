#include "client/src/health_wire.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace normgrad::client_internal {
namespace {

void PutVarint(uint64_t value, std::string& out) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

bool GetVarint(absl::string_view& in, uint64_t& value) {
  value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (in.empty()) return false;
    const uint8_t byte = static_cast<uint8_t>(in.front());
    in.remove_prefix(1);
    value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

}  // namespace

std::string EncodeHealthCheckRequest(absl::string_view service) {
  std::string out;
  if (service.empty()) return out;  // proto3: default values are not sent
  out.push_back(0x0a);              // field 1, length-delimited
  PutVarint(service.size(), out);
  out.append(service.data(), service.size());
  return out;
}

absl::StatusOr<int> DecodeHealthCheckResponse(absl::string_view bytes) {
  int status = 0;
  while (!bytes.empty()) {
    uint64_t tag = 0;
    if (!GetVarint(bytes, tag)) return absl::InternalError("health reply: truncated tag");
    const uint64_t field = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    uint64_t value = 0;
    switch (wire_type) {
      case 0:
        if (!GetVarint(bytes, value)) return absl::InternalError("health reply: truncated varint");
        if (field == 1) status = static_cast<int>(value);
        continue;
      case 1:
        if (bytes.size() < 8) return absl::InternalError("health reply: truncated fixed64");
        bytes.remove_prefix(8);
        continue;
      case 2:
        if (!GetVarint(bytes, value) || value > bytes.size()) {
          return absl::InternalError("health reply: truncated length-delimited field");
        }
        bytes.remove_prefix(value);
        continue;
      case 5:
        if (bytes.size() < 4) return absl::InternalError("health reply: truncated fixed32");
        bytes.remove_prefix(4);
        continue;
      default:
        return absl::InternalError(absl::StrCat("health reply: wire type ", wire_type));
    }
  }
  return status;
}

}  // namespace normgrad::client_internal
