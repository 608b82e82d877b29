// Admission control's accounting: streams (in total and per client), bytes, and EmitPtx calls
// and bytes (in total and per connection) beyond the limits are refused, naming the flag and the
// numbers, and counted. (Many threads at once: service_concurrency_test.)
#include "server/service/admission.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/metrics.h"
#include "server/service/service_metrics.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

// The line of normgrad_rejected_total{method, limit} in the registry's text, value included.
std::string Rejected(const char* method, const char* limit, int count) {
  return absl::StrCat("normgrad_rejected_total{limit=\"", limit, "\",method=\"", method, "\"} ",
                      count, "\n");
}

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

TEST(AdmissionControllerTest, EachClientGetsItsShareAndOthersStillGetSlots) {
  MetricsRegistry metrics;
  const ServiceMetrics service_metrics(metrics);
  AdmissionController a({.max_streams = 8, .max_streams_per_client = 3}, &service_metrics);
  EXPECT_EQ(a.streams_per_client(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(a.AdmitStream("ipv4:10.0.0.1").ok());
  absl::Status greedy = a.AdmitStream("ipv4:10.0.0.1");
  EXPECT_EQ(greedy.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(greedy.message(),
              HasSubstr("holds 3 streams, its share of 3 (of 8 in all) (--max-streams-per-client)"));
  EXPECT_THAT(greedy.message(), ::testing::Not(HasSubstr("10.0.0.1")));  // not echoed
  // Another client is admitted while the first is at its share.
  EXPECT_TRUE(a.AdmitStream("ipv4:10.0.0.2").ok());
  EXPECT_EQ(a.streams_of("ipv4:10.0.0.1"), 3u);
  EXPECT_EQ(a.streams_of("ipv4:10.0.0.2"), 1u);
  EXPECT_EQ(a.active_streams(), 4u);
  // A slot given back is the client's again.
  a.ReleaseStream("ipv4:10.0.0.1");
  EXPECT_TRUE(a.AdmitStream("ipv4:10.0.0.1").ok());
  // The total still binds: 8 in all (3 + 3 + 2), then --max-streams names itself.
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(a.AdmitStream("ipv4:10.0.0.2").ok());
  EXPECT_TRUE(a.AdmitStream("unix").ok());
  EXPECT_TRUE(a.AdmitStream("unix").ok());
  absl::Status full = a.AdmitStream("unix");
  EXPECT_THAT(full.message(), HasSubstr("8 of 8 in use (--max-streams)"));
  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr(Rejected("RmsNormBackward", "max-streams-per-client", 1)));
  EXPECT_THAT(text, HasSubstr(Rejected("RmsNormBackward", "max-streams", 1)));
  for (const char* c : {"ipv4:10.0.0.1", "ipv4:10.0.0.1", "ipv4:10.0.0.1", "ipv4:10.0.0.2",
                        "ipv4:10.0.0.2", "ipv4:10.0.0.2", "unix", "unix"}) {
    a.ReleaseStream(c);
  }
  EXPECT_EQ(a.active_streams(), 0u);
  EXPECT_EQ(a.streams_of("ipv4:10.0.0.1"), 0u);
}

TEST(AdmissionControllerTest, WithoutAShareOneClientMayTakeEverySlot) {
  AdmissionController a({.max_streams = 2});
  EXPECT_EQ(a.streams_per_client(), 2u);
  EXPECT_TRUE(a.AdmitStream("ipv4:10.0.0.1").ok());
  EXPECT_TRUE(a.AdmitStream("ipv4:10.0.0.1").ok());
  EXPECT_THAT(a.AdmitStream("ipv4:10.0.0.2").message(), HasSubstr("(--max-streams)"));
}

TEST(AdmissionControllerTest, EmitPtxIsBoundedInCallsAndBytesPerConnectionAndInTotal) {
  MetricsRegistry metrics;
  const ServiceMetrics service_metrics(metrics);
  AdmissionController a({.max_emit_ptx_calls = 3,
                         .max_emit_ptx_calls_per_connection = 2,
                         .max_emit_ptx_bytes = 1000,
                         .max_emit_ptx_bytes_per_connection = 600},
                        &service_metrics);
  const char* c1 = "ipv4:10.0.0.1:1000";
  const char* c2 = "ipv4:10.0.0.1:1001";
  EXPECT_TRUE(a.AdmitEmitPtx(c1, 100).ok());
  EXPECT_TRUE(a.AdmitEmitPtx(c1, 100).ok());
  absl::Status third = a.AdmitEmitPtx(c1, 100);  // per connection: 2 calls
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(),
              HasSubstr("has 2 of 2 calls queued or compiling (--max-emit-ptx-queue-per-connection)"));
  absl::Status big = a.AdmitEmitPtx(c2, 601);  // per connection: 600 bytes
  EXPECT_THAT(big.message(), HasSubstr("needs 601 bytes, 0 of 600 are in use by this connection "
                                       "(--max-emit-ptx-queue-bytes-per-connection)"));
  EXPECT_TRUE(a.AdmitEmitPtx(c2, 600).ok());
  EXPECT_EQ(a.emit_ptx_calls(), 3u);
  EXPECT_EQ(a.emit_ptx_bytes(), 800u);
  absl::Status total = a.AdmitEmitPtx("unix:", 1);  // in total: 3 calls
  EXPECT_THAT(total.message(), HasSubstr("3 of 3 calls queued or compiling (--max-emit-ptx-queue)"));
  a.ReleaseEmitPtx(c1, 100);
  absl::Status bytes = a.AdmitEmitPtx("unix:", 301);  // in total: 1000 bytes
  EXPECT_THAT(bytes.message(),
              HasSubstr("needs 301 bytes, 700 of 1000 are in use (--max-emit-ptx-queue-bytes)"));
  EXPECT_TRUE(a.AdmitEmitPtx("unix:", 200).ok());
  const std::string text = metrics.RenderText();
  for (const char* limit : {"max-emit-ptx-queue", "max-emit-ptx-queue-per-connection",
                            "max-emit-ptx-queue-bytes", "max-emit-ptx-queue-bytes-per-connection"}) {
    EXPECT_THAT(text, HasSubstr(Rejected("EmitPtx", limit, 1)));
  }
  a.ReleaseEmitPtx(c1, 100);
  a.ReleaseEmitPtx(c2, 600);
  a.ReleaseEmitPtx("unix:", 200);
  EXPECT_EQ(a.emit_ptx_calls(), 0u);
  EXPECT_EQ(a.emit_ptx_bytes(), 0u);
}

TEST(AdmissionLimitsTest, BadLimitsNameTheFlagAndValue) {
  EXPECT_TRUE(CheckAdmissionLimits({}).ok());
  EXPECT_THAT(CheckAdmissionLimits({.max_emit_ptx_calls = 0}).message(),
              HasSubstr("--max-emit-ptx-queue=0"));
  EXPECT_THAT(
      CheckAdmissionLimits({.max_emit_ptx_calls = 4, .max_emit_ptx_calls_per_connection = 5})
          .message(),
      HasSubstr("--max-emit-ptx-queue-per-connection=5: must be in 1..--max-emit-ptx-queue=4"));
  EXPECT_THAT(CheckAdmissionLimits({.max_emit_ptx_bytes = 0}).message(),
              HasSubstr("--max-emit-ptx-queue-bytes=0"));
  EXPECT_THAT(CheckAdmissionLimits({.max_emit_ptx_bytes_per_connection = 0}).message(),
              HasSubstr("--max-emit-ptx-queue-bytes-per-connection=0"));
}

TEST(ClientIdentityTest, ThePeerAddressWithoutItsPortAndOneIdentityForUnixSockets) {
  EXPECT_EQ(ClientIdentityFromPeer("ipv4:10.0.0.7:51234"), "ipv4:10.0.0.7");
  EXPECT_EQ(ClientIdentityFromPeer("ipv4:10.0.0.7:51235"), "ipv4:10.0.0.7");
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:[::1]:5000"), "ipv6:[::1]");
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:%5B::1%5D:5000"), "ipv6:%5B::1%5D");
  EXPECT_EQ(ClientIdentityFromPeer("unix:/run/normgrad/grpc.sock"), "unix");
  EXPECT_EQ(ClientIdentityFromPeer("unix:"), "unix");
  EXPECT_EQ(ClientIdentityFromPeer("unix-abstract:x"), "unix");
  EXPECT_EQ(ClientIdentityFromPeer("ipv4:10.0.0.7"), "ipv4:10.0.0.7");  // no port: as is
}

// One host or site holds a whole IPv6 /64: its addresses are one client.
TEST(ClientIdentityTest, IPv6AddressesCountByTheirSlash64) {
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:[2001:db8:1:2:aaaa::1]:5000"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:[2001:db8:1:2:bbbb:cccc:dddd:2]:6000"),
            "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:%5B2001:db8:1:2::9%5D:7000"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:[2001:db8:1:3::1]:5000"), "ipv6:[2001:db8:1:3::]/64");
  EXPECT_EQ(ClientIdentityFromPeer("ipv6:[::ffff:10.0.0.7]:5000"), "ipv4:10.0.0.7");
}

