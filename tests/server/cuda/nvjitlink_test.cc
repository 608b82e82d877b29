// Loading nvJitLink: a missing library is one clear FAILED_PRECONDITION. (Compiling needs the
// real library: tests/gpu/.)
#include "server/cuda/nvjitlink.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

TEST(NvJitLinkTest, MissingLibraryIsFailedPreconditionNamingThePath) {
  auto jit = NvJitLink::Load("/nonexistent/libnvJitLink.so");
  ASSERT_FALSE(jit.ok());
  EXPECT_EQ(jit.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(jit.status().message(), HasSubstr("/nonexistent/libnvJitLink.so"));
  EXPECT_THAT(jit.status().message(), HasSubstr("--nvjitlink"));
}

}  // namespace
}  // namespace normgrad::server
