// GetServerInfo's answer from ServerInfo: every section filled from its field, shared memory and
// CUDA IPC enabled exactly when present, durations in seconds. A variant from the wire: -0 is 0.
#include "server/proto_conversion/proto_conversion.h"

#include <cmath>

#include "gtest/gtest.h"

namespace normgrad::server {
namespace {

ServerInfo SomeInfo() {
  ServerInfo info;
  info.version = "1.2.3";
  info.backend = "cpu";
  info.device.name = "host";
  info.limits = {.max_streams = 64, .max_inflight_bytes = 1 << 30, .max_streams_per_client = 8,
                 .max_hidden_dim = 65536, .max_num_rows = 1 << 20, .max_message_bytes = 4 << 20,
                 .stream_idle_timeout = absl::Milliseconds(2500)};
  info.ptx_cache.hits = 5;
  info.kernels = {"a", "b"};
  info.serving = true;
  return info;
}

TEST(ServerInfoToProtoTest, FillsEverySectionFromItsField) {
  v1::GetServerInfoResponse r;
  ToProto(SomeInfo(), &r);
  EXPECT_EQ(r.version(), "1.2.3");
  EXPECT_EQ(r.backend(), "cpu");
  EXPECT_EQ(r.device().name(), "host");
  EXPECT_EQ(r.limits().max_concurrent_streams(), 64u);
  EXPECT_EQ(r.limits().max_inflight_bytes(), 1u << 30);
  EXPECT_EQ(r.limits().max_streams_per_client(), 8u);
  EXPECT_EQ(r.limits().max_hidden_dim(), 65536u);
  EXPECT_EQ(r.limits().max_num_rows(), 1u << 20);
  EXPECT_EQ(r.limits().max_message_bytes(), 4u << 20);
  EXPECT_DOUBLE_EQ(r.limits().stream_idle_timeout_seconds(), 2.5);
  EXPECT_EQ(r.ptx_cache().hits(), 5u);
  ASSERT_EQ(r.kernels_size(), 2);
  EXPECT_EQ(r.kernels(1), "b");
  EXPECT_TRUE(r.health().serving());
  EXPECT_FALSE(r.has_shared_memory());
  EXPECT_FALSE(r.has_cuda_ipc());
}

TEST(ServerInfoToProtoTest, SharedMemoryAndCudaIpcAreEnabledExactlyWhenPresent) {
  ServerInfo info = SomeInfo();
  info.shared_memory = ServerInfo::SharedMemory{.max_regions = 4, .max_region_bytes = 1 << 20,
                                                .max_regions_per_user = 2,
                                                .max_region_bytes_per_user = 1 << 19};
  info.cuda_ipc = ServerInfo::CudaIpc{.device_uuid = std::string(16, 'u'), .max_open_handles = 9};
  info.serving = false;
  info.health_reason = "self-test failed";
  v1::GetServerInfoResponse r;
  ToProto(info, &r);
  EXPECT_TRUE(r.shared_memory().enabled());
  EXPECT_EQ(r.shared_memory().max_regions(), 4u);
  EXPECT_EQ(r.shared_memory().max_region_bytes(), 1u << 20);
  EXPECT_EQ(r.shared_memory().max_regions_per_user(), 2u);
  EXPECT_EQ(r.shared_memory().max_region_bytes_per_user(), 1u << 19);
  EXPECT_TRUE(r.cuda_ipc().enabled());
  EXPECT_EQ(r.cuda_ipc().device_uuid(), std::string(16, 'u'));
  EXPECT_EQ(r.cuda_ipc().max_open_handles(), 9u);
  EXPECT_FALSE(r.health().serving());
  EXPECT_EQ(r.health().reason(), "self-test failed");
}

// -0 and 0 are the same scale: both become the default variant (one ConfigKey(), one PTX, one
// cached module), from a stream's header and from an emission request alike.
TEST(VariantFromProtoTest, NegativeZeroOffsetIsTheDefaultVariant) {
  v1::BackwardHeader header;
  header.set_gamma_offset(-0.0f);
  absl::StatusOr<kernels::NormVariant> from_header = VariantFromHeader(header);
  ASSERT_TRUE(from_header.ok()) << from_header.status();
  EXPECT_FALSE(std::signbit(from_header->gamma_offset));
  EXPECT_TRUE(from_header->is_default());
  v1::EmitPtxRequest request;
  request.set_gamma_offset(-0.0f);
  request.set_no_gamma(true);  // an offset with no_gamma must be 0; -0 is
  absl::StatusOr<kernels::NormVariant> from_request = VariantFromEmitPtxRequest(request);
  ASSERT_TRUE(from_request.ok()) << from_request.status();
  EXPECT_FALSE(std::signbit(from_request->gamma_offset));
  EXPECT_EQ(from_request->KeySuffix(), "_nogamma");
  header.set_gamma_offset(-1.5f);
  EXPECT_EQ(VariantFromHeader(header)->gamma_offset, -1.5f);
}

}  // namespace
}  // namespace normgrad::server
