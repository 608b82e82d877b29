// The options' own checks, with no device and no port: the defaults pass; a bad value or
// combination is INVALID_ARGUMENT naming the flag and the numbers.
#include "server/process/server_options.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

TEST(ServerOptionsTest, TheDefaultsPass) { EXPECT_TRUE(CheckServerOptions(ServerOptions{}).ok()); }

TEST(ServerOptionsTest, ABadValueOrCombinationIsInvalidArgumentNamingTheFlag) {
  ServerOptions small_messages;
  small_messages.max_message_bytes = 100;
  absl::Status s = CheckServerOptions(small_messages);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--max-message-bytes=100 is below the minimum of 4096"));

  ServerOptions shm_without_unix;
  shm_without_unix.shared_memory = true;
  EXPECT_THAT(CheckServerOptions(shm_without_unix).message(),
              HasSubstr("--shared-memory needs a --listen=unix:/PATH"));

  ServerOptions two_tcp;
  two_tcp.listen = {"127.0.0.1:0", "127.0.0.1:1"};
  EXPECT_THAT(CheckServerOptions(two_tcp).message(), HasSubstr("at most one HOST:PORT"));

  ServerOptions bad_preload;
  bad_preload.preload = {"no_such_kernel:sm_90"};
  EXPECT_THAT(CheckServerOptions(bad_preload).message(), HasSubstr("unknown kernel"));
}

}  // namespace
}  // namespace normgrad::server
