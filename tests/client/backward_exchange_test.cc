// BackwardExchange step by step, without gRPC: the messages a call writes (the header, chunks
// whose row bytes point into the caller's arrays, the in-order cancel of a memory call, at most
// kMemoryChunksAhead memory chunks ahead), and what it makes of answers (rows in batch order into
// dx, grad_gamma and the summary at the end; every malformed answer refused before any byte of it
// reaches the caller's arrays).
#include "client/src/backward_exchange.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <memory>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::client_internal {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kHidden = 4;
constexpr uint64_t kRowBytes = kHidden * 4;

// A batch of `rows` f32 rows with its output arrays (dx and dgamma filled with 0xEE: untouched).
struct Batch {
  explicit Batch(uint64_t rows) : x(rows * kRowBytes, 1), dy(rows * kRowBytes, 2),
                                  gamma(kRowBytes, 3), dx(rows * kRowBytes, 0xEE),
                                  dgamma(kRowBytes, 0xEE) {
    args.num_rows = rows;
    args.hidden_dim = kHidden;
    args.x = x;
    args.dy = dy;
    args.gamma = gamma;
    args.dx = absl::MakeSpan(dx);
    args.dgamma = absl::MakeSpan(dgamma);
  }
  std::vector<uint8_t> x, dy, gamma, dx, dgamma;
  RawBackwardArgs args;
  BackwardOptions options;
};

// An answer as the server sends it, decoded as the client decodes it: rows [first, first+rows)
// with `grad_input` bytes of value `fill`, and, when `final`, grad_gamma and the summary.
struct Answer {
  Answer(uint64_t first, uint64_t rows, size_t grad_input_bytes, uint8_t fill, bool final,
         size_t grad_gamma_bytes = kRowBytes) {
    v1::BackwardResponse r;
    r.set_first_row(first);
    r.set_num_rows(rows);
    if (final) {
      r.set_grad_gamma(std::string(grad_gamma_bytes, 7));
      r.mutable_summary()->set_backend("cpu");
      r.mutable_summary()->set_rows(first + rows);
    }
    bytes.assign(grad_input_bytes, fill);
    const v1::BulkField bulk[] = {{v1::BackwardResponse::kGradInputFieldNumber, bytes}};
    const grpc::ByteBuffer wire = v1::EncodeWithBulk(r, bulk, nullptr);
    decoded = v1::DecodeWithBulk(wire, &response,
                                 {{v1::BackwardResponse::kGradInputFieldNumber, &grad_input}});
  }
  std::vector<uint8_t> bytes;
  bool decoded = false;
  v1::BackwardResponse response;
  v1::ReceivedBytes grad_input;
};

