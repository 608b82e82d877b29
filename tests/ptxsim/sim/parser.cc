#include "tests/ptxsim/sim/parser.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace normgrad::ptxsim {

namespace {

// Every type suffix the parser knows and the type it names ("f32" -> kF32), once.
constexpr std::pair<absl::string_view, Type> kTypeSuffixes[] = {
    {"pred", Type::kPred}, {"b8", Type::kB8},   {"b16", Type::kB16},   {"b32", Type::kB32},
    {"b64", Type::kB64},   {"u8", Type::kU8},   {"u16", Type::kU16},   {"u32", Type::kU32},
    {"u64", Type::kU64},   {"s8", Type::kS8},   {"s16", Type::kS16},   {"s32", Type::kS32},
    {"s64", Type::kS64},   {"f16", Type::kF16}, {"bf16", Type::kBF16}, {"f32", Type::kF32},
    {"f64", Type::kF64},
};

}  // namespace

absl::string_view TypeName(Type type) {
  if (type == Type::kNone) return "none";
  for (const auto& [name, t] : kTypeSuffixes) {
    if (t == type) return name;
  }
  return "?";
}

const Entry* Module::FindEntry(absl::string_view name) const {
  for (const Entry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

uint64_t Module::InstructionCount() const {
  uint64_t n = 0;
  for (const Entry& e : entries) n += e.code.size();
  return n;
}

namespace {

// ---------------------------------------------------------------------------------------------
// Lexer

struct Token {
  enum class Kind { kIdent, kReg, kNumber, kPunct, kString, kEnd };
  Kind kind = Kind::kEnd;
  absl::string_view text;
  uint32_t line = 0;
};

bool IsIdentStart(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '$';
}
bool IsIdentChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '$';
}

absl::StatusOr<std::vector<Token>> Lex(absl::string_view text) {
  std::vector<Token> tokens;
  uint32_t line = 1;
  size_t i = 0;
  const size_t n = text.size();
  auto error = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", why));
  };
  while (i < n) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
      ++i;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') {
      ++i;
      continue;
    }
    if (c == '/' && i + 1 < n && text[i + 1] == '/') {
      while (i < n && text[i] != '\n') ++i;
      continue;
    }
    if (c == '/' && i + 1 < n && text[i + 1] == '*') {
      const size_t end = text.find("*/", i + 2);
      if (end == absl::string_view::npos) return error("unterminated /* comment");
      for (size_t k = i; k < end; ++k) line += text[k] == '\n';
      i = end + 2;
      continue;
    }
    if (c == '\0') break;  // images handed to cuModuleLoadData end in a NUL
    Token t;
    t.line = line;
    const size_t start = i;
    if (c == '%') {
      ++i;
      while (i < n && IsIdentChar(text[i])) ++i;
      t.kind = Token::Kind::kReg;
    } else if (IsIdentStart(c)) {
      ++i;
      while (i < n) {
        if (IsIdentChar(text[i])) {
          ++i;
        } else if (text[i] == ':' && i + 2 < n && text[i + 1] == ':' && IsIdentChar(text[i + 2])) {
          i += 2;  // cache qualifiers such as .L1::no_allocate
        } else {
          break;
        }
      }
      t.kind = Token::Kind::kIdent;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      const bool hex_like = i + 1 < n &&
                            (text[i + 1] == 'x' || text[i + 1] == 'X' || text[i + 1] == 'f' ||
                             text[i + 1] == 'F' || text[i + 1] == 'd' || text[i + 1] == 'D') &&
                            c == '0';
      ++i;
      while (i < n) {
        const char d = text[i];
        if (std::isalnum(static_cast<unsigned char>(d)) || d == '.') {
          ++i;
        } else if ((d == '+' || d == '-') && !hex_like &&
                   (text[i - 1] == 'e' || text[i - 1] == 'E')) {
          ++i;
        } else {
          break;
        }
      }
      t.kind = Token::Kind::kNumber;
    } else if (c == '"') {
      ++i;
      while (i < n && text[i] != '"' && text[i] != '\n') ++i;
      if (i >= n || text[i] != '"') return error("unterminated string");
      ++i;
      t.kind = Token::Kind::kString;
    } else if (std::strchr(",;:[]{}()+-|!@<>=", c) != nullptr) {
      ++i;
      t.kind = Token::Kind::kPunct;
    } else {
      return error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
    }
    t.text = text.substr(start, i - start);
    tokens.push_back(t);
  }
  Token end;
  end.kind = Token::Kind::kEnd;
  end.line = line;
  tokens.push_back(end);
  return tokens;
}

// ---------------------------------------------------------------------------------------------
// Literals

absl::StatusOr<uint64_t> ParseIntegerLiteral(absl::string_view s) {
  std::string text(s);
  if (!text.empty() && (text.back() == 'U' || text.back() == 'u')) text.pop_back();
  if (text.empty()) return absl::InvalidArgumentError("empty integer literal");
  int base = 10;
  size_t skip = 0;
  if (text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
    base = 16;
    skip = 2;
  } else if (text.size() > 2 && text[0] == '0' && (text[1] == 'b' || text[1] == 'B')) {
    base = 2;
    skip = 2;
  } else if (text.size() > 1 && text[0] == '0') {
    base = 8;
    skip = 1;
  }
  const char* begin = text.c_str() + skip;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(begin, &end, base);
  if (end == begin || *end != '\0' || errno != 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad integer literal '", s, "'"));
  }
  return static_cast<uint64_t>(v);
}

// The value of a 0f (Float = float, Bits = uint32_t) or 0d (double, uint64_t) literal: its bits
// in hex after the two-character prefix.
template <typename Float, typename Bits>
absl::StatusOr<double> ParseHexFloatLiteral(absl::string_view s, absl::string_view type_name) {
  Bits bits = 0;
  if (!absl::SimpleHexAtoi(s.substr(2), &bits)) {
    return absl::InvalidArgumentError(absl::StrCat("bad ", type_name, " hex literal '", s, "'"));
  }
  return static_cast<double>(absl::bit_cast<Float>(bits));
}

// Float literal -> double value (0f/0d hex forms are exact).
absl::StatusOr<double> ParseFloatLiteral(absl::string_view s, bool* is_float_literal) {
  *is_float_literal = true;
  if (s.size() == 10 && s[0] == '0' && (s[1] == 'f' || s[1] == 'F')) {
    return ParseHexFloatLiteral<float, uint32_t>(s, "f32");
  }
  if (s.size() == 18 && s[0] == '0' && (s[1] == 'd' || s[1] == 'D')) {
    return ParseHexFloatLiteral<double, uint64_t>(s, "f64");
  }
  if (s.find_first_of(".eE") != absl::string_view::npos && !absl::StartsWithIgnoreCase(s, "0x")) {
    std::string text(s);
    char* end = nullptr;
    const double d = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || *end != '\0') {
      return absl::InvalidArgumentError(absl::StrCat("bad float literal '", s, "'"));
    }
    return d;
  }
  *is_float_literal = false;
  absl::StatusOr<uint64_t> i = ParseIntegerLiteral(s);
  if (!i.ok()) return i.status();
  return static_cast<double>(*i);
}

uint64_t TruncateToType(uint64_t v, Type type) {
  const int bits = TypeBits(type);
  if (bits >= 64) return v;
  return v & ((uint64_t{1} << bits) - 1);
}

// ---------------------------------------------------------------------------------------------
// Syntactic operands (before the opcode gives them types)

struct SynOperand {
  enum class Kind { kReg, kNumber, kAddress, kVector, kSymbol };
  Kind kind = Kind::kReg;
  bool negated = false;           // !%p
  bool minus = false;             // -literal
  std::vector<std::string> regs;  // kReg: 1 or 2 (a|b); kVector: 1..4; kAddress: 0 or 1 base
  std::string text;               // kNumber literal; kSymbol / kAddress symbol
  int64_t offset = 0;             // kAddress
  uint32_t line = 0;
};

