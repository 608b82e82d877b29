// Messages whose large bytes fields (x, dy, rms, grad_input) travel without copies: the bytes on
// the wire are the message's ordinary protobuf encoding (any gRPC stack written against
// normgrad.proto reads and writes them), but this side never copies a bulk field into or out of
// a protobuf string.
//
//   Sending:   the message is serialized without its bulk fields, and each bulk field follows as
//              its tag, its length and a gRPC slice that points at the caller's bytes (protobuf
//              accepts fields in any order). `keep_alive` is held by every such slice and dropped
//              when gRPC releases the last one.
//   Receiving: the bulk fields are found where gRPC received them (pieces of its slices, which
//              the ReceivedBytes keeps) and every other field is parsed into the message.
//
//   std::vector<BulkField> bulk = {{2, x_bytes}, {3, dy_bytes}};
//   grpc::ByteBuffer b = EncodeWithBulk(small_request, bulk, pin);
//   ReceivedBytes dx;
//   if (!DecodeWithBulk(b, &small_response, {{3, &dx}})) ...;   // not a valid message
//   dx.CopyTo(destination);
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"

namespace normgrad::v1 {

// A length-delimited field sent from where its bytes are. Empty fields are not sent (proto3).
struct BulkField {
  uint32_t number = 0;
  absl::Span<const uint8_t> bytes;
};

// `message` (whose own bulk fields are empty) serialized, then each field of `bulk`. The bulk
// bytes are not copied: they must stay valid and unchanged until gRPC released every slice,
// which it tells by dropping its copies of `keep_alive` (the last one runs its deleter).
grpc::ByteBuffer EncodeWithBulk(const google::protobuf::MessageLite& message,
                                absl::Span<const BulkField> bulk,
                                std::shared_ptr<const void> keep_alive);

// A bytes field as received: its pieces, in order, in slices this object holds.
class ReceivedBytes {
 public:
  bool present() const { return present_; }
  uint64_t size() const { return size_; }
  const std::vector<absl::Span<const uint8_t>>& pieces() const { return pieces_; }
  // The bytes in one piece (no copy needed), or empty when there are several.
  absl::Span<const uint8_t> Contiguous() const {
    return pieces_.size() == 1 ? pieces_.front() : absl::Span<const uint8_t>();
  }
  // Copies the bytes to `to`, which holds exactly size() bytes.
  void CopyTo(uint8_t* to) const;
  void Clear();

 private:
  friend bool DecodeWithBulk(const grpc::ByteBuffer&, google::protobuf::MessageLite*,
                             absl::Span<const std::pair<uint32_t, ReceivedBytes*>>);
  bool present_ = false;
  uint64_t size_ = 0;
  std::vector<absl::Span<const uint8_t>> pieces_;
  std::shared_ptr<const std::vector<grpc::Slice>> slices_;  // keeps the pieces valid
};

// Parses `buffer` (not consumed): each field number of `bulk` that arrives length-delimited is
// left where it is, in its ReceivedBytes (the last occurrence wins, as protobuf's own parser
// decides); every other field, and a bulk number with another wire type, goes to `message`.
// False when the bytes are not a valid protobuf message (a truncated varint or field, a
// group, a wrong wire type) or `message` rejects its part.
bool DecodeWithBulk(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message,
                    absl::Span<const std::pair<uint32_t, ReceivedBytes*>> bulk);

}  // namespace normgrad::v1