TEST(BackwardExchangeTest, ABytesCallWritesTheHeaderThenChunksOfTheCallersRowsThenHalfCloses) {
  Batch b(5);
  BackwardExchange x(b.args, b.options, nullptr, /*chunk_bytes=*/2 * kRowBytes);
  EXPECT_FALSE(x.memory_call());
  x.StartHeader();
  EXPECT_TRUE(x.message().has_header());
  EXPECT_EQ(x.message().header().num_rows(), 5u);
  EXPECT_EQ(x.message().header().hidden_dim(), kHidden);
  EXPECT_TRUE(x.bulk().empty());
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kNothing) << "the header is still in flight";
  x.WriteDone();
  // Chunks of 2, 2 and 1 rows; x and dy point into the caller's arrays, no rms.
  for (uint64_t first : {0, 2, 4}) {
    ASSERT_EQ(x.NextWrite(), BackwardExchange::kMessage) << first;
    ASSERT_EQ(x.bulk().size(), 3u);
    const uint64_t rows = first == 4 ? 1 : 2;
    EXPECT_EQ(x.bulk()[0].number, v1::BackwardRequest::kXFieldNumber);
    EXPECT_EQ(x.bulk()[0].bytes.data(), b.x.data() + first * kRowBytes);
    EXPECT_EQ(x.bulk()[0].bytes.size(), rows * kRowBytes);
    EXPECT_EQ(x.bulk()[1].bytes.data(), b.dy.data() + first * kRowBytes);
    EXPECT_TRUE(x.bulk()[2].bytes.empty());
    EXPECT_FALSE(x.message().has_header());
    EXPECT_EQ(x.NextWrite(), BackwardExchange::kNothing) << "one write in flight";
    x.WriteDone();
  }
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kWritesDone);
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kNothing);
  EXPECT_FALSE(x.exposed()) << "bytes name no memory of the caller's";

  // The answers, in batch order: dx filled row by row, then grad_gamma and the summary.
  EXPECT_FALSE(x.Complete().ok());
  Answer a(0, 3, 3 * kRowBytes, 0x11, false), c(3, 2, 2 * kRowBytes, 0x22, true);
  ASSERT_TRUE(a.decoded && c.decoded);
  ASSERT_TRUE(x.TakeAnswer(a.response, a.grad_input).ok());
  EXPECT_EQ(x.rows_received(), 3u);
  EXPECT_THAT(x.Complete().message(), HasSubstr("after 3 of 5 rows and no grad_gamma"));
  ASSERT_TRUE(x.TakeAnswer(c.response, c.grad_input).ok());
  EXPECT_TRUE(x.Complete().ok());
  EXPECT_EQ(b.dx, [] {
    std::vector<uint8_t> want(5 * kRowBytes, 0x11);
    std::memset(want.data() + 3 * kRowBytes, 0x22, 2 * kRowBytes);
    return want;
  }());
  EXPECT_EQ(b.dgamma, std::vector<uint8_t>(kRowBytes, 7));
  EXPECT_EQ(x.summary().backend, "cpu");
  Answer late(5, 0, 0, 0, true);
  EXPECT_THAT(x.TakeAnswer(late.response, late.grad_input).message(),
              HasSubstr("after the final one"));
}

TEST(BackwardExchangeTest, AMalformedAnswerIsRefusedBeforeAByteOfItReachesTheCaller) {
  struct Case {
    Answer answer;
    const char* want;
  };
  std::vector<std::unique_ptr<Case>> cases;
  auto add = [&](Answer a, const char* want) {
    cases.push_back(std::make_unique<Case>(Case{std::move(a), want}));
  };
  add(Answer(1, 2, 2 * kRowBytes, 0x33, false), "a gap; the next chunk must start at row 0");
  add(Answer(0, 5, 5 * kRowBytes, 0x33, false), "of a 4-row batch");
  add(Answer(0, 2, 2 * kRowBytes - 1, 0x33, false), "grad_input bytes for 2 rows, expected 32");
  add(Answer(0, 4, 4 * kRowBytes, 0x33, true, kRowBytes - 2), "14 grad_gamma bytes, expected 16");
  for (const auto& c : cases) {
    Batch b(4);
    BackwardExchange x(b.args, b.options, nullptr, 1 << 20);
    ASSERT_TRUE(c->answer.decoded);
    const absl::Status s = x.TakeAnswer(c->answer.response, c->answer.grad_input);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << c->want;
    EXPECT_THAT(s.message(), HasSubstr(c->want));
    EXPECT_EQ(b.dx, std::vector<uint8_t>(4 * kRowBytes, 0xEE)) << c->want;
    EXPECT_EQ(b.dgamma, std::vector<uint8_t>(kRowBytes, 0xEE)) << c->want;
  }
  // An overlap, after rows [0, 2) came.
  Batch b(4);
  BackwardExchange x(b.args, b.options, nullptr, 1 << 20);
  Answer first(0, 2, 2 * kRowBytes, 0x44, false), again(1, 2, 2 * kRowBytes, 0x55, false);
  ASSERT_TRUE(x.TakeAnswer(first.response, first.grad_input).ok());
  EXPECT_THAT(x.TakeAnswer(again.response, again.grad_input).message(), HasSubstr("an overlap"));
  EXPECT_EQ(b.dx[2 * kRowBytes], 0xEE);
}

