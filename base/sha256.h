// SHA-256 of a byte string as lowercase hex (OpenSSL's libcrypto): the content address of PTX
// and cubin blobs, as in Bazel's remote execution API.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace normgrad::base {

std::string Sha256Hex(absl::string_view data);  // 64 lowercase hex digits

}  // namespace normgrad::base
