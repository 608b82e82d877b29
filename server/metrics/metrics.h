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
// rendered as an untyped metric. Components do not spell names: each keeps a table of typed
// handles (Counter, Gauge, Histogram below), one member per metric, whose constructor describes
// it with its name, help and label names in one place (ServiceMetrics, ProcessMetrics).
#pragma once

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

// A described metric of `registry`, recorded through its handle. `label_names`: the labels its
// series carry (documentation, and the order callers give them in). Copyable; the registry
// outlives every handle.
class Metric {
 public:
  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

 protected:
  Metric(MetricsRegistry& registry, std::string name, std::vector<std::string> label_names)
      : registry_(&registry), name_(std::move(name)), label_names_(std::move(label_names)) {}
  MetricsRegistry* registry_;
  std::string name_;
  std::vector<std::string> label_names_;
};

class Counter : public Metric {
 public:
  Counter(MetricsRegistry& registry, std::string name, const std::string& help,
          std::vector<std::string> label_names = {});
  void Increment(const MetricsRegistry::Labels& labels = {}, double delta = 1) const {
    registry_->IncrementCounter(name_, labels, delta);
  }
  // To a total kept elsewhere (collectors only).
  void Set(const MetricsRegistry::Labels& labels, double value) const {
    registry_->SetCounter(name_, labels, value);
  }
};

class Gauge : public Metric {
 public:
  Gauge(MetricsRegistry& registry, std::string name, const std::string& help,
        std::vector<std::string> label_names = {});
  void Set(const MetricsRegistry::Labels& labels, double value) const {
    registry_->SetGauge(name_, labels, value);
  }
  void Set(double value) const { Set({}, value); }
  void Add(const MetricsRegistry::Labels& labels, double delta) const {
    registry_->AddGauge(name_, labels, delta);
  }
};

class Histogram : public Metric {
 public:
  Histogram(MetricsRegistry& registry, std::string name, const std::string& help,
            std::vector<double> bounds, std::vector<std::string> label_names = {});
  void Observe(const MetricsRegistry::Labels& labels, double value) const {
    registry_->Observe(name_, labels, value);
  }
};

}  // namespace normgrad::server