TEST(BackwardExchangeTest, AMemoryCallKeepsThreeChunksAheadAndCancelsInOrderOnceExposed) {
  Batch b(10);
  ShmPlan plan;
  plan.region_id = 9;
  plan.x = 0;
  plan.dy = 1000;
  plan.dx = 2000;
  BackwardExchange x(b.args, b.options, &plan, /*chunk_bytes=*/kRowBytes);  // a row a chunk
  ASSERT_TRUE(x.memory_call());
  // Cancelled before any chunk went out: cut off, nothing more is written.
  {
    BackwardExchange early(b.args, b.options, &plan, kRowBytes);
    early.StartHeader();
    early.WriteDone();
    EXPECT_EQ(early.Cancel(absl::CancelledError("by the caller")), BackwardExchange::kCutOff);
    EXPECT_EQ(early.NextWrite(), BackwardExchange::kNothing);
    EXPECT_EQ(early.Cancel(absl::CancelledError("again")), BackwardExchange::kAlready);
  }
  x.StartHeader();
  x.WriteDone();
  for (uint64_t i = 0; i < BackwardExchange::kMemoryChunksAhead; ++i) {
    ASSERT_EQ(x.NextWrite(), BackwardExchange::kMessage) << i;
    ASSERT_TRUE(x.message().has_shm());
    EXPECT_EQ(x.message().shm().x_offset(), i * kRowBytes);
    EXPECT_EQ(x.message().shm().dy_offset(), 1000 + i * kRowBytes);
    EXPECT_EQ(x.message().shm().grad_input_offset(), 2000 + i * kRowBytes);
    EXPECT_TRUE(x.bulk().empty()) << "no row bytes travel";
    EXPECT_TRUE(x.exposed());
    x.WriteDone();
  }
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kNothing) << "three chunks unanswered";
  Answer a(0, 1, 0, 0, false);
  ASSERT_TRUE(x.TakeAnswer(a.response, a.grad_input).ok());
  EXPECT_EQ(b.dx, std::vector<uint8_t>(10 * kRowBytes, 0xEE)) << "the server wrote the region";
  ASSERT_EQ(x.NextWrite(), BackwardExchange::kMessage);
  EXPECT_EQ(x.message().shm().x_offset(), 3 * kRowBytes);
  // grad_input bytes for a memory chunk are refused.
  Answer bytes(1, 1, kRowBytes, 0x66, false);
  EXPECT_THAT(x.TakeAnswer(bytes.response, bytes.grad_input).message(),
              HasSubstr("grad_input bytes for a shared-memory chunk"));
  // Cancelled with a write in flight: the cancel follows it, then the half-close.
  EXPECT_EQ(x.Cancel(absl::DeadlineExceededError("the deadline")), BackwardExchange::kInOrder);
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kNothing);
  x.WriteDone();
  ASSERT_EQ(x.NextWrite(), BackwardExchange::kMessage);
  EXPECT_TRUE(x.message().cancel());
  x.WriteDone();
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kWritesDone);
  EXPECT_EQ(x.cancel_status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(BackwardExchangeTest, AWholeBatchIsOneMessageOfTheCallersRows) {
  Batch b(3);
  BackwardExchange x(b.args, b.options, nullptr, std::numeric_limits<uint64_t>::max());
  x.StartWhole();
  EXPECT_TRUE(x.message().has_header());
  ASSERT_EQ(x.bulk().size(), 3u);
  EXPECT_EQ(x.bulk()[0].bytes.data(), b.x.data());
  EXPECT_EQ(x.bulk()[0].bytes.size(), b.x.size());
  EXPECT_EQ(x.bulk()[1].bytes.data(), b.dy.data());
  x.WriteDone();
  EXPECT_EQ(x.NextWrite(), BackwardExchange::kNothing) << "a unary call writes nothing more";
  Answer all(0, 3, 3 * kRowBytes, 0x77, true);
  ASSERT_TRUE(x.TakeAnswer(all.response, all.grad_input).ok());
  EXPECT_TRUE(x.Complete().ok());
  EXPECT_EQ(b.dx, std::vector<uint8_t>(3 * kRowBytes, 0x77));
}

}  // namespace
}  // namespace normgrad::client_internal
