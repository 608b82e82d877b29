#include "server/metrics/metrics.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "prometheus/client_metric.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/labels.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace normgrad::server {
namespace {

// A described metric: its family in the library's registry (the one pointer of its type) and
// what RenderText shows for it before it has a series (HELP and TYPE, as Prometheus expects).
struct Family {
  prometheus::MetricType type = prometheus::MetricType::Untyped;
  std::string help;
  prometheus::Family<prometheus::Counter>* counter = nullptr;
  prometheus::Family<prometheus::Gauge>* gauge = nullptr;
  prometheus::Family<prometheus::Histogram>* histogram = nullptr;
  prometheus::Histogram::BucketBoundaries bounds;
};

prometheus::Labels ToLabels(const MetricsRegistry::Labels& labels) {
  return prometheus::Labels(labels.begin(), labels.end());
}

}  // namespace

// The library's registry owns every series (it locks its families itself). `mu` guards the
// table of names and the rest; a Family is never erased or changed once described, so a
// pointer found under `mu` is used after it is released.
struct MetricsRegistry::State {
  prometheus::Registry registry;
  std::mutex mu;
  std::map<std::string, Family> families;  // by name; guarded by mu
  // Series of names never described (a programming error), rendered untyped as before: the
  // library's registry has no untyped families. Guarded by mu.
  std::map<std::string, std::map<prometheus::Labels, double>> untyped;
  std::vector<std::function<void(MetricsRegistry&)>> collectors;  // guarded by mu

  // The family of `name`, null when never described (mu held).
  const Family* FindLocked(const std::string& name) const {
    auto it = families.find(name);
    return it == families.end() ? nullptr : &it->second;
  }
  // Describes `name` (mu held): null when it already was, which keeps the first description.
  Family* DescribeLocked(const std::string& name, const std::string& help,
                         prometheus::MetricType type) {
    auto [it, inserted] = families.try_emplace(name);
    if (!inserted) return nullptr;
    it->second.type = type;
    it->second.help = help;
    untyped.erase(name);  // recorded before it was described: dropped, not rendered twice
    return &it->second;
  }
};

MetricsRegistry::MetricsRegistry() : state_(std::make_unique<State>()) {}
MetricsRegistry::~MetricsRegistry() = default;

std::vector<double> MetricsRegistry::LatencyBuckets() {
  // The serializer prints a bound with 16 significant digits, where this registry printed 9; a
  // bound rounded to 9 digits prints as it always did (le="0.0610351562", not 0.06103515625),
  // so dashboards that name an le keep their series. All but the last: no double prints as
  // 93.1322575 with 16 digits, it is le="93.13225749999999" now.
  std::vector<double> b;
  for (double v = 1e-4; v < 200; v *= 2.5) {
    double rounded = v;
    if (!absl::SimpleAtod(absl::StrFormat("%.9g", v), &rounded)) rounded = v;
    b.push_back(rounded);
  }
  return b;
}

void MetricsRegistry::DescribeCounter(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(state_->mu);
  Family* f = state_->DescribeLocked(name, help, prometheus::MetricType::Counter);
  if (f != nullptr) {
    f->counter = &prometheus::BuildCounter().Name(name).Help(help).Register(state_->registry);
  }
}

void MetricsRegistry::DescribeGauge(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(state_->mu);
  Family* f = state_->DescribeLocked(name, help, prometheus::MetricType::Gauge);
  if (f != nullptr) {
    f->gauge = &prometheus::BuildGauge().Name(name).Help(help).Register(state_->registry);
  }
}

void MetricsRegistry::DescribeHistogram(const std::string& name, const std::string& help,
                                        std::vector<double> bounds) {
  std::lock_guard<std::mutex> lock(state_->mu);
  Family* f = state_->DescribeLocked(name, help, prometheus::MetricType::Histogram);
  if (f != nullptr) {
    f->histogram = &prometheus::BuildHistogram().Name(name).Help(help).Register(state_->registry);
    f->bounds = std::move(bounds);
  }
}

void MetricsRegistry::IncrementCounter(const std::string& name, const Labels& labels,
                                       double delta) {
  Add(name, labels, delta);
}

void MetricsRegistry::AddGauge(const std::string& name, const Labels& labels, double delta) {
  Add(name, labels, delta);
}

void MetricsRegistry::SetGauge(const std::string& name, const Labels& labels, double value) {
  Set(name, labels, value);
}

void MetricsRegistry::SetCounter(const std::string& name, const Labels& labels, double value) {
  Set(name, labels, value);
}

