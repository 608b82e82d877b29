// The service's metrics, one typed handle each: name, help and label names are in
// service_metrics.cc and nowhere else; code records through the members. docs/operations.md
// lists them for operators.
//
//   MetricsRegistry registry;
//   ServiceMetrics metrics(registry);  // describes every one
//   metrics.chunks.Increment();
//   metrics.RecordRpc("EmitPtx", absl::StatusCode::kOk, seconds, bytes_in, bytes_out);
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "server/metrics/metrics.h"

namespace normgrad::server {

struct ServiceMetrics {
  explicit ServiceMetrics(MetricsRegistry& registry);

  // A finished RPC: its latency, bytes and (last, so that a scrape counting the call also sees
  // its latency and bytes) its status code.
  void RecordRpc(const char* method, absl::StatusCode code, double seconds, uint64_t bytes_in,
                 uint64_t bytes_out) const;

  Counter requests;              // {method, code}
  Histogram request_duration;    // {method}
  Counter received_bytes;        // {method}
  Counter sent_bytes;            // {method}
  Counter rows;
  Counter chunks;
  Counter rejected;              // {method, limit}
  Counter transport_streams;     // {transport}
  Counter transport_tensor_bytes;  // {transport}
  Gauge inflight_streams;
  Gauge emit_ptx_queued;
  Gauge emit_ptx_queued_bytes;
};

}  // namespace normgrad::server
