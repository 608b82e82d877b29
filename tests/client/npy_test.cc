// .npy reading and writing: round trips, every header form NumPy writes, and every malformed
// input the CLI must turn into one clear line.
#include "client/tools/npy.h"

#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace normgrad::npy {
namespace {

// A .npy file's bytes with a hand-written header dictionary (version 1.0 unless `major` is 2).
std::string NpyBytes(const std::string& dict, const std::string& data, int major = 1) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  if (major != 1) out.append(2, '\0');
  return out + header + data;
}

std::string FloatBytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(NpyTest, SerializeThenParseReturnsTheSameShapeAndValues) {
  const std::vector<float> data = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const uint64_t shape[] = {2, 3};
  absl::StatusOr<Array> a = ParseF32(SerializeF32(shape, data));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(a->data, data);
}

TEST(NpyTest, SerializedHeaderIsPaddedTo64BytesAndEndsInNewline) {
  const uint64_t shape[] = {4};
  const std::string bytes = SerializeF32(shape, std::vector<float>(4, 1.0f));
  absl::StatusOr<Header> h = ParseHeader(bytes);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->data_offset % 64, 0u);
  EXPECT_EQ(bytes[h->data_offset - 1], '\n');
  EXPECT_NE(bytes.find("'shape': (4,)"), std::string::npos);  // NumPy's 1-tuple spelling
}

TEST(NpyTest, ParsesVersion2HeadersAndDoubleQuotedKeys) {
  const std::string bytes = NpyBytes(
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (1, 2)}", FloatBytes({1, 2}), 2);
  absl::StatusOr<Array> a = ParseF32(bytes);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->data, (std::vector<float>{1, 2}));
}

TEST(NpyTest, ScalarShapeHoldsOneElementAndZeroDimensionHoldsNone) {
  absl::StatusOr<Array> scalar = ParseF32(
      NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", FloatBytes({4})));
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->data.size(), 1u);
  absl::StatusOr<Array> empty =
      ParseF32(NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 5), }", ""));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->data.size(), 0u);
}

TEST(NpyTest, RejectsOtherDtypesNamingTheDtype) {
  for (const char* descr : {"<f8", ">f4", "<f2", "<i4", "|u1"}) {
    absl::StatusOr<Array> a = ParseF32(
        NpyBytes(std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (1,), }",
                 FloatBytes({1})),
        "x.npy");
    ASSERT_FALSE(a.ok()) << descr;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(a.status().message().find(descr), absl::string_view::npos) << a.status();
    EXPECT_EQ(a.status().message().substr(0, 6), "x.npy:");
  }
}

TEST(NpyTest, RejectsFortranOrder) {
  absl::StatusOr<Array> a = ParseF32(NpyBytes(
      "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", FloatBytes({1, 2, 3, 4})));
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("Fortran"), absl::string_view::npos) << a.status();
}

TEST(NpyTest, RejectsTruncatedAndOversizedDataWithTheByteCounts) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  absl::StatusOr<Array> short_data = ParseF32(NpyBytes(dict, FloatBytes({1, 2, 3, 4, 5})));
  ASSERT_FALSE(short_data.ok());
  EXPECT_NE(short_data.status().message().find("truncated data"), absl::string_view::npos);
  EXPECT_NE(short_data.status().message().find("needs 24 bytes, the file has 20"),
            absl::string_view::npos)
      << short_data.status();
  absl::StatusOr<Array> long_data = ParseF32(NpyBytes(dict, FloatBytes({1, 2, 3, 4, 5, 6, 7})));
  ASSERT_FALSE(long_data.ok());
  EXPECT_NE(long_data.status().message().find("oversized"), absl::string_view::npos);
}

// Found by npy_fuzzer: a shape whose element count wraps around 2^64 must be an error, not an
// allocation of the wrapped size.
TEST(NpyTest, RejectsShapesWhoseElementCountWouldOverflow) {
  const std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4794967296, 16), }";
  absl::StatusOr<Array> a = ParseF32(NpyBytes(dict, FloatBytes({1, 2, 3, 4})));
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("too many elements"), absl::string_view::npos)
      << a.status();
}

TEST(NpyTest, RejectsTruncatedHeadersAndBadMagic) {
  const std::string good = SerializeF32(std::vector<uint64_t>{2}, std::vector<float>{1, 2});
  for (size_t cut : {size_t{0}, size_t{5}, size_t{9}, size_t{40}}) {
    absl::StatusOr<Header> h = ParseHeader(good.substr(0, cut));
    EXPECT_FALSE(h.ok()) << "cut at " << cut;
  }
  absl::StatusOr<Header> bad = ParseHeader("PK\x03\x04 this is a zip file");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("magic"), absl::string_view::npos);
  std::string v9 = good;
  v9[6] = 9;
  EXPECT_FALSE(ParseHeader(v9).ok());
}

TEST(NpyTest, RejectsMalformedDictionaries) {
  for (const char* dict :
       {"{'descr': '<f4', 'shape': (2,), }",  // missing key
        "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': [2], }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", "'descr': '<f4'"}) {
    EXPECT_FALSE(ParseHeader(NpyBytes(dict, FloatBytes({1, 2}))).ok()) << dict;
  }
}

TEST(NpyTest, WriteThenReadFileRoundTrips) {
  const std::string path = ::testing::TempDir() + "/npy_test_roundtrip.npy";
  const std::vector<float> data = {0.5f, 0.25f, -1.0f};
  const uint64_t shape[] = {1, 1, 3};
  ASSERT_TRUE(WriteF32(path, shape, data).ok());
  absl::StatusOr<Array> a = ReadF32(path);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{1, 1, 3}));
  EXPECT_EQ(a->data, data);
  std::remove(path.c_str());
}

TEST(NpyTest, ReadingAMissingFileIsNotFoundNamingThePath) {
  absl::StatusOr<Array> a = ReadF32("/nonexistent/dir/x.npy");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(a.status().message().find("/nonexistent/dir/x.npy"), absl::string_view::npos);
}

TEST(NpyTest, ShapeStringSpellsTuplesAsNumPyDoes) {
  EXPECT_EQ(ShapeString(std::vector<uint64_t>{}), "()");
  EXPECT_EQ(ShapeString(std::vector<uint64_t>{7}), "(7,)");
  EXPECT_EQ(ShapeString(std::vector<uint64_t>{2, 3}), "(2, 3)");
}

}  // namespace
}  // namespace normgrad::npy
