// A small Prometheus metrics registry (counters, gauges, histograms with labels) rendered in the
// text exposition format 0.0.4. No gRPC and no HTTP here: the service records into it and
// MetricsHttpServer serves RenderText() on /metrics.
//
//   MetricsRegistry m;
//   m.DescribeCounter("normgrad_requests_total", "RPCs by method and status code.");
//   m.IncrementCounter("normgrad_requests_total", {{"method", "EmitPtx"}, {"code", "OK"}});
//   std::string text = m.RenderText();
//
// Thread-safe. Recording a metric that was never described is a programming error: it is
// rendered as an untyped metric.
#ifndef NORMGRAD_SERVER_METRICS_METRICS_H_
#define NORMGRAD_SERVER_METRICS_METRICS_H_

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>


namespace normgrad::server {

class MetricsRegistry {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  void DescribeCounter(const std::string& name, const std::string& help);
  void DescribeGauge(const std::string& name, const std::string& help);
  // `bounds`: upper bounds of the buckets, ascending; +Inf is added.
  void DescribeHistogram(const std::string& name, const std::string& help,
                         std::vector<double> bounds);

  void IncrementCounter(const std::string& name, const Labels& labels, double delta = 1);
  void SetGauge(const std::string& name, const Labels& labels, double value);
  void AddGauge(const std::string& name, const Labels& labels, double delta);
  void Observe(const std::string& name, const Labels& labels, double value);

  // Runs at every RenderText(), before rendering, outside the registry's lock: for values that
  // live elsewhere (cache statistics) and are copied in with SetGauge/SetCounter.
  void AddCollector(std::function<void(MetricsRegistry&)> collector);
  // Sets a counter to a total kept elsewhere (collectors only).
  void SetCounter(const std::string& name, const Labels& labels, double value);

  std::string RenderText();

  // Exponential latency buckets from 100 us to ~100 s.
  static std::vector<double> LatencyBuckets();

 private:
  enum class Type { kUntyped, kCounter, kGauge, kHistogram };
  struct Series {
    double value = 0;                    // counter, gauge
    std::vector<uint64_t> bucket_counts;  // histogram: per bound, not cumulative
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    Type type = Type::kUntyped;
    std::string help;
    std::vector<double> bounds;
    std::map<std::string, Series> series;  // by rendered label set
  };

  Series& SeriesLocked(const std::string& name, const Labels& labels);  // mu_ held
  static std::string RenderLabels(const Labels& labels);

  std::mutex mu_;
  std::map<std::string, Family> families_;  // guarded by mu_
  std::vector<std::function<void(MetricsRegistry&)>> collectors_;  // guarded by mu_
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_METRICS_METRICS_H_
