// BackwardValidator on its own: every bad sequence gets the documented code and a message that
// names the field and the numbers; good sequences are accepted with the right row ranges.
#include "server/service/backward_validator.h"

#include <cmath>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

v1::BackwardRequest Header(uint64_t rows, uint32_t hidden, float eps = 1e-5f,
                           bool rms_provided = false) {
  v1::BackwardRequest m;
  m.mutable_header()->set_num_rows(rows);
  m.mutable_header()->set_hidden_dim(hidden);
  m.mutable_header()->set_eps(eps);
  m.mutable_header()->set_gamma(std::string(hidden * 4, '\0'));
  m.mutable_header()->set_rms_provided(rms_provided);
  return m;
}

v1::BackwardRequest Chunk(uint64_t x_bytes, uint64_t dy_bytes, uint64_t rms_bytes = 0) {
  v1::BackwardRequest m;
  m.set_x(std::string(x_bytes, '\0'));
  m.set_dy(std::string(dy_bytes, '\0'));
  if (rms_bytes > 0) m.set_rms(std::string(rms_bytes, '\0'));
  return m;
}

absl::Status HeaderStatus(const v1::BackwardRequest& header, BackwardLimits limits = {}) {
  BackwardValidator v(limits);
  return v.Accept(header).status();
}

TEST(BackwardValidatorTest, AcceptsChunksThatDoNotDivideTheBatchAndReportsRowRanges) {
  BackwardValidator v({});
  ASSERT_TRUE(v.Accept(Header(10, 3)).ok());
  EXPECT_TRUE(v.has_header());
  auto a = v.Accept(Chunk(4 * 12, 4 * 12));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->chunk.first_row, 0u);
  EXPECT_EQ(a->chunk.num_rows, 4u);
  auto b = v.Accept(Chunk(4 * 12, 4 * 12));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->chunk.first_row, 4u);
  EXPECT_EQ(b->chunk.index, 1u);
  EXPECT_FALSE(v.AtEndOfStream().ok());
  auto c = v.Accept(Chunk(2 * 12, 2 * 12));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->chunk.first_row, 8u);
  EXPECT_EQ(c->chunk.num_rows, 2u);
  EXPECT_TRUE(v.AtEndOfStream().ok());
}

TEST(BackwardValidatorTest, FirstMessageWithoutHeaderIsInvalid) {
  BackwardValidator v({});
  absl::Status s = v.Accept(Chunk(16, 16)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("first message must carry `header`"));
}

TEST(BackwardValidatorTest, HeaderCarryingRowsIsInvalid) {
  v1::BackwardRequest m = Header(1, 4);
  m.set_x(std::string(16, '\0'));
  EXPECT_THAT(HeaderStatus(m).message(), HasSubstr("must not carry row data (x: 16 bytes"));
}

TEST(BackwardValidatorTest, RepeatedHeaderIsInvalidAndNamesTheChunk) {
  BackwardValidator v({});
  ASSERT_TRUE(v.Accept(Header(4, 4)).ok());
  ASSERT_TRUE(v.Accept(Chunk(16, 16)).ok());
  absl::Status s = v.Accept(Header(4, 4)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("chunk 1: header repeated"));
}

