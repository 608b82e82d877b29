// proto/normgrad/v1/bulk_wire.h: messages whose row bytes travel without copies must be, on the
// wire, exactly what protobuf's own encoder and parser agree on, while their bulk fields stay in
// the caller's memory (sending) or in gRPC's slices (receiving).
#include "proto/normgrad/v1/bulk_wire.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include "normgrad/v1/normgrad.pb.h"

namespace normgrad::v1 {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31);
  return v;
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` cut into slices at the given lengths (the rest in one last slice).
grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t n : cuts) {
    n = std::min(n, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string ToString(const ReceivedBytes& r) {
  std::string out(r.size(), '\0');
  r.CopyTo(reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

BackwardRequest Header() {
  BackwardRequest r;
  r.mutable_header()->set_num_rows(3);
  r.mutable_header()->set_hidden_dim(896);
  r.mutable_header()->set_eps(1e-5f);
  r.mutable_header()->set_gamma(std::string(896 * 4, 'g'));
  return r;
}

TEST(BulkWireTest, BulkSlicesPointIntoTheCallersMemory) {
  const std::vector<uint8_t> x = Bytes(3 * 896 * 4, 1), dy = Bytes(3 * 896 * 4, 2);
  BackwardRequest small;
  small.set_rms(std::string(12, 'r'));
  const BulkField bulk[] = {{BackwardRequest::kXFieldNumber, x},
                            {BackwardRequest::kDyFieldNumber, dy}};
  const grpc::ByteBuffer b = EncodeWithBulk(small, bulk, std::make_shared<int>(0));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(b.Dump(&slices).ok());
  int pointing_in = 0;
  for (const grpc::Slice& s : slices) {
    if (s.begin() == x.data() && s.size() == x.size()) ++pointing_in;
    if (s.begin() == dy.data() && s.size() == dy.size()) ++pointing_in;
  }
  EXPECT_EQ(pointing_in, 2) << "x and dy were copied instead of lent";
}

TEST(BulkWireTest, EncodedBytesAreTheMessageToProtobuf) {
  const std::vector<uint8_t> x = Bytes(5000, 3), dy = Bytes(5000, 4), rms = Bytes(20, 5);
  BackwardRequest small = Header();
  const BulkField bulk[] = {{BackwardRequest::kXFieldNumber, x},
                            {BackwardRequest::kDyFieldNumber, dy},
                            {BackwardRequest::kRmsFieldNumber, rms},
                            {BackwardRequest::kCancelFieldNumber - 2, {}}};  // empty: not sent
  BackwardRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(EncodeWithBulk(small, bulk, nullptr))));
  BackwardRequest want = small;
  want.set_x(x.data(), x.size());
  want.set_dy(dy.data(), dy.size());
  want.set_rms(rms.data(), rms.size());
  EXPECT_EQ(parsed.SerializeAsString(), want.SerializeAsString());
}

TEST(BulkWireTest, KeepAliveIsReleasedWithTheLastSlice) {
  const std::vector<uint8_t> x = Bytes(100, 6);
  auto keep = std::make_shared<int>(7);
  std::weak_ptr<int> watch = keep;
  const BulkField bulk[] = {{BackwardRequest::kXFieldNumber, x},
                            {BackwardRequest::kDyFieldNumber, x}};
  auto buffer = std::make_unique<grpc::ByteBuffer>(EncodeWithBulk(BackwardRequest(), bulk, keep));
  keep.reset();
  auto copy = std::make_unique<grpc::ByteBuffer>(*buffer);  // gRPC holds references like this
  buffer.reset();
  EXPECT_FALSE(watch.expired()) << "released while a slice still points at the memory";
  copy.reset();
  EXPECT_TRUE(watch.expired()) << "never released";
}

TEST(BulkWireTest, DecodeFindsBulkFieldsAcrossAnySlicing) {
  BackwardResponse full;
  full.set_first_row(7);
  full.set_num_rows(2);
  const std::vector<uint8_t> dx = Bytes(2 * 896 * 4, 9);
  full.set_grad_input(dx.data(), dx.size());
  full.set_grad_gamma(std::string(896 * 4, 'G'));
  full.mutable_summary()->set_kernel("k");
  const std::string wire = full.SerializeAsString();
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<size_t> cuts;
    for (size_t at = 0; at < wire.size();) {
      const size_t n = 1 + rng() % (trial % 2 == 0 ? 7 : 4000);
      cuts.push_back(n);
      at += n;
    }
    BackwardResponse small;
    ReceivedBytes grad_input;
    ASSERT_TRUE(DecodeWithBulk(Sliced(wire, cuts), &small,
                               {{BackwardResponse::kGradInputFieldNumber, &grad_input}}));
    ASSERT_TRUE(grad_input.present());
    EXPECT_EQ(ToString(grad_input), full.grad_input());
    EXPECT_TRUE(small.grad_input().empty());
    BackwardResponse want = full;
    want.clear_grad_input();
    EXPECT_EQ(small.SerializeAsString(), want.SerializeAsString());
  }
}

TEST(BulkWireTest, OneSliceIsUsedInPlace) {
  BackwardRequest full;
  const std::vector<uint8_t> x = Bytes(4096, 11);
  full.set_x(x.data(), x.size());
  grpc::Slice slice(full.SerializeAsString());
  const grpc::ByteBuffer b(&slice, 1);
  BackwardRequest small;
  ReceivedBytes got;
  ASSERT_TRUE(DecodeWithBulk(b, &small, {{BackwardRequest::kXFieldNumber, &got}}));
  ASSERT_EQ(got.Contiguous().size(), x.size());
  EXPECT_GE(got.Contiguous().data(), slice.begin());
  EXPECT_LE(got.Contiguous().data() + x.size(), slice.end()) << "copied out of gRPC's slice";
}

// Protobuf keeps the last occurrence of a bytes field, and so does the decoder; a bulk field
// number that arrives with another wire type is protobuf's to judge (an unknown field).
TEST(BulkWireTest, RepeatedAndMistypedFieldsAreJudgedAsProtobufDoes) {
  BackwardRequest a, b;
  a.set_x("first");
  b.set_x("second");
  const std::string twice = a.SerializeAsString() + b.SerializeAsString();
  BackwardRequest small;
  ReceivedBytes x;
  ASSERT_TRUE(DecodeWithBulk(Sliced(twice, {3, 5}), &small, {{BackwardRequest::kXFieldNumber, &x}}));
  EXPECT_EQ(ToString(x), "second");

  const std::string x_as_varint = std::string("\x10\x05", 2);  // field 2 (x), wire type 0
  BackwardRequest by_protobuf;
  ASSERT_TRUE(by_protobuf.ParseFromString(x_as_varint));
  ASSERT_TRUE(DecodeWithBulk(Sliced(x_as_varint, {}), &small, {{BackwardRequest::kXFieldNumber, &x}}));
  EXPECT_FALSE(x.present());
  EXPECT_EQ(small.SerializeAsString(), by_protobuf.SerializeAsString());
}

// Every prefix of a valid message, and every single-byte change of it: the decoder accepts
// exactly what protobuf's parser accepts, with the same contents.
TEST(BulkWireTest, AcceptsExactlyWhatProtobufAccepts) {
  BackwardRequest full = Header();
  full.set_x(std::string(300, 'x'));
  full.set_dy(std::string(300, 'y'));
  full.set_rms(std::string(12, 'r'));
  full.set_cancel(true);
  const std::string wire = full.SerializeAsString();
  struct Verdict {
    bool ok, protobuf_ok, protobuf_kept_unknown;
  };
  auto check = [](const std::string& bytes) {
    BackwardRequest by_protobuf;
    const bool protobuf_ok = by_protobuf.ParseFromString(bytes);
    BackwardRequest small;
    ReceivedBytes x, dy;
    const bool ok = DecodeWithBulk(Sliced(bytes, {1, 2, 3, 100}), &small,
                                   {{BackwardRequest::kXFieldNumber, &x},
                                    {BackwardRequest::kDyFieldNumber, &dy}});
    if (ok) {
      EXPECT_TRUE(protobuf_ok) << "accepted what protobuf refuses";
      if (x.present()) small.set_x(ToString(x));
      if (dy.present()) small.set_dy(ToString(dy));
      EXPECT_EQ(small.SerializeAsString(), by_protobuf.SerializeAsString());
    }
    return Verdict{ok, protobuf_ok, !by_protobuf.GetReflection()->GetUnknownFields(by_protobuf).empty()};
  };
  int agreed_refusals = 0;
  for (size_t n = 0; n <= wire.size(); ++n) {
    const Verdict v = check(wire.substr(0, n));
    EXPECT_EQ(v.ok, v.protobuf_ok) << "prefix of " << n << " bytes";
    agreed_refusals += !v.ok && !v.protobuf_ok;
  }
  EXPECT_GT(agreed_refusals, 0);  // truncations inside a field are refused by both
  for (size_t i = 0; i < 40; ++i) {  // the header's tags, lengths and varints
    for (int bit = 0; bit < 8; ++bit) {
      std::string changed = wire;
      changed[i] = static_cast<char>(changed[i] ^ (1 << bit));
      const Verdict v = check(changed);
      // The one refusal of something protobuf takes: a group (wire types 3 and 4), which
      // protobuf keeps as an unknown field and no normgrad message has.
      if (v.protobuf_ok && !v.ok) {
        EXPECT_TRUE(v.protobuf_kept_unknown) << "byte " << i << " bit " << bit;
      }
    }
  }
}

}  // namespace
}  // namespace normgrad::v1
