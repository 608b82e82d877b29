#include "client/tools/load_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace normgrad::tools {

double Percentile(absl::Span<const double> sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p / 100.0 * static_cast<double>(sorted.size()));
  const size_t index = rank <= 1 ? 0 : static_cast<size_t>(rank) - 1;
  return sorted[std::min(index, sorted.size() - 1)];
}

std::vector<HistogramBucket> Histogram(absl::Span<const double> sorted, int buckets) {
  std::vector<HistogramBucket> out;
  if (sorted.empty() || buckets < 1) return out;
  const double lo = sorted.front(), hi = sorted.back();
  if (hi <= lo) {
    out.push_back({lo, hi, sorted.size()});
    return out;
  }
  const double width = (hi - lo) / buckets;
  for (int i = 0; i < buckets; ++i) out.push_back({lo + i * width, lo + (i + 1) * width, 0});
  out.back().upper_ms = hi;
  for (double v : sorted) {
    const int i = std::min(buckets - 1, static_cast<int>((v - lo) / width));
    ++out[i].count;
  }
  return out;
}

RunStats Summarize(absl::Span<const RequestRecord> records, double wall_seconds, int concurrency,
                   int histogram_buckets) {
  RunStats s;
  s.concurrency = concurrency;
  s.wall_seconds = wall_seconds;
  s.requests = records.size();
  std::vector<double> latencies_ms;
  uint64_t payload = 0;
  for (const RequestRecord& r : records) {
    if (r.code == absl::StatusCode::kOk) {
      latencies_ms.push_back(r.latency_seconds * 1e3);
      payload += r.payload_bytes;
    } else {
      ++s.errors_by_code[absl::StatusCodeToString(r.code)];
    }
  }
  s.successes = latencies_ms.size();
  if (wall_seconds > 0) {
    s.requests_per_second = s.requests / wall_seconds;
    s.successes_per_second = s.successes / wall_seconds;
    s.payload_gb_per_second = payload / wall_seconds / 1e9;
  }
  if (!latencies_ms.empty()) {
    std::sort(latencies_ms.begin(), latencies_ms.end());
    s.min_ms = latencies_ms.front();
    s.max_ms = latencies_ms.back();
    s.mean_ms = std::accumulate(latencies_ms.begin(), latencies_ms.end(), 0.0) /
                static_cast<double>(latencies_ms.size());
    s.p50_ms = Percentile(latencies_ms, 50);
    s.p90_ms = Percentile(latencies_ms, 90);
    s.p95_ms = Percentile(latencies_ms, 95);
    s.p99_ms = Percentile(latencies_ms, 99);
    s.p999_ms = Percentile(latencies_ms, 99.9);
    s.histogram = Histogram(latencies_ms, histogram_buckets);
  }
  return s;
}

bool IsStable(absl::Span<const RunStats> windows, double percent) {
  if (windows.size() < 3) return false;
  const absl::Span<const RunStats> last = windows.subspan(windows.size() - 3);
  auto within = [&](auto metric) {
    double mean = 0;
    for (const RunStats& w : last) mean += metric(w) / 3.0;
    for (const RunStats& w : last) {
      if (std::abs(metric(w) - mean) > percent / 100.0 * mean) return false;
    }
    return true;
  };
  return within([](const RunStats& w) { return w.successes_per_second; }) &&
         within([](const RunStats& w) { return w.p99_ms; });
}

}  // namespace normgrad::tools