TEST(BackwardValidatorTest, ZeroAndOversizedShapes) {
  EXPECT_EQ(HeaderStatus(Header(0, 4)).message(), "header.num_rows is 0; must be > 0");
  EXPECT_EQ(HeaderStatus(Header(4, 0)).message(), "header.hidden_dim is 0; must be > 0");
  BackwardLimits limits;
  limits.max_hidden_dim = 64;
  limits.max_num_rows = 1000;
  absl::Status rows = HeaderStatus(Header(1001, 4), limits);
  EXPECT_EQ(rows.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(rows.message(), HasSubstr("header.num_rows is 1001, above the server's limit of 1000"));
  absl::Status hidden = HeaderStatus(Header(4, 65), limits);
  EXPECT_EQ(hidden.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(hidden.message(), HasSubstr("header.hidden_dim is 65, above the server's limit of 64"));
  // Absurd sizes are refused by the limits before any arithmetic on them.
  EXPECT_EQ(HeaderStatus(Header(std::numeric_limits<uint64_t>::max(), 4)).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(BackwardValidatorTest, EpsMustBeFinitePositiveUnlessRmsIsProvided) {
  for (float eps : {0.0f, -1.0f, std::nanf(""), INFINITY}) {
    absl::Status s = HeaderStatus(Header(1, 4, eps));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << eps;
    EXPECT_THAT(s.message(), HasSubstr("header.eps is")) << eps;
  }
  EXPECT_TRUE(HeaderStatus(Header(1, 4, 0.0f, /*rms_provided=*/true)).ok());
}

TEST(BackwardValidatorTest, GammaLengthMustMatchHiddenDim) {
  v1::BackwardRequest m = Header(1, 896);
  m.mutable_header()->set_gamma(std::string(100, '\0'));
  EXPECT_EQ(HeaderStatus(m).message(), "header.gamma has 100 bytes, not hidden_dim*4 = 3584");
}

TEST(BackwardValidatorTest, UnknownDTypeIsInvalid) {
  v1::BackwardRequest m = Header(1, 4);
  m.mutable_header()->set_dtype(static_cast<v1::DType>(42));
  absl::Status s = HeaderStatus(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("header.dtype is 42, not a known DType"));
}

TEST(BackwardValidatorTest, Bf16UsesTwoByteElements) {
  BackwardValidator v({});
  v1::BackwardRequest m = Header(2, 8);
  m.mutable_header()->set_dtype(v1::DTYPE_BF16);
  m.mutable_header()->set_gamma(std::string(16, '\0'));
  ASSERT_TRUE(v.Accept(m).ok());
  auto c = v.Accept(Chunk(32, 32));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->chunk.num_rows, 2u);
}

TEST(BackwardValidatorTest, UnknownKernelIsInvalidAndListsTheKnownOnes) {
  v1::BackwardRequest m = Header(1, 4);
  m.mutable_header()->mutable_options()->set_kernel("no_such_kernel");
  absl::Status s = HeaderStatus(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("header.options.kernel \"no_such_kernel\" is unknown"));
}

TEST(BackwardValidatorTest, LongKernelNameIsNotEchoedWhole) {
  v1::BackwardRequest m = Header(1, 4);
  m.mutable_header()->mutable_options()->set_kernel(std::string(100000, 'k'));
  const absl::Status s = HeaderStatus(m);
  const std::string head(s.message().substr(0, 512));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << head;
  EXPECT_THAT(head, HasSubstr("header.options.kernel \"kkkk"));
  EXPECT_THAT(head, HasSubstr("\"... (100000 bytes) is unknown"));
  EXPECT_LT(s.message().size(), 512u) << head;
}

TEST(BackwardValidatorTest, WarpKernelRefusesHiddenDimAbove32) {
  v1::BackwardRequest m = Header(1, 33, 1e-5f, true);
  m.mutable_header()->mutable_options()->set_kernel("rms_norm_backward");
  absl::Status s = HeaderStatus(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rms_norm_backward"));
  EXPECT_THAT(s.message(), HasSubstr("33"));
}

TEST(BackwardValidatorTest, ChunkLengthErrorsNameTheChunkAndTheNumbers) {
  BackwardValidator v({});
  ASSERT_TRUE(v.Accept(Header(100, 896)).ok());
  ASSERT_TRUE(v.Accept(Chunk(3584, 3584)).ok());
  ASSERT_TRUE(v.Accept(Chunk(3584, 3584)).ok());
  ASSERT_TRUE(v.Accept(Chunk(3584, 3584)).ok());
  EXPECT_EQ(v.Accept(Chunk(1000, 1000)).status().message(),
            "chunk 3: x has 1000 bytes, not a multiple of hidden_dim*4 = 3584");
}

TEST(BackwardValidatorTest, ChunkShapeErrors) {
  auto fresh = [] {
    BackwardValidator v({});
    EXPECT_TRUE(v.Accept(Header(4, 2)).ok());
    return v;
  };
  {
    BackwardValidator v = fresh();
    EXPECT_EQ(v.Accept(Chunk(8, 16)).status().message(), "chunk 0: x has 8 bytes but dy has 16");
  }
  {
    BackwardValidator v = fresh();
    EXPECT_EQ(v.Accept(Chunk(9, 9)).status().message(),
              "chunk 0: x has 9 bytes, not a multiple of 4 (f32 elements)");
  }
  {
    BackwardValidator v = fresh();
    EXPECT_THAT(v.Accept(Chunk(0, 0)).status().message(), HasSubstr("chunk 0: x and dy are empty"));
  }
  {
    BackwardValidator v = fresh();
    ASSERT_TRUE(v.Accept(Chunk(24, 24)).ok());  // 3 rows
    EXPECT_EQ(v.Accept(Chunk(16, 16)).status().message(),
              "chunk 1: 2 rows after 3 would exceed header.num_rows = 4");
  }
}

TEST(BackwardValidatorTest, RmsMustMatchRowsExactlyWhenProvided) {
  BackwardValidator with({});
  ASSERT_TRUE(with.Accept(Header(4, 2, 1e-5f, true)).ok());
  EXPECT_EQ(with.Accept(Chunk(16, 16, 4)).status().message(),
            "chunk 0: rms has 4 bytes, not rows*4 = 8 (rows = 2)");
  BackwardValidator missing({});
  ASSERT_TRUE(missing.Accept(Header(4, 2, 1e-5f, true)).ok());
  EXPECT_THAT(missing.Accept(Chunk(16, 16)).status().message(), HasSubstr("rms has 0 bytes"));
  BackwardValidator unexpected({});
  ASSERT_TRUE(unexpected.Accept(Header(4, 2)).ok());
  EXPECT_EQ(unexpected.Accept(Chunk(16, 16, 8)).status().message(),
            "chunk 0: rms has 8 bytes but header.rms_provided is false");
}

TEST(BackwardValidatorTest, EndOfStreamNeedsEveryDeclaredRow) {
  BackwardValidator none({});
  EXPECT_EQ(none.AtEndOfStream().message(), "the stream ended before its header");
  BackwardValidator short_stream({});
  ASSERT_TRUE(short_stream.Accept(Header(10, 1)).ok());
  ASSERT_TRUE(short_stream.Accept(Chunk(28, 28)).ok());
  EXPECT_EQ(short_stream.AtEndOfStream().message(),
            "the stream ended after 7 of header.num_rows = 10 rows (1 chunks)");
}

}  // namespace
}  // namespace normgrad::server
