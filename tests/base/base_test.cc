// The floor every component may use: Sha256Hex's known answers, BoundedQuote's cut and escaping,
// and the status macros' early return, single evaluation and move out of a StatusOr.
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/bounded_quote.h"
#include "base/resource_line.h"
#include "base/sha256.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"

namespace normgrad::base {
namespace {

TEST(Sha256Test, KnownAnswers) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(BoundedQuoteTest, ShortTextIsQuotedWholeAndEscaped) {
  EXPECT_EQ(BoundedQuote("sm_90"), "\"sm_90\"");
  EXPECT_EQ(BoundedQuote("a\"b\n\x01"), "\"a\\\"b\\n\\x01\"");
  EXPECT_EQ(BoundedQuote(std::string(kBoundedQuoteBytes, 'k')),
            "\"" + std::string(kBoundedQuoteBytes, 'k') + "\"");
}

TEST(BoundedQuoteTest, LongTextIsCutAndItsLengthGiven) {
  const std::string q = BoundedQuote(std::string(100000, 'k'));
  EXPECT_EQ(q, "\"" + std::string(kBoundedQuoteBytes, 'k') + "\"... (100000 bytes)");
  // Escaping can grow each byte to 4 characters; the bound holds for the worst byte too.
  EXPECT_LE(BoundedQuote(std::string(100000, '\x01')).size(), 4 * kBoundedQuoteBytes + 32);
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(int v) {
  if (v < 0) return absl::InvalidArgumentError("negative");
  return std::make_unique<int>(v);
}

absl::Status AddPositive(int a, int b, int* sum, int* evaluations) {
  NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<int> x, (++*evaluations, MakeInt(a)));
  NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<int> y, MakeInt(b));
  NORMGRAD_RETURN_IF_ERROR(*x + *y > 100 ? absl::OutOfRangeError("above 100") : absl::OkStatus());
  *sum = *x + *y;
  return absl::OkStatus();
}

TEST(StatusMacrosTest, ReturnTheFirstErrorAndEvaluateOnce) {
  int sum = 0, evaluations = 0;
  EXPECT_TRUE(AddPositive(2, 3, &sum, &evaluations).ok());
  EXPECT_EQ(sum, 5);
  EXPECT_EQ(evaluations, 1);
  EXPECT_EQ(AddPositive(-1, 3, &sum, &evaluations).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddPositive(1, -3, &sum, &evaluations).message(), "negative");
  EXPECT_EQ(AddPositive(60, 60, &sum, &evaluations).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(evaluations, 4);
  EXPECT_EQ(sum, 5);  // untouched by the failures
}

TEST(ResourceLineTest, CountsOrWhyTheyAreUnknown) {
  EXPECT_EQ(ResourceLine("k", "bf16", "sm_90", "7.8", "11.8", ResourceCounts(72, 4, 8, 64, 16, 1)),
            "k dtype=bf16 target=sm_90 ptx_version=7.8 min_cuda_driver=11.8 registers=72 "
            "spill_store_bytes=4 spill_load_bytes=8 shared_memory_bytes=64 local_memory_bytes=16 "
            "barriers=1");
  EXPECT_EQ(ResourceLine("k", "f32", "sm_75", "7.0", "unknown",
                         absl::FailedPreconditionError("no nvJitLink")),
            "k dtype=f32 target=sm_75 ptx_version=7.0 min_cuda_driver=unknown "
            "resources=unknown (no nvJitLink)");
}

}  // namespace
}  // namespace normgrad::base
