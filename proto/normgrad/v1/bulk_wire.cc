#include "proto/normgrad/v1/bulk_wire.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace normgrad::v1 {
namespace {

constexpr uint32_t kLengthDelimited = 2;

void AppendVarint(uint64_t v, std::string& out) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// The destroy callback of a bulk slice: drops that slice's copy of the keep-alive.
void DropKeepAlive(void* user_data) { delete static_cast<std::shared_ptr<const void>*>(user_data); }

// Reads a message laid out over gRPC's slices, byte by byte or piece by piece.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { Skip(); }

  bool ReadByte(uint8_t* b) {
    if (at_end()) return false;
    *b = slices_[slice_].begin()[offset_];
    ++offset_;
    Skip();
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  // The next `n` bytes as pieces of the slices (appended to `pieces`), or false when fewer remain.
  bool Take(uint64_t n, std::vector<absl::Span<const uint8_t>>* pieces) {
    while (n > 0) {
      if (at_end()) return false;
      const grpc::Slice& s = slices_[slice_];
      const uint64_t here = std::min<uint64_t>(n, s.size() - offset_);
      pieces->emplace_back(s.begin() + offset_, here);
      offset_ += here;
      n -= here;
      Skip();
    }
    return true;
  }

  bool at_end() const { return slice_ == slices_.size(); }

 private:
  // Moves past exhausted (and empty) slices.
  void Skip() {
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
};

void AppendPieces(const std::vector<absl::Span<const uint8_t>>& pieces, std::string& out) {
  for (const absl::Span<const uint8_t>& p : pieces) {
    out.append(reinterpret_cast<const char*>(p.data()), p.size());
  }
}

}  // namespace

grpc::ByteBuffer EncodeWithBulk(const google::protobuf::MessageLite& message,
                                absl::Span<const BulkField> bulk,
                                std::shared_ptr<const void> keep_alive) {
  std::vector<grpc::Slice> slices;
  slices.reserve(1 + 2 * bulk.size());
  std::string head = message.SerializeAsString();
  for (const BulkField& f : bulk) {
    if (f.bytes.empty()) continue;
    AppendVarint((uint64_t{f.number} << 3) | kLengthDelimited, head);
    AppendVarint(f.bytes.size(), head);
    slices.emplace_back(head);  // the message so far and this field's tag and length
    head.clear();
    // gRPC owns one copy of the keep-alive per slice and deletes it with the slice.
    auto* hold = new std::shared_ptr<const void>(keep_alive);
    slices.emplace_back(const_cast<uint8_t*>(f.bytes.data()), f.bytes.size(), &DropKeepAlive,
                        hold);
  }
  if (!head.empty() || slices.empty()) slices.emplace_back(head);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void ReceivedBytes::CopyTo(uint8_t* to) const {
  for (const absl::Span<const uint8_t>& p : pieces_) {
    std::memcpy(to, p.data(), p.size());
    to += p.size();
  }
}

void ReceivedBytes::Clear() {
  present_ = false;
  size_ = 0;
  pieces_.clear();
  slices_.reset();
}

bool DecodeWithBulk(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message,
                    absl::Span<const std::pair<uint32_t, ReceivedBytes*>> bulk) {
  for (const auto& [number, out] : bulk) out->Clear();
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!buffer.Dump(slices.get()).ok()) return false;
  SliceCursor in(*slices);
  std::string rest;  // every field that is not a bulk one, as it came
  std::vector<absl::Span<const uint8_t>> pieces;
  while (!in.at_end()) {
    uint64_t tag;
    if (!in.ReadVarint(&tag) || tag > 0xffffffffu) return false;
    const uint32_t number = static_cast<uint32_t>(tag >> 3);
    const uint32_t wire_type = static_cast<uint32_t>(tag & 7);
    if (number == 0) return false;
    ReceivedBytes* target = nullptr;
    if (wire_type == kLengthDelimited) {
      for (const auto& [n, out] : bulk) {
        if (n == number) target = out;
      }
    }
    pieces.clear();
    switch (wire_type) {
      case 0: {  // varint
        uint64_t v;
        if (!in.ReadVarint(&v)) return false;
        AppendVarint(tag, rest);
        AppendVarint(v, rest);
        break;
      }
      case 1:    // fixed64
      case 5: {  // fixed32
        if (!in.Take(wire_type == 1 ? 8 : 4, &pieces)) return false;
        AppendVarint(tag, rest);
        AppendPieces(pieces, rest);
        break;
      }
      case kLengthDelimited: {
        uint64_t length;
        if (!in.ReadVarint(&length) || !in.Take(length, &pieces)) return false;
        if (target != nullptr) {  // the last occurrence wins
          target->present_ = true;
          target->size_ = length;
          target->pieces_ = pieces;
          target->slices_ = slices;
        } else {
          AppendVarint(tag, rest);
          AppendVarint(length, rest);
          AppendPieces(pieces, rest);
        }
        break;
      }
      default:  // groups (3, 4) and the undefined wire types
        return false;
    }
  }
  return message->ParseFromString(rest);
}

}  // namespace normgrad::v1
