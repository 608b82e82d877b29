#include "client/tools/npy.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace normgrad::npy {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

absl::Status Bad(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
}

// A cursor over the header dictionary, a Python literal such as
// "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }".
class DictReader {
 public:
  explicit DictReader(absl::string_view text) : text_(text) {}

  void SkipSpace() {
    while (!text_.empty() && absl::ascii_isspace(static_cast<unsigned char>(text_.front()))) {
      text_.remove_prefix(1);
    }
  }
  bool Consume(char c) {
    SkipSpace();
    if (text_.empty() || text_.front() != c) return false;
    text_.remove_prefix(1);
    return true;
  }
  bool Peek(char c) {
    SkipSpace();
    return !text_.empty() && text_.front() == c;
  }
  bool String(std::string& out) {
    SkipSpace();
    if (text_.empty() || (text_.front() != '\'' && text_.front() != '"')) return false;
    const char quote = text_.front();
    const size_t end = text_.find(quote, 1);
    if (end == absl::string_view::npos) return false;
    out = std::string(text_.substr(1, end - 1));
    text_.remove_prefix(end + 1);
    return true;
  }
  bool Word(std::string& out) {
    SkipSpace();
    size_t n = 0;
    while (n < text_.size() && absl::ascii_isalnum(static_cast<unsigned char>(text_[n]))) ++n;
    if (n == 0) return false;
    out = std::string(text_.substr(0, n));
    text_.remove_prefix(n);
    return true;
  }
  bool AtEnd() {
    SkipSpace();
    return text_.empty();
  }

 private:
  absl::string_view text_;
};

}  // namespace

uint64_t Header::NumElements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(absl::Span<const uint64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

absl::StatusOr<Header> ParseHeader(absl::string_view bytes, absl::string_view name) {
  if (bytes.size() < kMagicSize + 2 ||
      bytes.substr(0, kMagicSize) != absl::string_view(kMagic, kMagicSize)) {
    return Bad(name, "not a .npy file (missing the \\x93NUMPY magic string)");
  }
  Header header;
  header.major_version = static_cast<uint8_t>(bytes[6]);
  const int minor = static_cast<uint8_t>(bytes[7]);
  uint64_t header_len = 0;
  size_t prefix = 0;
  auto byte = [&](size_t i) { return static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])); };
  if (header.major_version == 1 && minor == 0) {
    if (bytes.size() < 10) return Bad(name, "truncated .npy header");
    header_len = byte(8) | byte(9) << 8;
    prefix = 10;
  } else if ((header.major_version == 2 || header.major_version == 3) && minor == 0) {
    if (bytes.size() < 12) return Bad(name, "truncated .npy header");
    header_len = byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24;
    prefix = 12;
  } else {
    return Bad(name, absl::StrCat(".npy format version ", header.major_version, ".", minor,
                                  " is not supported (1.0, 2.0, 3.0 are)"));
  }
  if (bytes.size() - prefix < header_len) {
    return Bad(name, absl::StrCat("truncated .npy header (", bytes.size() - prefix, " of ",
                                  header_len, " bytes)"));
  }
  header.data_offset = prefix + header_len;
  DictReader dict(bytes.substr(prefix, header_len));
  const auto bad_dict = [&](absl::string_view why) {
    return Bad(name, absl::StrCat("malformed .npy header dictionary (", why, ")"));
  };
  if (!dict.Consume('{')) return bad_dict("no '{'");
  bool have_descr = false, have_order = false, have_shape = false;
  while (!dict.Consume('}')) {
    std::string key;
    if (!dict.String(key)) return bad_dict("expected a quoted key");
    if (!dict.Consume(':')) return bad_dict(absl::StrCat("no ':' after '", key, "'"));
    if (key == "descr") {
      if (!dict.String(header.descr)) return bad_dict("descr is not a string");
      have_descr = true;
    } else if (key == "fortran_order") {
      std::string word;
      if (!dict.Word(word) || (word != "True" && word != "False")) {
        return bad_dict("fortran_order is not True or False");
      }
      header.fortran_order = word == "True";
      have_order = true;
    } else if (key == "shape") {
      if (!dict.Consume('(')) return bad_dict("shape is not a tuple");
      while (!dict.Consume(')')) {
        std::string word;
        uint64_t dim = 0;
        if (!dict.Word(word) || !absl::SimpleAtoi(word, &dim)) {
          return bad_dict("shape holds something other than non-negative integers");
        }
        header.shape.push_back(dim);
        if (!dict.Consume(',') && !dict.Peek(')')) return bad_dict("shape: expected ',' or ')'");
      }
      have_shape = true;
    } else {
      return bad_dict(absl::StrCat("unknown key '", key, "'"));
    }
    if (!dict.Consume(',') && !dict.Peek('}')) return bad_dict("expected ',' or '}'");
  }
  if (!have_descr || !have_order || !have_shape) {
    return bad_dict("needs 'descr', 'fortran_order' and 'shape'");
  }
  // Every later size computation (elements * item size) must not wrap around.
  uint64_t elements = 1;
  for (uint64_t d : header.shape) {
    if (d != 0 && elements > (std::numeric_limits<uint64_t>::max() / 16) / d) {
      return bad_dict(absl::StrCat("shape ", ShapeString(header.shape),
                                   " has too many elements to address"));
    }
    elements *= d;
  }
  return header;
}

