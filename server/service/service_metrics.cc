#include "server/service/service_metrics.h"

namespace normgrad::server {

ServiceMetrics::ServiceMetrics(MetricsRegistry& r)
    : requests(r, "normgrad_requests_total", "Finished RPCs by method and gRPC status code.",
               {"method", "code"}),
      request_duration(r, "normgrad_request_duration_seconds",
                       "RPC latency from start to final status, by method.",
                       MetricsRegistry::LatencyBuckets(), {"method"}),
      received_bytes(r, "normgrad_received_bytes_total",
                     "Tensor and request payload bytes received, by method.", {"method"}),
      sent_bytes(r, "normgrad_sent_bytes_total", "Payload bytes sent, by method.", {"method"}),
      rows(r, "normgrad_rows_total", "Rows whose gradients were computed and sent."),
      chunks(r, "normgrad_chunks_total", "Row chunks computed."),
      rejected(r, "normgrad_rejected_total",
               "Calls refused, or streams ended, by a server limit: by method and the "
               "limit's flag (max-streams, max-streams-per-client, max-inflight-bytes, "
               "min-stream-bytes-per-second, max-emit-ptx-queue[-bytes][-per-connection]).",
               {"method", "limit"}),
      transport_streams(r, "normgrad_transport_streams_total",
                        "Finished RmsNormBackward streams by transport: shm (rows in a "
                        "shared-memory region), unix (bytes over a unix-domain socket) or tcp.",
                        {"transport"}),
      transport_tensor_bytes(r, "normgrad_transport_tensor_bytes_total",
                             "x, dy, rms and gamma bytes received and grad_input bytes sent by "
                             "RmsNormBackward streams, by transport (as "
                             "normgrad_transport_streams_total).",
                             {"transport"}),
      inflight_streams(r, "normgrad_inflight_streams",
                       "RmsNormBackward streams admitted and not done."),
      emit_ptx_queued(r, "normgrad_emit_ptx_queued",
                      "EmitPtx calls admitted and not finished (queued or running on its "
                      "workers)."),
      emit_ptx_queued_bytes(r, "normgrad_emit_ptx_queued_bytes",
                            "Request bytes those EmitPtx calls hold.") {}

void ServiceMetrics::RecordRpc(const char* method, absl::StatusCode code, double seconds,
                               uint64_t bytes_in, uint64_t bytes_out) const {
  request_duration.Observe({{"method", method}}, seconds);
  received_bytes.Increment({{"method", method}}, static_cast<double>(bytes_in));
  sent_bytes.Increment({{"method", method}}, static_cast<double>(bytes_out));
  requests.Increment({{"method", method}, {"code", absl::StatusCodeToString(code)}});
}

}  // namespace normgrad::server
