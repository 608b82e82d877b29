// What the server says about itself: reflection lists the service, GetServerInfo (limits, kernels,
// caches, the per-client and per-user shares), and the Prometheus metrics endpoint.
#include "tests/server/service/service_suite.h"

namespace normgrad::server::service_test {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

TEST_F(ServiceTest, ReflectionListsTheService) {
  // ServerReflectionInfo by hand: request {list_services: ""} is field 7, an empty string.
  grpc::GenericStub stub(testing::ChannelFor(server_->port()));
  GenericStreamingCall call(stub, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo");
  ASSERT_TRUE(call.Step(1));
  ASSERT_TRUE(call.Write(std::string("\x3a\x00", 2), 2));
  grpc::ByteBuffer in_buffer;
  call->Read(&in_buffer, reinterpret_cast<void*>(3));
  ASSERT_TRUE(call.Step(3));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in_buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  EXPECT_THAT(bytes, HasSubstr("normgrad.v1.NormGrad"));
  EXPECT_THAT(bytes, HasSubstr("grpc.health.v1.Health"));
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(call.Step(4));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  bool ok;
  ASSERT_TRUE(call.Next(&ok));
  EXPECT_TRUE(status.ok()) << status.error_message();
}

class ServiceInfoTest : public testing::InProcessServerTest {};

// A client can only keep to its shares if it can read them: the per-client stream share and the
// per-user region shares are in GetServerInfo.
TEST_F(ServiceInfoTest, ServerInfoReportsThePerClientAndPerUserShares) {
  const std::string dir = absl::StrCat("/tmp/normgrad-svc-shares-", getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  ServerOptions options = testing::TestServerOptions();
  options.admission.max_streams = 8;
  options.admission.max_streams_per_client = 3;
  options.listen.push_back("unix:" + dir + "/grpc.sock");
  options.shared_memory = true;
  options.regions.max_regions = 10;
  options.regions.max_regions_per_user = 4;
  options.regions.max_bytes = 1 << 30;
  options.regions.max_bytes_per_user = 1 << 28;
  ASSERT_TRUE(Start(options));
  const v1::GetServerInfoResponse info = Info(*stub_);
  EXPECT_EQ(info.limits().max_concurrent_streams(), 8u);
  EXPECT_EQ(info.limits().max_streams_per_client(), 3u);
  EXPECT_TRUE(info.shared_memory().enabled());
  EXPECT_EQ(info.shared_memory().max_regions_per_user(), 4u);
  EXPECT_EQ(info.shared_memory().max_region_bytes_per_user(), uint64_t{1} << 28);
  server_.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(ServiceTest, ServerInfoDescribesBackendLimitsKernelsAndCaches) {
  const v1::GetServerInfoResponse info = Info(*stub_);
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.backend(), testing::TestBackendName());
  EXPECT_FALSE(info.device().name().empty());
  EXPECT_EQ(info.limits().max_message_bytes(), 4u << 20);
  EXPECT_EQ(info.limits().max_concurrent_streams(), 64u);
  EXPECT_GT(info.limits().max_inflight_bytes(), 0u);
  EXPECT_DOUBLE_EQ(info.limits().stream_idle_timeout_seconds(), 60);
  EXPECT_THAT(std::vector<std::string>(info.kernels().begin(), info.kernels().end()),
              ::testing::IsSupersetOf({"rms_norm_backward", "batched_rms_norm_backward"}));
  EXPECT_GE(info.ptx_cache().entries(), 1u);  // --preload compiled one before SERVING
}

TEST_F(ServiceTest, MetricsEndpointServesParseablePrometheusText) {
  ExpectMatchesReference(*stub_, testing::RandomBatch(10, 8, 31), 4);
  // The server records an RPC when gRPC calls OnDone, which may come just after the client has
  // its status: scrape until the call shows up (bounded).
  const std::string ok_key = "normgrad_requests_total{code=\"OK\",method=\"RmsNormBackward\"}";
  int code = 0;
  std::string error;
  std::map<std::string, double> m;
  WaitFor([&] {
    m = testing::ParsePrometheusText(
        testing::HttpGet(server_->metrics_port(), "/metrics", &code), &error);
    return code == 200 && m[ok_key] >= 1;
  });
  ASSERT_EQ(code, 200);
  ASSERT_FALSE(m.empty()) << error;
  EXPECT_GE(m[ok_key], 1);
  EXPECT_GE(m["normgrad_request_duration_seconds_count{method=\"RmsNormBackward\"}"], 1);
  EXPECT_GE(m["normgrad_request_duration_seconds_bucket{method=\"RmsNormBackward\",le=\"+Inf\"}"],
            1);
  EXPECT_GT(m["normgrad_received_bytes_total{method=\"RmsNormBackward\"}"], 0);
  EXPECT_GT(m["normgrad_sent_bytes_total{method=\"RmsNormBackward\"}"], 0);
  EXPECT_GE(m["normgrad_rows_total"], 10);
  EXPECT_EQ(m["normgrad_serving"], 1);
  EXPECT_GT(m["normgrad_process_resident_bytes"], 0);
  EXPECT_EQ(m.count("normgrad_process_heap_in_use_bytes"), 1u);
  EXPECT_EQ(m.count("normgrad_cache_compiles_total{cache=\"ptx\"}"), 1u);
  EXPECT_EQ(m.count("normgrad_cache_hits_total{cache=\"module\"}"), 1u);
  bool backend_info = false;
  for (const auto& [key, value] : m) {
    if (key.rfind("normgrad_backend_info{", 0) == 0) {
      backend_info = value == 1 &&
                     key.find(absl::StrCat("backend=\"", testing::TestBackendName(), "\"")) !=
                         std::string::npos;
    }
  }
  EXPECT_TRUE(backend_info);
  int missing = 0;
  testing::HttpGet(server_->metrics_port(), "/nothing", &missing);
  EXPECT_EQ(missing, 404);
}

}  // namespace
}  // namespace normgrad::server::service_test
