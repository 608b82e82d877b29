// EmitPtx over gRPC: content-addressed and deterministic, bad requests, cubin with and without
// nvJitLink, and identical concurrent requests compiled once.
#include "tests/server/service/service_suite.h"

namespace normgrad::server::service_test {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

TEST_F(ServiceTest, EmitPtxIsContentAddressedAndDeterministic) {
  v1::EmitPtxResponse a, b;
  ASSERT_TRUE(Emit(*stub_, PtxRequest(896, "sm_90"), &a).ok());
  ASSERT_TRUE(Emit(*stub_, PtxRequest(896, "sm_90"), &b).ok());
  EXPECT_EQ(a.digest().sha256(), base::Sha256Hex(a.ptx()));
  EXPECT_EQ(a.digest().size_bytes(), a.ptx().size());
  EXPECT_EQ(a.digest().sha256(), b.digest().sha256());
  EXPECT_EQ(a.entry(), "batched_rms_norm_backward");
  EXPECT_EQ(a.target(), "sm_90");
  EXPECT_FALSE(a.ptx_version().empty());
  EXPECT_THAT(a.ptx(), HasSubstr(".target sm_90"));
  EXPECT_FALSE(a.params().empty());
  EXPECT_FALSE(a.config_key().empty());
  EXPECT_TRUE(a.cubin().empty());
}

TEST_F(ServiceTest, EmitPtxBadRequestsAreInvalidArgument) {
  v1::EmitPtxResponse r;
  v1::EmitPtxRequest unknown = PtxRequest(896, "sm_90");
  unknown.set_kernel("nope");
  grpc::Status s = Emit(*stub_, unknown, &r);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("kernel \"nope\" is unknown"));
  EXPECT_EQ(Emit(*stub_, PtxRequest(896, "sm_ninety"), &r).error_code(), grpc::INVALID_ARGUMENT);
  v1::EmitPtxRequest warp = PtxRequest(64, "sm_90");
  warp.set_kernel("rms_norm_backward");
  EXPECT_EQ(Emit(*stub_, warp, &r).error_code(), grpc::INVALID_ARGUMENT);
}

TEST_F(ServiceTest, EmitPtxCubinIsAnElfImageWhenNvJitLinkIsPresent) {
  if (!Info(*stub_).nvjitlink_available()) GTEST_SKIP() << "no nvJitLink on this machine";
  v1::EmitPtxResponse r;
  grpc::Status s = Emit(*stub_, PtxRequest(896, "sm_90", /*cubin=*/true), &r);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_GE(r.cubin().size(), 4u);
  EXPECT_EQ(r.cubin().substr(0, 4), "\x7f" "ELF");
  EXPECT_EQ(r.cubin_digest().sha256(), base::Sha256Hex(r.cubin()));
  EXPECT_EQ(r.cubin_digest().size_bytes(), r.cubin().size());
  EXPECT_FALSE(r.ptx().empty());
}

class ServiceEmitPtxTest : public testing::InProcessServerTest {};

TEST_F(ServiceEmitPtxTest, CubinWithoutNvJitLinkIsFailedPreconditionSayingSo) {
  ServerOptions options = testing::TestServerOptions();
  options.nvjitlink_path = "/nonexistent/libnvJitLink.so.13";
  ASSERT_TRUE(Start(options));
  EXPECT_FALSE(Info(*stub_).nvjitlink_available());
  v1::EmitPtxResponse r;
  grpc::Status s = Emit(*stub_, PtxRequest(896, "sm_90", /*cubin=*/true), &r);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("nvJitLink is not available"));
  // PTX alone still works.
  EXPECT_TRUE(Emit(*stub_, PtxRequest(896, "sm_90"), &r).ok());
}

TEST_F(ServiceEmitPtxTest, ConcurrentIdenticalRequestsCompileOnce) {
  ASSERT_TRUE(Start(testing::TestServerOptions()));
  const bool cubin = Info(*stub_).nvjitlink_available();  // slower compiles overlap surely
  constexpr int kRequests = 8;
  std::promise<void> start;  // all threads send at once
  std::shared_future<void> go = start.get_future().share();
  std::vector<std::string> digests(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      auto own = testing::StubFor(server_->port());
      v1::EmitPtxResponse r;
      go.wait();
      grpc::Status s = Emit(*own, PtxRequest(4096, "sm_80", cubin), &r);
      EXPECT_TRUE(s.ok()) << s.error_message();
      digests[i] = r.digest().sha256();
    });
  }
  start.set_value();
  for (std::thread& t : threads) t.join();
  for (const std::string& d : digests) EXPECT_EQ(d, digests[0]);
  const v1::CacheStats stats = Info(*stub_).ptx_cache();
  EXPECT_EQ(stats.compiles(), cubin ? 2u : 1u);  // the PTX, and the cubin when asked
  EXPECT_EQ(stats.compile_failures(), 0u);
}

}  // namespace
}  // namespace normgrad::server::service_test