// One register of a split operand ({%a, %b} or %p|%q) as an operand of its own.
SynOperand RegisterOperand(const std::string& name, uint32_t line) {
  SynOperand o;
  o.kind = SynOperand::Kind::kReg;
  o.regs.push_back(name);
  o.line = line;
  return o;
}

struct RangeDecl {
  std::string prefix;
  uint32_t count;
  Type type;
};

struct SharedVar {
  uint32_t offset;
  uint32_t size;
  bool dynamic;
};

struct PendingBranch {
  size_t instruction;
  std::string label;
  uint32_t line;
};

absl::StatusOr<Type> TypeFromSuffix(absl::string_view s) {
  for (const auto& [name, type] : kTypeSuffixes) {
    if (s == name) return type;
  }
  return absl::NotFoundError(s);
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<Module> Run() {
    Module module;
    bool saw_version = false;
    while (Peek().kind != Token::Kind::kEnd) {
      const Token t = Next();
      if (t.text == ".version") {
        const Token v = Next();
        std::vector<std::string> parts = absl::StrSplit(v.text, '.');
        if (v.kind != Token::Kind::kNumber || parts.size() != 2 ||
            !absl::SimpleAtoi(parts[0], &module.version_major) ||
            !absl::SimpleAtoi(parts[1], &module.version_minor)) {
          return Error(t.line, absl::StrCat("bad .version '", v.text, "'"));
        }
        saw_version = true;
      } else if (t.text == ".target") {
        const Token target = Next();
        if (target.kind != Token::Kind::kIdent || !absl::StartsWith(target.text, "sm_")) {
          return Error(t.line, absl::StrCat("bad .target '", target.text, "'"));
        }
        absl::string_view digits = target.text.substr(3);
        while (!digits.empty() && std::isalpha(static_cast<unsigned char>(digits.back()))) {
          digits.remove_suffix(1);  // sm_90a, sm_100f
        }
        if (!absl::SimpleAtoi(digits, &module.target_sm)) {
          return Error(t.line, absl::StrCat("bad .target '", target.text, "'"));
        }
        while (Peek().text == ",") {
          Next();
          const Token extra = Next();
          if (extra.text != "debug" && extra.text != "texmode_independent") {
            return Error(t.line, absl::StrCat("unsupported .target option '", extra.text, "'"));
          }
        }
      } else if (t.text == ".address_size") {
        const Token size = Next();
        if (size.text != "64") {
          return Error(t.line,
                       absl::StrCat(".address_size ", size.text, " is not supported (only 64)"));
        }
      } else if (t.text == ".visible" || t.text == ".weak") {
        continue;
      } else if (t.text == ".entry") {
        if (!saw_version) return Error(t.line, ".entry before .version");
        absl::StatusOr<Entry> entry = ParseEntry(t.line);
        if (!entry.ok()) return entry.status();
        if (module.FindEntry(entry->name) != nullptr) {
          return Error(t.line, absl::StrCat("duplicate .entry '", entry->name, "'"));
        }
        module.entries.push_back(*std::move(entry));
      } else if (t.text == ".file" || t.text == ".loc") {
        SkipLine(t.line);
      } else if (t.text == ".pragma") {
        SkipStatement();
      } else if (t.text == ".func" || t.text == ".extern") {
        return Error(t.line, "device functions (.func/.extern) are not supported");
      } else if (t.text == ".global" || t.text == ".const" || t.text == ".shared" ||
                 t.text == ".local") {
        return Error(t.line,
                     absl::StrCat("module-scope variables (", t.text, ") are not supported"));
      } else {
        return Error(t.line, absl::StrCat("unexpected '", t.text, "' at module scope"));
      }
    }
    if (!saw_version) return Error(Peek().line, "missing .version");
    if (module.target_sm == 0) return Error(Peek().line, "missing .target");
    if (module.entries.empty()) return Error(Peek().line, "no .entry in module");
    return module;
  }

 private:
  const Token& Peek(size_t ahead = 0) const {
    const size_t k = std::min(pos_ + ahead, tokens_.size() - 1);
    return tokens_[k];
  }
  Token Next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  static absl::Status Error(uint32_t line, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", why));
  }
  absl::Status Expect(absl::string_view text) {
    const Token t = Next();
    if (t.text != text) {
      return Error(t.line, absl::StrCat("expected '", text, "', found '",
                                        t.kind == Token::Kind::kEnd ? "end of text" : t.text, "'"));
    }
    return absl::OkStatus();
  }
  // The next token, which must be of `kind`; else INVALID_ARGUMENT "line N: expected <what>".
  absl::StatusOr<Token> NextOfKind(Token::Kind kind, absl::string_view what) {
    const Token t = Next();
    if (t.kind != kind) return Error(t.line, absl::StrCat("expected ", what));
    return t;
  }
  // The N of `.align N` (a power of two) into *align, after its .align token `m`.
  absl::Status ParseAlign(const Token& m, uint32_t* align) {
    absl::StatusOr<uint64_t> a = ParseIntegerLiteral(Next().text);
    if (!a.ok() || *a == 0 || (*a & (*a - 1)) != 0) return Error(m.line, "bad .align");
    *align = static_cast<uint32_t>(*a);
    return absl::OkStatus();
  }
  void SkipLine(uint32_t line) {
    while (Peek().kind != Token::Kind::kEnd && Peek().line == line) Next();
  }
  void SkipStatement() {
    while (Peek().kind != Token::Kind::kEnd && Peek().text != ";") Next();
    Next();
  }

  // .entry name ( .param .u64 a, ... ) [.maxntid x, y, z] { body }
  absl::StatusOr<Entry> ParseEntry(uint32_t line) {
    Entry entry;
    entry.line = line;
    absl::StatusOr<Token> name = NextOfKind(Token::Kind::kIdent, "the entry's name");
    if (!name.ok()) return name.status();
    entry.name = std::string(name->text);
    entry_ = &entry;
    decls_.clear();
    ranges_.clear();
    slot_of_.clear();
    shared_.clear();
    labels_.clear();
    branches_.clear();
    static const char* kSpecialNames[kNumSpecialSlots] = {
        "%tid.x",       "%tid.y",       "%tid.z",       "%ntid.x",      "%ntid.y",
        "%ntid.z",      "%ctaid.x",     "%ctaid.y",     "%ctaid.z",     "%nctaid.x",
        "%nctaid.y",    "%nctaid.z",    "%laneid",      "%warpid",      "%nwarpid",
        "%lanemask_eq", "%lanemask_lt", "%lanemask_le", "%lanemask_gt", "%lanemask_ge"};
    for (uint32_t s = 0; s < kNumSpecialSlots; ++s) {
      entry.reg_names.push_back(kSpecialNames[s]);
      entry.reg_types.push_back(Type::kU32);
      slot_of_[kSpecialNames[s]] = s;
    }

    if (Peek().text == "(") {
      Next();
      while (Peek().text != ")") {
        if (Peek().kind == Token::Kind::kEnd)
          return Error(Peek().line, "unterminated parameter list");
        if (!entry.params.empty()) {
          if (absl::Status s = Expect(","); !s.ok()) return s;
        }
        if (absl::Status s = ParseParam(entry); !s.ok()) return s;
      }
      Next();
    }
    // Performance directives.
    while (Peek().text != "{") {
      const Token d = Next();
      if (d.text == ".maxntid" || d.text == ".reqntid") {
        // The limit is the product of the 1 to 3 extents (what the driver compares a block's
        // thread count with); ptxas refuses an extent of 0. Saturated, so no product wraps to 0
        // ("undeclared").
        uint64_t product = 1;
        for (int k = 0; k < 3; ++k) {
          const Token v = Next();
          absl::StatusOr<uint64_t> value = ParseIntegerLiteral(v.text);
          if (v.kind != Token::Kind::kNumber || !value.ok() || *value == 0) {
            return Error(v.line, absl::StrCat("bad ", d.text, " value '", v.text,
                                              "' (a positive integer expected)"));
          }
          product =
              std::min<uint64_t>(product * std::min<uint64_t>(*value, UINT32_MAX), UINT32_MAX);
          if (Peek().text != ",") break;
          Next();
        }
        entry.max_threads_per_block = static_cast<uint32_t>(product);
      } else if (d.text == ".minnctapersm" || d.text == ".maxnreg" || d.text == ".maxnctapersm") {
        Next();
      } else {
        return Error(d.line, absl::StrCat("unexpected '", d.text, "' before the entry's body"));
      }
    }
    Next();  // {
    if (absl::Status s = ParseBody(entry); !s.ok()) return s;
    entry_ = nullptr;
    return entry;
  }

  absl::Status ParseParam(Entry& entry) {
    const Token p = Next();
    if (p.text != ".param")
      return Error(p.line, absl::StrCat("expected .param, found '", p.text, "'"));
    Param param;
    uint32_t align = 0;
    while (Peek().kind == Token::Kind::kIdent && absl::StartsWith(Peek().text, ".")) {
      const Token m = Next();
      if (m.text == ".align") {
        if (absl::Status s = ParseAlign(m, &align); !s.ok()) return s;
      } else if (m.text == ".ptr" || m.text == ".global" || m.text == ".shared" ||
                 m.text == ".const" || m.text == ".local") {
        continue;
      } else if (absl::StatusOr<Type> t = TypeFromSuffix(m.text.substr(1)); t.ok()) {
        if (*t == Type::kPred) return Error(m.line, ".param .pred is not allowed");
        param.type = *t;
      } else {
        return Error(m.line, absl::StrCat("unsupported parameter attribute '", m.text, "'"));
      }
    }
    const Token name = Next();
    if (name.kind != Token::Kind::kIdent || param.type == Type::kNone) {
      return Error(name.line, "expected '.param .<type> <name>'");
    }
    param.name = std::string(name.text);
    uint32_t count = 1;
    if (Peek().text == "[") {
      Next();
      absl::StatusOr<uint64_t> n = ParseIntegerLiteral(Next().text);
      if (!n.ok() || *n == 0 || *n > 4096) return Error(name.line, "bad parameter array size");
      count = static_cast<uint32_t>(*n);
      if (absl::Status s = Expect("]"); !s.ok()) return s;
    }
    const uint32_t elem = static_cast<uint32_t>(TypeBits(param.type) / 8);
    param.size = elem * count;
    param.align = align != 0 ? align : elem;
    entry.param_bytes = (entry.param_bytes + param.align - 1) / param.align * param.align;
    param.offset = entry.param_bytes;
    entry.param_bytes += param.size;
    for (const Param& other : entry.params) {
      if (other.name == param.name) {
        return Error(name.line, absl::StrCat("duplicate parameter '", param.name, "'"));
      }
    }
    entry.params.push_back(std::move(param));
    return absl::OkStatus();
  }

  absl::Status ParseBody(Entry& entry) {
    int depth = 1;
    while (true) {
      const Token& t = Peek();
      if (t.kind == Token::Kind::kEnd) return Error(t.line, "unterminated entry body");
      if (t.text == "{") {
        Next();
        ++depth;
        continue;
      }
      if (t.text == "}") {
        const uint32_t line = t.line;
        Next();
        if (--depth == 0) {
          Instruction exit;
          exit.op = Op::kExit;
          exit.line = line;
          entry.code.push_back(exit);  // falling off the end of an entry returns
          break;
        }
        continue;
      }
      if (t.kind == Token::Kind::kIdent && Peek(1).text == ":") {
        const std::string label(t.text);
        if (labels_.count(label) != 0)
          return Error(t.line, absl::StrCat("duplicate label '", label, "'"));
        labels_[label] = static_cast<uint32_t>(entry.code.size());
        Next();
        Next();
        continue;
      }
      if (t.text == ".reg") {
        if (absl::Status s = ParseRegDecl(); !s.ok()) return s;
        continue;
      }
      if (t.text == ".shared" || t.text == ".extern") {
        if (absl::Status s = ParseSharedDecl(entry); !s.ok()) return s;
        continue;
      }
      if (t.text == ".loc" || t.text == ".file") {
        SkipLine(t.line);
        continue;
      }
      if (t.text == ".pragma") {
        SkipStatement();
        continue;
      }
      if (t.text == ".local" || t.text == ".const" || t.text == ".global" || t.text == ".param") {
        return Error(t.line,
                     absl::StrCat("variables in ", t.text, " inside an entry are not supported"));
      }
      if (absl::Status s = ParseInstruction(entry); !s.ok()) return s;
    }
    // Dynamic shared memory starts after the static variables, 16-byte aligned.
    for (auto& [name, var] : shared_) {
      if (var.dynamic) var.offset = (entry.static_shared_bytes + 15) / 16 * 16;
    }
    for (Instruction& in : entry.code) {
      for (int k = 0; k < in.num_src; ++k) FixDynamicShared(in.src[k], entry);
      for (int k = 0; k < in.num_dst; ++k) FixDynamicShared(in.dst[k], entry);
    }
    for (const PendingBranch& b : branches_) {
      auto it = labels_.find(b.label);
      if (it == labels_.end()) return Error(b.line, absl::StrCat("unknown label '", b.label, "'"));
      entry.code[b.instruction].target = it->second;
    }
    return absl::OkStatus();
  }

  // Dynamic (extern) shared symbols are parsed before the static size is known; their operand
  // offsets carry a marker bit until here.
  static constexpr uint64_t kDynamicSharedMarker = uint64_t{1} << 62;
  void FixDynamicShared(Operand& o, const Entry& entry) {
    if ((o.kind == Operand::Kind::kAddress || o.kind == Operand::Kind::kImm) &&
        (o.imm & kDynamicSharedMarker) != 0) {
      o.imm = (o.imm & ~kDynamicSharedMarker) + (entry.static_shared_bytes + 15) / 16 * 16;
    }
  }

  absl::Status ParseRegDecl() {
    Next();  // .reg
    const Token type_token = Next();
    absl::StatusOr<Type> type = type_token.text.size() > 1 && type_token.text[0] == '.'
                                    ? TypeFromSuffix(type_token.text.substr(1))
                                    : absl::NotFoundError("");
    if (!type.ok()) {
      return Error(type_token.line,
                   absl::StrCat("unsupported register type '", type_token.text, "'"));
    }
    while (true) {
      const Token name = Next();
      if (name.kind != Token::Kind::kReg) {
        return Error(name.line, absl::StrCat("expected a register name, found '", name.text, "'"));
      }
      if (Peek().text == "<") {
        Next();
        absl::StatusOr<uint64_t> count = ParseIntegerLiteral(Next().text);
        if (!count.ok() || *count == 0 || *count > (1u << 20)) {
          return Error(name.line, "bad register count");
        }
        if (absl::Status s = Expect(">"); !s.ok()) return s;
        ranges_.push_back({std::string(name.text), static_cast<uint32_t>(*count), *type});
      } else {
        decls_[std::string(name.text)] = *type;
      }
      const Token sep = Next();
      if (sep.text == ";") break;
      if (sep.text != ",") return Error(sep.line, "expected ',' or ';' in .reg");
    }
    return absl::OkStatus();
  }

  // .shared .align 4 .b8 smem[128];   .extern .shared .align 16 .b8 dyn[];
  absl::Status ParseSharedDecl(Entry& entry) {
    bool is_extern = false;
    if (Peek().text == ".extern") {
      is_extern = true;
      Next();
    }
    const Token shared = Next();
    if (shared.text != ".shared") return Error(shared.line, "expected .shared after .extern");
    uint32_t align = 1;
    Type type = Type::kNone;
    while (Peek().kind == Token::Kind::kIdent && absl::StartsWith(Peek().text, ".")) {
      const Token m = Next();
      if (m.text == ".align") {
        if (absl::Status s = ParseAlign(m, &align); !s.ok()) return s;
      } else if (absl::StatusOr<Type> t = TypeFromSuffix(m.text.substr(1));
                 t.ok() && *t != Type::kPred) {
        type = *t;
      } else {
        return Error(m.line, absl::StrCat("unsupported .shared attribute '", m.text, "'"));
      }
    }
    const Token name = Next();
    if (name.kind != Token::Kind::kIdent || type == Type::kNone) {
      return Error(name.line, "expected '.shared [.align N] .<type> <name>[...]'");
    }
    uint64_t count = 1;
    bool dynamic = false;
    if (Peek().text == "[") {
      Next();
      if (Peek().text == "]") {
        dynamic = true;
      } else {
        absl::StatusOr<uint64_t> n = ParseIntegerLiteral(Next().text);
        if (!n.ok() || *n == 0 || *n > (1u << 20))
          return Error(name.line, "bad .shared array size");
        count = *n;
      }
      if (absl::Status s = Expect("]"); !s.ok()) return s;
    }
    if (absl::Status s = Expect(";"); !s.ok()) return s;
    if (dynamic != is_extern) {
      return Error(name.line,
                   "only '.extern .shared' arrays may be unsized (dynamic shared memory)");
    }
    SharedVar var{0, 0, dynamic};
    if (!dynamic) {
      var.offset = (entry.static_shared_bytes + align - 1) / align * align;
      var.size = static_cast<uint32_t>(count * (TypeBits(type) / 8));
      entry.static_shared_bytes = var.offset + var.size;
    }
    shared_[std::string(name.text)] = var;
    return absl::OkStatus();
  }

  // Slot of a declared register, assigned on first use.
  absl::StatusOr<uint32_t> RegSlot(const std::string& name, uint32_t line) {
    auto it = slot_of_.find(name);
    if (it != slot_of_.end()) return it->second;
    Type type = Type::kNone;
    auto d = decls_.find(name);
    if (d != decls_.end()) {
      type = d->second;
    } else {
      size_t digits = name.size();
      while (digits > 0 && std::isdigit(static_cast<unsigned char>(name[digits - 1]))) --digits;
      uint32_t index = 0;
      if (digits < name.size() && absl::SimpleAtoi(name.substr(digits), &index)) {
        const std::string prefix = name.substr(0, digits);
        for (const RangeDecl& r : ranges_) {
          if (r.prefix == prefix && index < r.count) type = r.type;
        }
      }
    }
    if (type == Type::kNone) {
      if (absl::StartsWith(name, "%tid") || absl::StartsWith(name, "%ctaid") ||
          absl::StartsWith(name, "%ntid") || absl::StartsWith(name, "%nctaid") ||
          absl::StartsWith(name, "%clock") || absl::StartsWith(name, "%smid") ||
          absl::StartsWith(name, "%globaltimer")) {
        return Error(line, absl::StrCat("unsupported special register '", name, "'"));
      }
      return Error(line, absl::StrCat("undeclared register '", name, "'"));
    }
    const uint32_t slot = static_cast<uint32_t>(entry_->reg_names.size());
    entry_->reg_names.push_back(name);
    entry_->reg_types.push_back(type);
    slot_of_[name] = slot;
    return slot;
  }

  absl::StatusOr<SynOperand> ParseOperand() {
    SynOperand o;
    const Token t = Next();
    o.line = t.line;
    if (t.text == "[") {
      o.kind = SynOperand::Kind::kAddress;
      const Token base = Next();
      if (base.kind == Token::Kind::kReg) {
        o.regs.push_back(std::string(base.text));
      } else if (base.kind == Token::Kind::kIdent) {
        o.text = std::string(base.text);
      } else if (base.kind == Token::Kind::kNumber) {
        absl::StatusOr<uint64_t> v = ParseIntegerLiteral(base.text);
        if (!v.ok()) return Error(base.line, v.status().message());
        o.offset = static_cast<int64_t>(*v);
      } else {
        return Error(base.line, absl::StrCat("bad address '", base.text, "'"));
      }
      if (Peek().text == "+" || Peek().text == "-") {
        bool negative = Next().text == "-";
        if (Peek().text == "-") {
          Next();
          negative = !negative;
        }
        const Token off = Next();
        absl::StatusOr<uint64_t> v = ParseIntegerLiteral(off.text);
        if (off.kind != Token::Kind::kNumber || !v.ok()) {
          return Error(off.line, absl::StrCat("bad address offset '", off.text, "'"));
        }
        o.offset += negative ? -static_cast<int64_t>(*v) : static_cast<int64_t>(*v);
      }
      if (absl::Status s = Expect("]"); !s.ok()) return s;
      return o;
    }
    if (t.text == "{") {
      o.kind = SynOperand::Kind::kVector;
      while (true) {
        const Token r = Next();
        if (r.kind != Token::Kind::kReg) {
          return Error(r.line,
                       absl::StrCat("expected a register in vector operand, found '", r.text, "'"));
        }
        o.regs.push_back(std::string(r.text));
        const Token sep = Next();
        if (sep.text == "}") break;
        if (sep.text != ",") return Error(sep.line, "expected ',' or '}' in vector operand");
      }
      if (o.regs.size() != 2 && o.regs.size() != 4) {
        return Error(t.line, "vector operands have 2 or 4 registers");
      }
      return o;
    }
    if (t.text == "!") {
      absl::StatusOr<Token> r = NextOfKind(Token::Kind::kReg, "a predicate after '!'");
      if (!r.ok()) return r.status();
      o.kind = SynOperand::Kind::kReg;
      o.negated = true;
      o.regs.push_back(std::string(r->text));
      return o;
    }
    if (t.text == "-") {
      absl::StatusOr<Token> num = NextOfKind(Token::Kind::kNumber, "a number after '-'");
      if (!num.ok()) return num.status();
      o.kind = SynOperand::Kind::kNumber;
      o.minus = true;
      o.text = std::string(num->text);
      return o;
    }
    if (t.kind == Token::Kind::kReg) {
      o.kind = SynOperand::Kind::kReg;
      o.regs.push_back(std::string(t.text));
      if (Peek().text == "|") {
        Next();
        absl::StatusOr<Token> r = NextOfKind(Token::Kind::kReg, "a predicate after '|'");
        if (!r.ok()) return r.status();
        o.regs.push_back(std::string(r->text));
      }
      return o;
    }
    if (t.kind == Token::Kind::kNumber) {
      o.kind = SynOperand::Kind::kNumber;
      o.text = std::string(t.text);
      return o;
    }
    if (t.kind == Token::Kind::kIdent) {
      o.kind = SynOperand::Kind::kSymbol;
      o.text = std::string(t.text);
      return o;
    }
    return Error(t.line, absl::StrCat("unexpected '", t.text, "' in operand list"));
  }

  // --- typed operand decoding -----------------------------------------------------------------

  absl::StatusOr<Operand> RegOperand(const std::string& name, Type type, uint32_t line,
                                     bool allow_wider) {
    absl::StatusOr<uint32_t> slot = RegSlot(name, line);
    if (!slot.ok()) return slot.status();
    const Type reg_type = entry_->reg_types[*slot];
    const bool want_pred = type == Type::kPred;
    if ((reg_type == Type::kPred) != want_pred) {
      return Error(line, absl::StrCat("register ", name, " is .", TypeName(reg_type),
                                      " but the operand is .", TypeName(type)));
    }
    if (!want_pred) {
      const int rb = TypeBits(reg_type);
      const int tb = TypeBits(type);
      if (!(rb == tb || (allow_wider && tb <= 16 && rb > tb))) {
        return Error(
            line, absl::StrCat("register ", name, " is .", TypeName(reg_type), " (", rb,
                               " bits) but the operand is .", TypeName(type), " (", tb, " bits)"));
      }
    }
    Operand o;
    o.kind = Operand::Kind::kReg;
    o.reg = *slot;
    return o;
  }

  absl::StatusOr<Operand> Dst(const SynOperand& s, Type type, bool allow_wider = false) {
    if (s.kind != SynOperand::Kind::kReg || s.regs.size() != 1 || s.negated) {
      return Error(s.line, "destination must be a register");
    }
    absl::StatusOr<Operand> o = RegOperand(s.regs[0], type, s.line, allow_wider);
    if (o.ok() && o->reg < kNumSpecialSlots)
      return Error(s.line, "special registers are read-only");
    return o;
  }

  absl::StatusOr<Operand> Src(const SynOperand& s, Type type, bool allow_wider = false) {
    if (s.kind == SynOperand::Kind::kReg) {
      if (s.regs.size() != 1) return Error(s.line, "'a|b' is only allowed as a destination");
      if (s.negated && type != Type::kPred) return Error(s.line, "'!' applies to predicates only");
      absl::StatusOr<Operand> o = RegOperand(s.regs[0], type, s.line, allow_wider);
      if (o.ok()) o->negated = s.negated;
      return o;
    }
    if (s.kind == SynOperand::Kind::kNumber) {
      if (type == Type::kPred) return Error(s.line, "a predicate operand cannot be a literal");
      Operand o;
      o.kind = Operand::Kind::kImm;
      if (IsFloat(type)) {
        bool is_float = false;
        absl::StatusOr<double> d = ParseFloatLiteral(s.text, &is_float);
        if (!d.ok()) return Error(s.line, d.status().message());
        double v = s.minus ? -*d : *d;
        if (type == Type::kF32) {
          o.imm = absl::bit_cast<uint32_t>(static_cast<float>(v));
        } else if (type == Type::kF64) {
          o.imm = absl::bit_cast<uint64_t>(v);
        } else {
          return Error(s.line,
                       absl::StrCat("literals of type .", TypeName(type), " are not supported"));
        }
      } else {
        absl::StatusOr<uint64_t> v = ParseIntegerLiteral(s.text);
        if (!v.ok()) return Error(s.line, v.status().message());
        o.imm = TruncateToType(s.minus ? ~*v + 1 : *v, type);
      }
      return o;
    }
    if (s.kind == SynOperand::Kind::kSymbol) {
      auto sh = shared_.find(s.text);
      if (sh != shared_.end()) {
        Operand o;
        o.kind = Operand::Kind::kImm;
        o.imm = sh->second.dynamic ? kDynamicSharedMarker : sh->second.offset;
        return o;
      }
      return Error(s.line,
                   absl::StrCat("'", s.text, "' is not a register, literal or .shared variable"));
    }
    return Error(s.line, "expected a register or literal operand");
  }

  absl::StatusOr<Operand> Address(const SynOperand& s, Space space, uint32_t access_bytes) {
    if (s.kind != SynOperand::Kind::kAddress) return Error(s.line, "expected an address '[...]'");
    Operand o;
    o.kind = Operand::Kind::kAddress;
    o.imm = static_cast<uint64_t>(s.offset);
    if (!s.regs.empty()) {
      if (space == Space::kParam)
        return Error(s.line, "ld.param takes a parameter name, not a register");
      absl::StatusOr<uint32_t> slot = RegSlot(s.regs[0], s.line);
      if (!slot.ok()) return slot.status();
      const Type t = entry_->reg_types[*slot];
      if (t == Type::kPred ||
          (TypeBits(t) != 64 && !(space == Space::kShared && TypeBits(t) == 32))) {
        return Error(s.line, absl::StrCat("address register ", s.regs[0],
                                          " must be 64-bit (32-bit for .shared)"));
      }
      o.reg = *slot;
      return o;
    }
    if (!s.text.empty()) {
      if (space == Space::kParam) {
        for (const Param& p : entry_->params) {
          if (p.name == s.text) {
            if (s.offset < 0 || s.offset + access_bytes > p.size) {
              return Error(s.line, absl::StrCat("access of ", access_bytes, " bytes at offset ",
                                                s.offset, " is outside parameter '", p.name, "' (",
                                                p.size, " bytes)"));
            }
            o.imm = p.offset + static_cast<uint64_t>(s.offset);
            return o;
          }
        }
        return Error(s.line, absl::StrCat("unknown parameter '", s.text, "'"));
      }
      auto sh = shared_.find(s.text);
      if (sh != shared_.end() && (space == Space::kShared || space == Space::kGeneric)) {
        if (space == Space::kGeneric) {
          return Error(
              s.line,
              "generic access to a .shared variable by name is not supported; use ld.shared");
        }
        o.imm = (sh->second.dynamic ? kDynamicSharedMarker : sh->second.offset) +
                static_cast<uint64_t>(s.offset);
        return o;
      }
      return Error(s.line, absl::StrCat("unknown symbol '", s.text, "' in address"));
    }
    if (space == Space::kParam) return Error(s.line, "ld.param needs a parameter name");
    return o;  // absolute address
  }

  // --- instructions ---------------------------------------------------------------------------

  absl::Status ParseInstruction(Entry& entry) {
    Instruction in;
    in.line = Peek().line;
    if (Peek().text == "@") {
      Next();
      bool negated = false;
      if (Peek().text == "!") {
        Next();
        negated = true;
      }
      absl::StatusOr<Token> p = NextOfKind(Token::Kind::kReg, "a predicate after '@'");
      if (!p.ok()) return p.status();
      absl::StatusOr<Operand> guard = RegOperand(std::string(p->text), Type::kPred, p->line, false);
      if (!guard.ok()) return guard.status();
      in.guard = guard->reg;
      in.guard_negated = negated;
    }
    const Token opcode = Next();
    if (opcode.kind != Token::Kind::kIdent || opcode.text[0] == '.') {
      return Error(opcode.line, absl::StrCat("expected an instruction, found '", opcode.text, "'"));
    }
    std::vector<SynOperand> ops;
    while (Peek().text != ";") {
      if (Peek().kind == Token::Kind::kEnd || Peek().text == "}") {
        return Error(opcode.line, absl::StrCat("missing ';' after '", opcode.text, "'"));
      }
      if (!ops.empty()) {
        if (absl::Status s = Expect(","); !s.ok()) return s;
      }
      absl::StatusOr<SynOperand> o = ParseOperand();
      if (!o.ok()) return o.status();
      ops.push_back(*std::move(o));
    }
    Next();  // ;
    if (absl::Status s = Decode(opcode.text, ops, in); !s.ok()) return s;
    entry.code.push_back(in);
    return absl::OkStatus();
  }

  absl::Status Decode(absl::string_view opcode, const std::vector<SynOperand>& ops,
                      Instruction& in) {
    const uint32_t line = in.line;
    std::vector<absl::string_view> parts = absl::StrSplit(opcode, '.');
    const absl::string_view base = parts[0];
    std::vector<Type> types;
    bool rn = false;
    MulMode mul = MulMode::kNone;
    bool have_cmp = false;
    Cmp cmp = Cmp::kEq;
    bool have_shfl = false;
    ShflMode shfl = ShflMode::kDown;
    bool have_atom = false;
    AtomOp atom = AtomOp::kAdd;
    bool to = false;
    bool sync = false;
    bool full = false;
    auto unsupported = [&](absl::string_view why) {
      return Error(line, absl::StrCat("unsupported instruction '", opcode, "': ", why));
    };
    for (size_t k = 1; k < parts.size(); ++k) {
      const absl::string_view m = parts[k];
      if (absl::StatusOr<Type> t = TypeFromSuffix(m); t.ok()) {
        types.push_back(*t);
      } else if (m == "param") {
        in.space = Space::kParam;
      } else if (m == "global") {
        in.space = Space::kGlobal;
      } else if (m == "shared") {
        in.space = Space::kShared;
      } else if (m == "local" || m == "const" || m == "tex" || m == "surf") {
        return unsupported(absl::StrCat("state space .", m, " is not supported"));
      } else if (m == "v2" || m == "v4") {
        in.vec = m == "v2" ? 2 : 4;
      } else if (m == "rn" || m == "rz" || m == "rm" || m == "rp") {
        rn = true;  // a floating-point rounding modifier is present
        in.rounding = m == "rn"   ? FloatRound::kRn
                      : m == "rz" ? FloatRound::kRz
                      : m == "rm" ? FloatRound::kRm
                                  : FloatRound::kRp;
      } else if (m == "rni" || m == "rzi" || m == "rmi" || m == "rpi") {
        in.mode = static_cast<uint8_t>(m == "rni"   ? IntRound::kRni
                                       : m == "rzi" ? IntRound::kRzi
                                       : m == "rmi" ? IntRound::kRmi
                                                    : IntRound::kRpi);
      } else if (m == "ftz") {
        in.ftz = true;
      } else if (m == "sat") {
        in.sat = true;
      } else if (m == "approx") {
        in.approx = true;
      } else if (m == "full") {
        full = true;
        in.approx = true;
      } else if (m == "lo" && base != "setp") {
        mul = MulMode::kLo;
      } else if (m == "hi" && base != "setp") {
        mul = MulMode::kHi;
      } else if (m == "wide") {
        mul = MulMode::kWide;
      } else if (m == "uni") {
        in.uni = true;
      } else if (m == "sync" || m == "aligned" || m == "cta") {
        sync = sync || m == "sync";
      } else if (m == "to") {
        to = true;
      } else if (base == "setp" && (m == "and" || m == "or" || m == "xor")) {
        in.bool_op = m == "and" ? BoolOp::kAnd : m == "or" ? BoolOp::kOr : BoolOp::kXor;
      } else if (base == "setp") {
        static const std::pair<const char*, Cmp> kCmps[] = {
            {"eq", Cmp::kEq},   {"ne", Cmp::kNe},   {"lt", Cmp::kLt},   {"le", Cmp::kLe},
            {"gt", Cmp::kGt},   {"ge", Cmp::kGe},   {"lo", Cmp::kLo},   {"ls", Cmp::kLs},
            {"hi", Cmp::kHi},   {"hs", Cmp::kHs},   {"equ", Cmp::kEqu}, {"neu", Cmp::kNeu},
            {"ltu", Cmp::kLtu}, {"leu", Cmp::kLeu}, {"gtu", Cmp::kGtu}, {"geu", Cmp::kGeu},
            {"num", Cmp::kNum}, {"nan", Cmp::kNan}};
        bool found = false;
        for (const auto& [name, c] : kCmps) {
          if (m == name) {
            cmp = c;
            found = true;
          }
        }
        if (!found || have_cmp) return unsupported(absl::StrCat("bad comparison .", m));
        have_cmp = true;
      } else if (base == "shfl" && (m == "up" || m == "down" || m == "bfly" || m == "idx")) {
        shfl = m == "up"     ? ShflMode::kUp
               : m == "down" ? ShflMode::kDown
               : m == "bfly" ? ShflMode::kBfly
                             : ShflMode::kIdx;
        have_shfl = true;
      } else if ((base == "atom" || base == "red") &&
                 (m == "add" || m == "min" || m == "max" || m == "exch" || m == "cas" ||
                  m == "and" || m == "or" || m == "xor" || m == "inc" || m == "dec")) {
        static const std::pair<const char*, AtomOp> kAtoms[] = {
            {"add", AtomOp::kAdd},   {"min", AtomOp::kMin}, {"max", AtomOp::kMax},
            {"exch", AtomOp::kExch}, {"cas", AtomOp::kCas}, {"and", AtomOp::kAnd},
            {"or", AtomOp::kOr},     {"xor", AtomOp::kXor}, {"inc", AtomOp::kInc},
            {"dec", AtomOp::kDec}};
        for (const auto& [name, a] : kAtoms) {
          if (m == name) atom = a;
        }
        have_atom = true;
      } else if (m == "nc" || m == "ca" || m == "cg" || m == "cs" || m == "lu" || m == "cv" ||
                 m == "wb" || m == "wt" || m == "volatile" || m == "relaxed" || m == "acquire" ||
                 m == "release" || m == "acq_rel" || m == "sc" || m == "gpu" || m == "sys" ||
                 m == "gl" || absl::StartsWith(m, "L1::") || absl::StartsWith(m, "L2::")) {
        continue;  // cache and memory-order qualifiers: the interpreter is sequentially consistent
      } else {
        return unsupported(absl::StrCat("unknown modifier .", m));
      }
    }
    auto need_ops = [&](size_t n) -> absl::Status {
      if (ops.size() != n) {
        return Error(line,
                     absl::StrCat("'", opcode, "' takes ", n, " operands, found ", ops.size()));
      }
      return absl::OkStatus();
    };
    auto need_type = [&]() -> absl::Status {
      if (types.size() != 1) return unsupported("expected exactly one type suffix");
      in.type = types[0];
      if (in.type == Type::kF16 || in.type == Type::kBF16) {
        return unsupported("f16/bf16 arithmetic is not supported (convert to f32)");
      }
      return absl::OkStatus();
    };
    auto set_dst = [&](int k, absl::StatusOr<Operand> o) -> absl::Status {
      if (!o.ok()) return o.status();
      in.dst[k] = *o;
      in.num_dst = static_cast<uint8_t>(std::max<int>(in.num_dst, k + 1));
      return absl::OkStatus();
    };
    auto set_src = [&](int k, absl::StatusOr<Operand> o) -> absl::Status {
      if (!o.ok()) return o.status();
      in.src[k] = *o;
      in.num_src = static_cast<uint8_t>(std::max<int>(in.num_src, k + 1));
      return absl::OkStatus();
    };
    // ops[0] as the destination of `dst_type`, ops[1 + k] as source k of src_types[k].
    auto set_dst_and_srcs = [&](Type dst_type,
                                std::initializer_list<Type> src_types) -> absl::Status {
      if (absl::Status s = set_dst(0, Dst(ops[0], dst_type)); !s.ok()) return s;
      int k = 0;
      for (Type t : src_types) {
        if (absl::Status s = set_src(k, Src(ops[1 + k], t)); !s.ok()) return s;
        ++k;
      }
      return absl::OkStatus();
    };
#define NG_TRY(expr)                                   \
  do {                                                 \
    if (absl::Status s_ = (expr); !s_.ok()) return s_; \
  } while (0)

    if (base == "ld" || base == "st") {
      const bool is_ld = base == "ld";
      in.op = is_ld ? Op::kLd : Op::kSt;
      NG_TRY(need_ops(2));
      if (types.size() != 1) return unsupported("expected exactly one type suffix");
      in.type = types[0];
      if (in.type == Type::kPred) return unsupported(".pred cannot be loaded or stored");
      if (in.space == Space::kNone) in.space = Space::kGeneric;
      if (in.space == Space::kParam && (!is_ld || in.vec != 1)) {
        return unsupported("only scalar ld.param is supported");
      }
      const uint32_t bytes = static_cast<uint32_t>(TypeBits(in.type) / 8) * in.vec;
      const SynOperand& value = is_ld ? ops[0] : ops[1];
      NG_TRY(set_src(is_ld ? 0 : 0, Address(is_ld ? ops[1] : ops[0], in.space, bytes)));
      if (in.vec == 1) {
        if (value.kind == SynOperand::Kind::kVector)
          return unsupported("vector operand without .v2/.v4");
        if (is_ld) {
          NG_TRY(set_dst(0, Dst(value, in.type, true)));
        } else {
          NG_TRY(set_src(1, Src(value, in.type, true)));
        }
      } else {
        if (value.kind != SynOperand::Kind::kVector || value.regs.size() != in.vec) {
          return Error(line, absl::StrCat("'", opcode, "' needs a {..} operand of ", int{in.vec},
                                          " registers"));
        }
        for (int k = 0; k < in.vec; ++k) {
          const SynOperand r = RegisterOperand(value.regs[k], line);
          if (is_ld) {
            NG_TRY(set_dst(k, Dst(r, in.type, true)));
          } else {
            NG_TRY(set_src(1 + k, Src(r, in.type, true)));
          }
        }
      }
      return absl::OkStatus();
    }
    if (base == "mov") {
      in.op = Op::kMov;
      NG_TRY(need_ops(2));
      if (types.size() != 1) return unsupported("expected exactly one type suffix");
      in.type = types[0];
      NG_TRY(set_dst_and_srcs(in.type, {in.type}));
      return absl::OkStatus();
    }
    struct Arith {
      const char* name;
      Op op;
      int sources;
    };
    static const Arith kArith[] = {
        {"add", Op::kAdd, 2},     {"sub", Op::kSub, 2}, {"mul", Op::kMul, 2},
        {"mad", Op::kMad, 3},     {"fma", Op::kFma, 3}, {"div", Op::kDiv, 2},
        {"rem", Op::kRem, 2},     {"min", Op::kMin, 2}, {"max", Op::kMax, 2},
        {"neg", Op::kNeg, 1},     {"abs", Op::kAbs, 1}, {"and", Op::kAnd, 2},
        {"or", Op::kOr, 2},       {"xor", Op::kXor, 2}, {"not", Op::kNot, 1},
        {"cnot", Op::kCnot, 1},   {"shl", Op::kShl, 2}, {"shr", Op::kShr, 2},
        {"popc", Op::kPopc, 1},   {"clz", Op::kClz, 1}, {"sqrt", Op::kSqrt, 1},
        {"rsqrt", Op::kRsqrt, 1}, {"rcp", Op::kRcp, 1}, {"ex2", Op::kEx2, 1},
        {"lg2", Op::kLg2, 1},
    };
    for (const Arith& a : kArith) {
      if (base != a.name) continue;
      in.op = a.op;
      NG_TRY(need_ops(1 + a.sources));
      NG_TRY(need_type());
      const bool is_float = IsFloat(in.type);
      const bool logic = a.op == Op::kAnd || a.op == Op::kOr || a.op == Op::kXor ||
                         a.op == Op::kNot || a.op == Op::kCnot;
      if (logic && is_float) return unsupported("logic operations take .b/.u/.s types or .pred");
      if (in.type == Type::kPred && !logic)
        return unsupported(".pred is only valid for and/or/xor/not");
      const bool float_only = a.op == Op::kFma || a.op == Op::kSqrt || a.op == Op::kRsqrt ||
                              a.op == Op::kRcp || a.op == Op::kEx2 || a.op == Op::kLg2;
      if (float_only && !is_float) return unsupported("needs a floating-point type");
      const bool int_only = a.op == Op::kRem || a.op == Op::kShl || a.op == Op::kShr ||
                            a.op == Op::kPopc || a.op == Op::kClz;
      if (int_only && is_float) return unsupported("needs an integer type");
      if (is_float) {
        if (mul != MulMode::kNone) return unsupported(".lo/.hi/.wide apply to integer types");
        if (in.type == Type::kF64 && (in.approx && a.op != Op::kRsqrt && a.op != Op::kRcp)) {
          return unsupported(".approx f64 is only valid for rcp/rsqrt");
        }
        const bool needs_rounding =
            (a.op == Op::kDiv || a.op == Op::kSqrt || a.op == Op::kRcp) && !in.approx;
        if (needs_rounding && !rn) return unsupported("needs .rn or .approx");
        if ((a.op == Op::kFma || (a.op == Op::kMad && is_float)) && !rn) {
          return unsupported("needs a rounding modifier (.rn)");
        }
        const bool approx_only = a.op == Op::kRsqrt || a.op == Op::kEx2 || a.op == Op::kLg2;
        if (approx_only && !in.approx) return unsupported("needs .approx");
        if (full && a.op != Op::kDiv) return unsupported(".full applies to div only");
        const bool directed_ok =
            in.type == Type::kF32 && !in.approx &&
            (a.op == Op::kAdd || a.op == Op::kSub || a.op == Op::kMul || a.op == Op::kDiv ||
             a.op == Op::kSqrt || a.op == Op::kRcp || a.op == Op::kFma || a.op == Op::kMad);
        if (in.rounding != FloatRound::kRn && !directed_ok) {
          return unsupported(
              "rounding .rz/.rm/.rp is supported on f32 add/sub/mul/div/sqrt/rcp/fma only");
        }
      } else {
        if (rn || in.approx || in.ftz)
          return unsupported("rounding/.approx/.ftz apply to floating-point types");
        if (in.sat && !(in.type == Type::kS32 &&
                        (a.op == Op::kAdd || a.op == Op::kSub || a.op == Op::kMad))) {
          return unsupported(".sat on integers is only valid for add/sub/mad .s32");
        }
        if (a.op == Op::kMul || a.op == Op::kMad) {
          if (mul == MulMode::kNone) return unsupported("integer mul/mad need .lo, .hi or .wide");
          if (mul == MulMode::kWide && TypeBits(in.type) == 64)
            return unsupported(".wide needs a 16- or 32-bit type");
        } else if (mul != MulMode::kNone) {
          return unsupported(".lo/.hi/.wide apply to mul/mad only");
        }
      }
      in.mode = static_cast<uint8_t>(mul);
      Type dst_type = in.type;
      if (mul == MulMode::kWide) {
        dst_type = in.type == Type::kU32   ? Type::kU64
                   : in.type == Type::kS32 ? Type::kS64
                   : in.type == Type::kU16 ? Type::kU32
                                           : Type::kS32;
      }
      NG_TRY(set_dst(0, Dst(ops[0], dst_type)));
      for (int k = 0; k < a.sources; ++k) {
        Type t = in.type;
        if ((a.op == Op::kShl || a.op == Op::kShr) && k == 1) t = Type::kU32;
        if (a.op == Op::kMad && mul == MulMode::kWide && k == 2) t = dst_type;
        NG_TRY(set_src(k, Src(ops[1 + k], t)));
      }
      if ((a.op == Op::kPopc || a.op == Op::kClz) && TypeBits(in.type) == 64) {
        // Result is .u32 even for 64-bit sources.
        return unsupported("64-bit popc/clz are not supported");
      }
      return absl::OkStatus();
    }
    if (base == "setp") {
      in.op = Op::kSetp;
      if (!have_cmp) return unsupported("missing comparison");
      NG_TRY(need_type());
      in.mode = static_cast<uint8_t>(cmp);
      const bool float_cmp = cmp >= Cmp::kEqu;
      if (float_cmp && !IsFloat(in.type))
        return unsupported("unordered comparisons need a float type");
      if ((cmp == Cmp::kLo || cmp == Cmp::kLs || cmp == Cmp::kHi || cmp == Cmp::kHs) &&
          IsFloat(in.type)) {
        return unsupported("lo/ls/hi/hs need an integer type");
      }
      NG_TRY(need_ops(in.bool_op == BoolOp::kNone ? 3 : 4));
      const SynOperand& d = ops[0];
      if (d.kind != SynOperand::Kind::kReg || d.negated)
        return Error(line, "setp writes a predicate");
      for (size_t k = 0; k < d.regs.size(); ++k) {
        NG_TRY(set_dst(static_cast<int>(k), Dst(RegisterOperand(d.regs[k], line), Type::kPred)));
      }
      NG_TRY(set_src(0, Src(ops[1], in.type)));
      NG_TRY(set_src(1, Src(ops[2], in.type)));
      if (in.bool_op != BoolOp::kNone) NG_TRY(set_src(2, Src(ops[3], Type::kPred)));
      return absl::OkStatus();
    }
    if (base == "selp") {
      in.op = Op::kSelp;
      NG_TRY(need_ops(4));
      NG_TRY(need_type());
      NG_TRY(set_dst_and_srcs(in.type, {in.type, in.type, Type::kPred}));
      return absl::OkStatus();
    }
    if (base == "cvt") {
      in.op = Op::kCvt;
      NG_TRY(need_ops(2));
      if (types.size() != 2) return unsupported("cvt needs a destination and a source type");
      in.type = types[0];
      in.src_type = types[1];
      if (in.type == Type::kPred || in.src_type == Type::kPred) return unsupported("cvt of .pred");
      const bool fd = IsFloat(in.type);
      const bool fs = IsFloat(in.src_type);
      const IntRound ir = static_cast<IntRound>(in.mode);
      if (fd && fs) {
        const bool narrowing = TypeBits(in.type) < TypeBits(in.src_type);
        if (ir != IntRound::kNone) {
          if (in.type != in.src_type)
            return unsupported("integer rounding between different float types");
        } else if (narrowing && !rn) {
          return unsupported("narrowing float conversion needs .rn");
        } else if (!narrowing && rn) {
          return unsupported("widening float conversion takes no rounding modifier");
        }
      } else if (fd && !fs) {
        if (!rn)
          return unsupported(
              "integer-to-float conversion needs a rounding modifier (.rn/.rz/.rm/.rp)");
      } else if (!fd && fs) {
        if (ir == IntRound::kNone)
          return unsupported("float-to-integer conversion needs .rni/.rzi/.rmi/.rpi");
      } else if (rn || ir != IntRound::kNone) {
        return unsupported("integer-to-integer conversion takes no rounding modifier");
      }
      if (in.rounding != FloatRound::kRn && in.type != Type::kF32 && in.type != Type::kF64) {
        return unsupported("rounding .rz/.rm/.rp converts to f32 or f64 only");
      }
      NG_TRY(set_dst(0, Dst(ops[0], in.type, true)));
      NG_TRY(set_src(0, Src(ops[1], in.src_type, true)));
      return absl::OkStatus();
    }
    if (base == "cvta") {
      in.op = Op::kCvta;
      NG_TRY(need_ops(2));
      if (types.size() != 1 || (types[0] != Type::kU64 && types[0] != Type::kB64)) {
        return unsupported("cvta needs .u64");
      }
      if (in.space != Space::kGlobal && in.space != Space::kShared) {
        return unsupported("cvta supports .global and .shared");
      }
      in.type = Type::kU64;
      in.mode = to ? 1 : 0;
      NG_TRY(set_dst_and_srcs(in.type, {in.type}));
      return absl::OkStatus();
    }
    if (base == "bra") {
      in.op = Op::kBra;
      NG_TRY(need_ops(1));
      if (ops[0].kind != SynOperand::Kind::kSymbol) return Error(line, "bra takes a label");
      branches_.push_back({entry_->code.size(), ops[0].text, line});
      return absl::OkStatus();
    }
    if (base == "ret" || base == "exit") {
      in.op = Op::kExit;
      NG_TRY(need_ops(0));
      return absl::OkStatus();
    }
    if (base == "bar" || base == "barrier") {
      in.op = Op::kBar;
      if (!sync && base == "bar") return unsupported("only bar.sync / barrier.sync are supported");
      if (ops.size() != 1) return unsupported("barriers with a thread count are not supported");
      NG_TRY(set_src(0, Src(ops[0], Type::kU32)));
      if (in.src[0].kind != Operand::Kind::kImm || in.src[0].imm > 15) {
        return unsupported("barrier id must be a literal 0..15");
      }
      return absl::OkStatus();
    }
    if (base == "membar" || base == "fence") {
      in.op = Op::kNop;
      NG_TRY(need_ops(0));
      return absl::OkStatus();
    }
    if (base == "shfl") {
      in.op = Op::kShfl;
      if (!sync) return unsupported("shfl without .sync is not supported (removed in sm_70)");
      if (!have_shfl) return unsupported("missing .up/.down/.bfly/.idx");
      if (types.size() != 1 || TypeBits(types[0]) != 32 || IsFloat(types[0]) ||
          types[0] == Type::kS32) {
        return unsupported("shfl.sync needs .b32");
      }
      in.type = Type::kB32;
      in.mode = static_cast<uint8_t>(shfl);
      NG_TRY(need_ops(5));
      const SynOperand& d = ops[0];
      if (d.kind != SynOperand::Kind::kReg || d.negated)
        return Error(line, "shfl writes a register");
      NG_TRY(set_dst(0, Dst(RegisterOperand(d.regs[0], line), Type::kB32)));
      if (d.regs.size() == 2) {
        NG_TRY(set_dst(1, Dst(RegisterOperand(d.regs[1], line), Type::kPred)));
      }
      for (int k = 0; k < 4; ++k) NG_TRY(set_src(k, Src(ops[1 + k], Type::kB32)));
      return absl::OkStatus();
    }
    if (base == "atom" || base == "red") {
      const bool is_atom = base == "atom";
      in.op = is_atom ? Op::kAtom : Op::kRed;
      if (!have_atom) return unsupported("missing the operation (.add, .min, ...)");
      if (in.space != Space::kGlobal && in.space != Space::kShared) {
        return unsupported("atomics need .global or .shared");
      }
      if (types.size() != 1) return unsupported("expected exactly one type suffix");
      in.type = types[0];
      in.mode = static_cast<uint8_t>(atom);
      const int bits = TypeBits(in.type);
      if (bits != 32 && bits != 64) return unsupported("atomics need a 32- or 64-bit type");
      if (IsFloat(in.type) && atom != AtomOp::kAdd && atom != AtomOp::kExch) {
        return unsupported("float atomics support .add and .exch");
      }
      if (!is_atom && (atom == AtomOp::kExch || atom == AtomOp::kCas))
        return unsupported("red has no exch/cas");
      const int sources = atom == AtomOp::kCas ? 2 : 1;
      NG_TRY(need_ops((is_atom ? 2 : 1) + sources));
      const int first = is_atom ? 1 : 0;
      if (is_atom) NG_TRY(set_dst(0, Dst(ops[0], in.type)));
      NG_TRY(set_src(0, Address(ops[first], in.space, static_cast<uint32_t>(bits / 8))));
      for (int k = 0; k < sources; ++k) NG_TRY(set_src(1 + k, Src(ops[first + 1 + k], in.type)));
      return absl::OkStatus();
    }
#undef NG_TRY
    return Error(line, absl::StrCat("unsupported instruction '", opcode, "'"));
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  Entry* entry_ = nullptr;
  std::unordered_map<std::string, Type> decls_;
  std::vector<RangeDecl> ranges_;
  std::unordered_map<std::string, uint32_t> slot_of_;
  std::unordered_map<std::string, SharedVar> shared_;
  std::unordered_map<std::string, uint32_t> labels_;
  std::vector<PendingBranch> branches_;
};

}  // namespace

absl::StatusOr<Module> ParsePtx(absl::string_view text) {
  absl::StatusOr<std::vector<Token>> tokens = Lex(text);
  if (!tokens.ok()) return tokens.status();
  Parser parser(*std::move(tokens));
  return parser.Run();
}

}  // namespace normgrad::ptxsim
