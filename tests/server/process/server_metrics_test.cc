// The process's and the service's metric tables: constructing one describes every metric it
// lists (HELP and TYPE in the exposition), and each handle records under its own name.
#include "server/process/server_metrics.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/service/service_metrics.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

TEST(ServerMetricsTest, TheTablesDescribeEveryMetricWithItsType) {
  MetricsRegistry registry;
  const ServerMetrics server(registry);
  const ServiceMetrics service(registry);
  server.serving.Set(1);
  server.CollectCache("module", ModuleCacheStats{.hits = 7});
  server.CollectRegions(RegionStats{.regions = 2, .bytes = 4096, .registered = 3, .refused = 1});
  service.rejected.Increment({{"method", "EmitPtx"}, {"limit", "max-emit-ptx-queue"}});
  service.RecordRpc("GetServerInfo", absl::StatusCode::kOk, 0.5, 10, 20);
  const std::string text = registry.RenderText();
  for (const char* line : {"# TYPE normgrad_serving gauge", "# TYPE normgrad_cache_hits_total counter",
                           "# TYPE normgrad_request_duration_seconds histogram",
                           "# TYPE normgrad_unix_refused_connections_total counter",
                           "# TYPE normgrad_inflight_streams gauge",
                           "# HELP normgrad_chunks_total Row chunks computed."}) {
    EXPECT_THAT(text, HasSubstr(line));
  }
  EXPECT_THAT(text, HasSubstr("normgrad_serving 1\n"));
  EXPECT_THAT(text, HasSubstr("normgrad_cache_hits_total{cache=\"module\"} 7\n"));
  EXPECT_THAT(text, HasSubstr("normgrad_shm_registrations{result=\"refused\"} 1\n"));
  EXPECT_THAT(text, HasSubstr(
      "normgrad_rejected_total{limit=\"max-emit-ptx-queue\",method=\"EmitPtx\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("normgrad_requests_total{code=\"OK\",method=\"GetServerInfo\"} 1\n"));
  EXPECT_THAT(service.rejected.label_names(), ::testing::ElementsAre("method", "limit"));
}

}  // namespace
}  // namespace normgrad::server
