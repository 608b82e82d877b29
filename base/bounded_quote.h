// Quotes text that came from outside (a request's kernel name, target or ptx_version) into an
// error message without echoing all of it: a client may send a megabyte, and the message travels
// back in gRPC's trailing metadata, which clients cap (8 KiB by default). Every error message
// that names client-supplied text goes through BoundedQuote.
//
//   absl::StrCat("kernel ", BoundedQuote(name), " is unknown")
//     kernel "fast_one" is unknown
//     kernel "kkkk...(the first 64 bytes)"... (100000 bytes) is unknown
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace normgrad::base {

// Bytes of the text quoted before it is cut.
inline constexpr size_t kBoundedQuoteBytes = 64;

// `text` in double quotes, C-escaped (quotes, control and non-ASCII bytes as \", \n, \xNN), cut
// after kBoundedQuoteBytes bytes with `... (N bytes)` giving the whole length. At most about
// 4 * kBoundedQuoteBytes + 32 characters.
inline std::string BoundedQuote(absl::string_view text) {
  if (text.size() <= kBoundedQuoteBytes) return absl::StrCat("\"", absl::CHexEscape(text), "\"");
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, kBoundedQuoteBytes)), "\"... (",
                      text.size(), " bytes)");
}

}  // namespace normgrad::base