// Any local user can connect from 127.0.0.2, .3, ...: the kernel still knows whose socket it is.
TEST(ClientIdentityTest, LoopbackPeersFromAnyAddressAreFoundAsTheirUser) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in server{};
  server.sin_family = AF_INET;
  server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(server);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&server), len), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&server), &len), 0);
  std::vector<int> fds;
  for (const char* from : {"127.0.0.2", "127.0.0.3"}) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in local{};
    local.sin_family = AF_INET;
    ASSERT_EQ(inet_pton(AF_INET, from, &local.sin_addr), 1);
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)), 0);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&server), sizeof(server)), 0);
    socklen_t n = sizeof(local);
    ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&local), &n), 0);
    const std::string peer = absl::StrCat("ipv4:", from, ":", ntohs(local.sin_port));
    const std::optional<uint32_t> uid = LoopbackPeerUid(peer);
    ASSERT_TRUE(uid.has_value()) << peer;
    EXPECT_EQ(*uid, getuid()) << peer;
    fds.push_back(fd);
  }
  EXPECT_FALSE(LoopbackPeerUid("ipv4:10.0.0.7:5000").has_value());  // not loopback
  EXPECT_FALSE(LoopbackPeerUid("ipv4:127.0.0.9:1").has_value());    // no such connection
  EXPECT_FALSE(LoopbackPeerUid("unix:/run/normgrad/grpc.sock").has_value());
  for (int fd : fds) close(fd);
  close(listener);
}

}  // namespace
}  // namespace normgrad::server
