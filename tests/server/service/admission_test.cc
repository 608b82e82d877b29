// Admission control's accounting: streams and bytes beyond the limits are refused, naming the
// flag. (Many threads at once: service_concurrency_test.)
#include "server/service/admission.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

TEST(AdmissionControllerTest, RefusesStreamsAndBytesBeyondTheLimitsAndNamesTheFlags) {
  AdmissionController a({.max_streams = 2, .max_inflight_bytes = 100});
  EXPECT_TRUE(a.AdmitStream().ok());
  EXPECT_TRUE(a.AdmitStream().ok());
  absl::Status third = a.AdmitStream();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(), HasSubstr("--max-streams"));
  a.ReleaseStream();
  EXPECT_TRUE(a.AdmitStream().ok());

  EXPECT_TRUE(a.ReserveBytes(60).ok());
  absl::Status over = a.ReserveBytes(41);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("needs 41 bytes, 60 of 100 are in use"));
  EXPECT_TRUE(a.ReserveBytes(40).ok());
  a.ReleaseBytes(100);
  EXPECT_EQ(a.inflight_bytes(), 0u);
}

}  // namespace
}  // namespace normgrad::server
