// SHA-256 of a byte string as lowercase hex (OpenSSL's libcrypto): the content address of PTX
// and cubin blobs, as in Bazel's remote execution API.
#ifndef NORMGRAD_SERVER_PTX_SHA256_H_
#define NORMGRAD_SERVER_PTX_SHA256_H_

#include <string>

#include "absl/strings/string_view.h"

namespace normgrad::server {

std::string Sha256Hex(absl::string_view data);  // 64 lowercase hex digits

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_PTX_SHA256_H_
