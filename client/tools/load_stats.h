// Statistics of a load run: counts, errors by gRPC code, throughput, latency percentiles and a
// latency histogram, and perf_analyzer's stability rule for measurement windows. No gRPC here.
//
//   std::vector<RequestRecord> records = ...;   // one per completed request
//   RunStats stats = Summarize(records, /*wall_seconds=*/2.0, /*concurrency=*/8);
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace normgrad::tools {

struct RequestRecord {
  double latency_seconds = 0;  // issue to completion, as the client saw it
  absl::StatusCode code = absl::StatusCode::kOk;
  uint64_t payload_bytes = 0;  // tensor bytes sent and received (see docs/load.md)
};

struct HistogramBucket {
  double lower_ms = 0;  // inclusive
  double upper_ms = 0;  // exclusive, except the last bucket, which includes max
  uint64_t count = 0;
};

struct RunStats {
  int concurrency = 0;
  uint64_t requests = 0;                           // completed, whatever the outcome
  uint64_t successes = 0;                          // completed with OK
  std::map<std::string, uint64_t> errors_by_code;  // "RESOURCE_EXHAUSTED" -> count; no "OK"
  double wall_seconds = 0;
  double requests_per_second = 0;    // requests / wall_seconds
  double successes_per_second = 0;   // successes / wall_seconds (the throughput)
  double payload_gb_per_second = 0;  // payload bytes of successes / wall_seconds / 1e9
  // Latency of successful requests in milliseconds (all zero when there is none).
  double min_ms = 0, mean_ms = 0, p50_ms = 0, p90_ms = 0, p95_ms = 0, p99_ms = 0, p999_ms = 0,
         max_ms = 0;
  std::vector<HistogramBucket> histogram;  // of successful requests' latency
  int windows = 0;     // measurement windows behind these numbers (sweeps), 0 for a fixed run
  bool stable = true;  // sweeps: the last windows met the stability rule
};

// Nearest-rank percentile (the smallest value with at least p% of values <= it) of a sorted,
// non-empty list; p in [0, 100].
double Percentile(absl::Span<const double> sorted, double p);

// `buckets` equal-width buckets from the minimum to the maximum latency (one bucket when all
// latencies are equal; none when the list is empty). Counts sum to latencies_ms.size().
std::vector<HistogramBucket> Histogram(absl::Span<const double> sorted_latencies_ms, int buckets);

RunStats Summarize(absl::Span<const RequestRecord> records, double wall_seconds, int concurrency,
                   int histogram_buckets = 20);

// perf_analyzer's rule: at least 3 windows, and in the last 3 both successes_per_second and p99
// lie within `percent`% of their mean over those 3.
bool IsStable(absl::Span<const RunStats> windows, double percent);

}  // namespace normgrad::tools
