#include "server/metrics/metrics.h"

#include <cmath>
#include <limits>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace normgrad::server {
namespace {

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.9g", v);
}

// Inserts `extra` before the closing brace of a rendered label set ("" or "{a=\"b\"}").
std::string WithLabel(const std::string& rendered, const std::string& extra) {
  if (rendered.empty()) return absl::StrCat("{", extra, "}");
  return absl::StrCat(rendered.substr(0, rendered.size() - 1), ",", extra, "}");
}

}  // namespace

std::vector<double> MetricsRegistry::LatencyBuckets() {
  std::vector<double> b;
  for (double v = 1e-4; v < 200; v *= 2.5) b.push_back(v);
  return b;
}

void MetricsRegistry::DescribeCounter(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = families_[name];
  f.type = Type::kCounter;
  f.help = help;
}

void MetricsRegistry::DescribeGauge(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = families_[name];
  f.type = Type::kGauge;
  f.help = help;
}

void MetricsRegistry::DescribeHistogram(const std::string& name, const std::string& help,
                                        std::vector<double> bounds) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = families_[name];
  f.type = Type::kHistogram;
  f.help = help;
  f.bounds = std::move(bounds);
}

std::string MetricsRegistry::RenderLabels(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ",";
    absl::StrAppend(&out, labels[i].first, "=\"", EscapeLabelValue(labels[i].second), "\"");
  }
  out += "}";
  return out;
}

MetricsRegistry::Series& MetricsRegistry::SeriesLocked(const std::string& name,
                                                      const Labels& labels) {
  Family& f = families_[name];
  Series& s = f.series[RenderLabels(labels)];
  if (f.type == Type::kHistogram && s.bucket_counts.size() != f.bounds.size()) {
    s.bucket_counts.assign(f.bounds.size(), 0);
  }
  return s;
}

void MetricsRegistry::IncrementCounter(const std::string& name, const Labels& labels,
                                       double delta) {
  std::lock_guard<std::mutex> lock(mu_);
  SeriesLocked(name, labels).value += delta;
}

void MetricsRegistry::SetCounter(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  SeriesLocked(name, labels).value = value;
}

void MetricsRegistry::SetGauge(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  SeriesLocked(name, labels).value = value;
}

void MetricsRegistry::AddGauge(const std::string& name, const Labels& labels, double delta) {
  std::lock_guard<std::mutex> lock(mu_);
  SeriesLocked(name, labels).value += delta;
}

void MetricsRegistry::Observe(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  const Family& f = families_[name];
  Series& s = SeriesLocked(name, labels);
  for (size_t i = 0; i < f.bounds.size(); ++i) {
    if (value <= f.bounds[i]) {
      ++s.bucket_counts[i];
      break;
    }
  }
  s.sum += value;
  ++s.count;
}

void MetricsRegistry::AddCollector(std::function<void(MetricsRegistry&)> collector) {
  std::lock_guard<std::mutex> lock(mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::RenderText() {
  std::vector<std::function<void(MetricsRegistry&)>> collectors;
  {
    std::lock_guard<std::mutex> lock(mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c(*this);

  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = "untyped";
    switch (f.type) {
      case Type::kCounter: type = "counter"; break;
      case Type::kGauge: type = "gauge"; break;
      case Type::kHistogram: type = "histogram"; break;
      case Type::kUntyped: break;
    }
    if (!f.help.empty()) absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n");
    absl::StrAppend(&out, "# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, s] : f.series) {
      if (f.type != Type::kHistogram) {
        absl::StrAppend(&out, name, labels, " ", FormatValue(s.value), "\n");
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i < f.bounds.size(); ++i) {
        cumulative += s.bucket_counts[i];
        absl::StrAppend(&out, name, "_bucket",
                        WithLabel(labels, absl::StrCat("le=\"", FormatValue(f.bounds[i]), "\"")),
                        " ", cumulative, "\n");
      }
      absl::StrAppend(&out, name, "_bucket", WithLabel(labels, "le=\"+Inf\""), " ", s.count,
                      "\n");
      absl::StrAppend(&out, name, "_sum", labels, " ", FormatValue(s.sum), "\n");
      absl::StrAppend(&out, name, "_count", labels, " ", s.count, "\n");
    }
  }
  return out;
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