void MetricsRegistry::Add(const std::string& name, const Labels& labels, double delta) {
  const Family* f;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    f = state_->FindLocked(name);
    if (f == nullptr) {
      state_->untyped[name][ToLabels(labels)] += delta;
      return;
    }
  }
  // Family::Add returns the series of these labels, made on first use.
  if (f->counter != nullptr) f->counter->Add(ToLabels(labels)).Increment(delta);
  if (f->gauge != nullptr) f->gauge->Add(ToLabels(labels)).Increment(delta);
  // A histogram has no single value to add to (nor had it before).
}

void MetricsRegistry::Set(const std::string& name, const Labels& labels, double value) {
  // Held throughout: for a counter, the read and the increment below are one step.
  std::lock_guard<std::mutex> lock(state_->mu);
  const Family* f = state_->FindLocked(name);
  if (f == nullptr) {
    state_->untyped[name][ToLabels(labels)] = value;
    return;
  }
  if (f->gauge != nullptr) f->gauge->Add(ToLabels(labels)).Set(value);
  if (f->counter != nullptr) {
    // A prometheus::Counter can only be incremented, so it is set to a total kept elsewhere by
    // adding the difference (a custom prometheus::Collectable for these series would render a
    // second family of the same name beside the registry's, which a Counter handle may also
    // Increment). The totals copied in (cache statistics, refused connections) only grow, so
    // the difference is never negative but for a collector that read its total before another
    // one (two scrapes at once) and comes second: ignoring it keeps the counter at the newer
    // total and monotonic, as Prometheus requires of a counter. Exact for whole numbers below
    // 2^53; a total in seconds may differ in its last bit.
    prometheus::Counter& counter = f->counter->Add(ToLabels(labels));
    const double difference = value - counter.Value();
    if (difference > 0) counter.Increment(difference);
  }
}

void MetricsRegistry::Observe(const std::string& name, const Labels& labels, double value) {
  const Family* f;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    f = state_->FindLocked(name);
    if (f == nullptr) {
      // As before: an untyped series has no buckets, so the observation shows as a 0.
      state_->untyped[name].try_emplace(ToLabels(labels), 0);
      return;
    }
  }
  if (f->histogram != nullptr) f->histogram->Add(ToLabels(labels), f->bounds).Observe(value);
}

void MetricsRegistry::AddCollector(std::function<void(MetricsRegistry&)> collector) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->collectors.push_back(std::move(collector));
}

std::string MetricsRegistry::RenderText() {
  std::vector<std::function<void(MetricsRegistry&)>> collectors;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    collectors = state_->collectors;
  }
  for (auto& c : collectors) c(*this);

  // The library's families hold at least one series each (it leaves out the rest).
  std::vector<prometheus::MetricFamily> families = state_->registry.Collect();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::set<std::string> collected;
    for (const prometheus::MetricFamily& f : families) collected.insert(f.name);
    // A described metric without a series yet: HELP and TYPE, no sample.
    for (const auto& [name, f] : state_->families) {
      if (collected.count(name) == 0) families.push_back({name, f.help, f.type, {}});
    }
    for (const auto& [name, series] : state_->untyped) {
      prometheus::MetricFamily& f = families.emplace_back();
      f.name = name;
      f.type = prometheus::MetricType::Untyped;
      for (const auto& [labels, value] : series) {
        prometheus::ClientMetric& m = f.metric.emplace_back();
        for (const auto& [label, label_value] : labels) m.label.push_back({label, label_value});
        m.untyped.value = value;
      }
    }
  }
  // Families by name and series by label set, as this registry always rendered them (the
  // library's own order is by type, then unordered).
  std::sort(families.begin(), families.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (prometheus::MetricFamily& f : families) {
    std::sort(f.metric.begin(), f.metric.end(),
              [](const auto& a, const auto& b) { return a.label < b.label; });
  }
  return prometheus::TextSerializer().Serialize(families);
}

Counter::Counter(MetricsRegistry& registry, std::string name, const std::string& help,
                 std::vector<std::string> label_names)
    : Metric(registry, std::move(name), std::move(label_names)) {
  registry.DescribeCounter(name_, help);
}

Gauge::Gauge(MetricsRegistry& registry, std::string name, const std::string& help,
             std::vector<std::string> label_names)
    : Metric(registry, std::move(name), std::move(label_names)) {
  registry.DescribeGauge(name_, help);
}

Histogram::Histogram(MetricsRegistry& registry, std::string name, const std::string& help,
                     std::vector<double> bounds, std::vector<std::string> label_names)
    : Metric(registry, std::move(name), std::move(label_names)) {
  registry.DescribeHistogram(name_, help, std::move(bounds));
}

}  // namespace normgrad::server