absl::StatusOr<Array> ParseF32(absl::string_view bytes, absl::string_view name) {
  absl::StatusOr<Header> header = ParseHeader(bytes, name);
  if (!header.ok()) return header.status();
  if (header->descr != "<f4") {
    return Bad(name, absl::StrCat("dtype '", header->descr,
                                  "' is not supported; need '<f4' (float32, little-endian)"));
  }
  if (header->fortran_order) {
    return Bad(name,
               "Fortran-order arrays are not supported; save a C-order array "
               "(numpy.ascontiguousarray)");
  }
  const uint64_t elements = header->NumElements();
  const uint64_t have = bytes.size() - header->data_offset;
  if (have != elements * sizeof(float)) {
    return Bad(name, absl::StrCat(have < elements * sizeof(float) ? "truncated" : "oversized",
                                  " data: shape ", ShapeString(header->shape), " needs ",
                                  elements * sizeof(float), " bytes, the file has ", have));
  }
  Array array;
  array.shape = header->shape;
  array.data.resize(elements);
  if (elements > 0) std::memcpy(array.data.data(), bytes.data() + header->data_offset, have);
  return array;
}

absl::StatusOr<Array> ReadF32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat(path, ": cannot open (", std::strerror(errno), ")"));
  std::ostringstream contents;
  contents << in.rdbuf();
  return ParseF32(contents.str(), path);
}

std::string SerializeF32(absl::Span<const uint64_t> shape, absl::Span<const float> data) {
  std::string dict =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': ", ShapeString(shape), ", }");
  // Magic, version, length field, dictionary, spaces, '\n': a multiple of 64 bytes in total.
  const bool v2 = dict.size() + 1 + 10 > 65535;
  const size_t prefix = v2 ? 12 : 10;
  const size_t unpadded = prefix + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out(kMagic, kMagicSize);
  out.push_back(static_cast<char>(v2 ? 2 : 1));
  out.push_back(0);
  const uint64_t len = dict.size();
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>((len >> 8) & 0xff));
  if (v2) {
    out.push_back(static_cast<char>((len >> 16) & 0xff));
    out.push_back(static_cast<char>((len >> 24) & 0xff));
  }
  out += dict;
  out.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
  return out;
}

absl::Status WriteF32(const std::string& path, absl::Span<const uint64_t> shape,
                      absl::Span<const float> data) {
  const std::string bytes = SerializeF32(shape, data);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": cannot open for writing (", std::strerror(errno), ")"));
  }
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace normgrad::npy
