// The server's Prometheus metrics (counters, gauges, histograms with labels) over prometheus-cpp's
// core library: its registry holds the series and its TextSerializer renders them in the text
// exposition format 0.0.4. No gRPC and no HTTP here: the service records into it and
// MetricsHttpServer serves RenderText() on /metrics.
//
//   MetricsRegistry m;
//   m.DescribeCounter("normgrad_requests_total", "RPCs by method and status code.");
//   m.IncrementCounter("normgrad_requests_total", {{"method", "EmitPtx"}, {"code", "OK"}});
//   std::string text = m.RenderText();
//
// Thread-safe. Recording a metric that was never described is a programming error: it is
// rendered as an untyped metric. Describing a name again changes nothing (the first description
// stays). Names are Prometheus names ([a-zA-Z_:][a-zA-Z0-9_:]*, label names without ':'):
// prometheus-cpp throws std::invalid_argument for another. Each series' labels are rendered in
// name order (Prometheus reads them as a set), families in name order. Components do not spell
// names: each keeps a table of typed handles (Counter, Gauge, Histogram below), one member per
// metric, whose constructor describes it with its name, help and label names in one place
// (ServiceMetrics, ServerMetrics).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace normgrad::server {

class MetricsRegistry {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  void DescribeCounter(const std::string& name, const std::string& help);
  void DescribeGauge(const std::string& name, const std::string& help);
  // `bounds`: upper bounds of the buckets, ascending; +Inf is added.
  void DescribeHistogram(const std::string& name, const std::string& help,
                         std::vector<double> bounds);

  // A counter only goes up: a negative delta is ignored.
  void IncrementCounter(const std::string& name, const Labels& labels, double delta = 1);
  void SetGauge(const std::string& name, const Labels& labels, double value);
  void AddGauge(const std::string& name, const Labels& labels, double delta);
  void Observe(const std::string& name, const Labels& labels, double value);

  // Runs at every RenderText(), before rendering, outside the registry's lock: for values that
  // live elsewhere (cache statistics) and are copied in with SetGauge/SetCounter.
  void AddCollector(std::function<void(MetricsRegistry&)> collector);
  // Sets a counter to a total kept elsewhere, which only grows (collectors only): a value below
  // the counter's is ignored (metrics.cc).
  void SetCounter(const std::string& name, const Labels& labels, double value);

  std::string RenderText();

  // Exponential latency buckets from 100 us to ~100 s (x2.5), each rounded to 9 significant
  // digits: the le labels they have always been rendered with (metrics.cc).
  static std::vector<double> LatencyBuckets();

 private:
  struct State;  // the library's registry, the families by name, the collectors (metrics.cc)

  // What IncrementCounter/AddGauge and SetGauge/SetCounter do, by the family's type.
  void Add(const std::string& name, const Labels& labels, double delta);
  void Set(const std::string& name, const Labels& labels, double value);

  std::unique_ptr<State> state_;
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
