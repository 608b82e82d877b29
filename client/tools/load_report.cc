#include "client/tools/load_report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace normgrad::tools {
namespace {

std::string HtmlEscape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Num(double v) { return absl::StrFormat("%.6g", v); }

// Six significant digits, as the summary and the CSV print them; a whole number is an integer
// (99, not 99.0).
nlohmann::ordered_json JsonNumber(double v) {
  const double rounded = std::strtod(Num(v).c_str(), nullptr);
  if (std::abs(rounded) < 1e15 && rounded == std::trunc(rounded)) {
    return static_cast<int64_t>(rounded);
  }
  return rounded;
}

nlohmann::ordered_json RunJson(const RunStats& r) {
  nlohmann::ordered_json errors = nlohmann::ordered_json::object();
  for (const auto& [code, n] : r.errors_by_code) errors[code] = n;
  nlohmann::ordered_json buckets = nlohmann::ordered_json::array();
  for (const HistogramBucket& b : r.histogram) {
    buckets.push_back({{"lower_ms", JsonNumber(b.lower_ms)},
                       {"upper_ms", JsonNumber(b.upper_ms)},
                       {"count", b.count}});
  }
  return {{"concurrency", r.concurrency},
          {"requests", r.requests},
          {"successes", r.successes},
          {"errors", r.requests - r.successes},
          {"errors_by_code", errors},
          {"wall_seconds", JsonNumber(r.wall_seconds)},
          {"requests_per_second", JsonNumber(r.requests_per_second)},
          {"successes_per_second", JsonNumber(r.successes_per_second)},
          {"payload_gb_per_second", JsonNumber(r.payload_gb_per_second)},
          {"latency_ms",
           {{"min", JsonNumber(r.min_ms)},
            {"mean", JsonNumber(r.mean_ms)},
            {"p50", JsonNumber(r.p50_ms)},
            {"p90", JsonNumber(r.p90_ms)},
            {"p95", JsonNumber(r.p95_ms)},
            {"p99", JsonNumber(r.p99_ms)},
            {"p99.9", JsonNumber(r.p999_ms)},
            {"max", JsonNumber(r.max_ms)}}},
          {"histogram", buckets},
          {"windows", r.windows},
          {"stable", r.stable}};
}

// A bar chart of a histogram: x = latency buckets, y = count.
std::string HistogramSvg(const RunStats& r) {
  constexpr int kW = 640, kH = 240, kLeft = 50, kBottom = 40, kTop = 10;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" role=\"img\">", kW, kH);
  uint64_t peak = 1;
  for (const HistogramBucket& b : r.histogram) peak = std::max(peak, b.count);
  const int n = static_cast<int>(r.histogram.size());
  const double plot_w = kW - kLeft - 10, plot_h = kH - kBottom - kTop;
  absl::StrAppend(&svg,
                  absl::StrFormat("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>",
                                  kLeft, kH - kBottom, kW - 10, kH - kBottom));
  for (int i = 0; i < n; ++i) {
    const HistogramBucket& b = r.histogram[i];
    const double w = plot_w / n;
    const double h = plot_h * b.count / peak;
    absl::StrAppend(
        &svg, absl::StrFormat(
                  "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#4a7ebb\">"
                  "<title>%.3f-%.3f ms: %d</title></rect>",
                  kLeft + i * w + 1, kH - kBottom - h, std::max(1.0, w - 2), h, b.lower_ms,
                  b.upper_ms, b.count));
  }
  if (n > 0) {
    absl::StrAppend(
        &svg, absl::StrFormat(
                  "<text x=\"%d\" y=\"%d\" font-size=\"11\">%.3f ms</text>"
                  "<text x=\"%d\" y=\"%d\" font-size=\"11\" text-anchor=\"end\">%.3f ms</text>",
                  kLeft, kH - kBottom + 15, r.histogram.front().lower_ms, kW - 10,
                  kH - kBottom + 15, r.histogram.back().upper_ms));
  }
  absl::StrAppend(
      &svg, absl::StrFormat("<text x=\"5\" y=\"%d\" font-size=\"11\">%d</text><text x=\"%d\" "
                            "y=\"%d\" font-size=\"12\" "
                            "text-anchor=\"middle\">latency (successful requests)</text></svg>",
                            kTop + 10, peak, kLeft + static_cast<int>(plot_w / 2), kH - 8));
  return svg;
}

// A line chart of y against concurrency.
std::string LineSvg(const std::vector<RunStats>& runs, double (*y)(const RunStats&),
                    absl::string_view label) {
  constexpr int kW = 640, kH = 240, kLeft = 60, kBottom = 40, kTop = 10;
  const double plot_w = kW - kLeft - 20, plot_h = kH - kBottom - kTop;
  int c_lo = runs.front().concurrency, c_hi = runs.front().concurrency;
  double y_hi = 0;
  for (const RunStats& r : runs) {
    c_lo = std::min(c_lo, r.concurrency);
    c_hi = std::max(c_hi, r.concurrency);
    y_hi = std::max(y_hi, y(r));
  }
  if (y_hi <= 0) y_hi = 1;
  auto px = [&](int c) {
    return kLeft + (c_hi == c_lo ? plot_w / 2 : plot_w * (c - c_lo) / (c_hi - c_lo));
  };
  auto py = [&](double v) { return kH - kBottom - plot_h * v / y_hi; };
  std::string points;
  std::string dots;
  for (const RunStats& r : runs) {
    absl::StrAppend(&points, absl::StrFormat("%.1f,%.1f ", px(r.concurrency), py(y(r))));
    absl::StrAppend(
        &dots,
        absl::StrFormat(
            "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#c0504d\"><title>concurrency %d: %.4g"
            "</title></circle><text x=\"%.1f\" y=\"%d\" font-size=\"11\" text-anchor=\"middle\">%d"
            "</text>",
            px(r.concurrency), py(y(r)), r.concurrency, y(r), px(r.concurrency), kH - kBottom + 15,
            r.concurrency));
  }
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" role=\"img\">"
      "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>"
      "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>"
      "<polyline fill=\"none\" stroke=\"#c0504d\" stroke-width=\"2\" points=\"%s\"/>%s"
      "<text x=\"5\" y=\"%d\" font-size=\"11\">%.4g</text>"
      "<text x=\"%d\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\">%s vs concurrency</text>"
      "</svg>",
      kW, kH, kLeft, kH - kBottom, kW - 20, kH - kBottom, kLeft, kTop, kLeft, kH - kBottom, points,
      dots, kTop + 10, y_hi, kLeft + static_cast<int>(plot_w / 2), kH - 8, label);
}

}  // namespace

std::string FormatSummary(const ReportContext& c, const std::vector<RunStats>& runs) {
  std::string out = absl::StrFormat(
      "normgrad-load: %s against %s, shapes %s, %d connection(s), transport %s%s\n", c.call,
      c.target, c.shapes, c.connections, c.transport,
      c.rate > 0 ? absl::StrFormat(", rate %.4g/s %s", c.rate, c.poisson ? "poisson" : "constant")
                 : "");
  if (c.hit_max_duration) out += "note: stopped by --max-duration before the requested amount\n";
  for (const RunStats& r : runs) {
    absl::StrAppend(
        &out, absl::StrFormat(
                  "\nConcurrency %d%s\n"
                  "  Requests:      %d (successes %d, errors %d)\n"
                  "  Wall time:     %.3f s\n"
                  "  Requests/sec:  %.2f (successes/sec %.2f)\n"
                  "  Payload:       %.4f GB/s\n"
                  "  Latency (ms):  min %.3f  mean %.3f  p50 %.3f  p90 %.3f  p95 %.3f  p99 %.3f  "
                  "p99.9 %.3f  max %.3f\n",
                  r.concurrency,
                  c.sweep ? absl::StrFormat(" (%d windows, %s)", r.windows,
                                            r.stable ? "stable" : "NOT stable")
                          : "",
                  r.requests, r.successes, r.requests - r.successes, r.wall_seconds,
                  r.requests_per_second, r.successes_per_second, r.payload_gb_per_second, r.min_ms,
                  r.mean_ms, r.p50_ms, r.p90_ms, r.p95_ms, r.p99_ms, r.p999_ms, r.max_ms));
    if (!r.histogram.empty()) {
      out += "  Latency histogram (ms):\n";
      uint64_t peak = 1;
      for (const HistogramBucket& b : r.histogram) peak = std::max(peak, b.count);
      for (const HistogramBucket& b : r.histogram) {
        absl::StrAppend(&out, absl::StrFormat("    %10.3f [%6d] |%s\n", b.lower_ms, b.count,
                                              std::string(40 * b.count / peak, '#')));
      }
    }
    out += "  Status codes:\n";
    absl::StrAppend(&out, absl::StrFormat("    %-20s %d\n", "OK", r.successes));
    for (const auto& [code, n] : r.errors_by_code) {
      absl::StrAppend(&out, absl::StrFormat("    %-20s %d\n", code, n));
    }
  }
  return out;
}

std::string FormatJson(const ReportContext& c, const std::vector<RunStats>& runs) {
  nlohmann::ordered_json items = nlohmann::ordered_json::array();
  for (const RunStats& r : runs) items.push_back(RunJson(r));
  const nlohmann::ordered_json report = {{"call", c.call},
                                         {"target", c.target},
                                         {"shapes", c.shapes},
                                         {"transport", c.transport},
                                         {"connections", c.connections},
                                         {"rate", JsonNumber(c.rate)},
                                         {"rate_distribution", c.poisson ? "poisson" : "constant"},
                                         {"mode", c.sweep ? "sweep" : "fixed"},
                                         {"hit_max_duration", c.hit_max_duration},
                                         {"runs", items}};
  // Compact; bytes that are not UTF-8 (a target as given) become U+FFFD rather than an error.
  return report.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

std::string FormatCsv(const std::vector<RunStats>& runs) {
  std::string out =
      "concurrency,requests,successes,errors,wall_seconds,requests_per_second,"
      "successes_per_second,payload_gb_per_second,min_ms,mean_ms,p50_ms,p90_ms,p95_ms,p99_ms,"
      "p99_9_ms,max_ms,windows,stable\n";
  for (const RunStats& r : runs) {
    absl::StrAppend(
        &out,
        absl::StrJoin({absl::StrCat(r.concurrency), absl::StrCat(r.requests),
                       absl::StrCat(r.successes), absl::StrCat(r.requests - r.successes),
                       Num(r.wall_seconds), Num(r.requests_per_second), Num(r.successes_per_second),
                       Num(r.payload_gb_per_second), Num(r.min_ms), Num(r.mean_ms), Num(r.p50_ms),
                       Num(r.p90_ms), Num(r.p95_ms), Num(r.p99_ms), Num(r.p999_ms), Num(r.max_ms),
                       absl::StrCat(r.windows), std::string(r.stable ? "true" : "false")},
                      ","),
        "\n");
  }
  return out;
}

std::string FormatHtml(const ReportContext& c, const std::vector<RunStats>& runs) {
  std::string out = absl::StrCat(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>normgrad-load report</title>"
      "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
      "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>\n"
      "<h1>normgrad-load</h1><p>",
      HtmlEscape(c.call), " against ", HtmlEscape(c.target), ", shapes ", HtmlEscape(c.shapes),
      ", ", c.connections, " connection(s)",
      c.rate > 0 ? absl::StrFormat(", rate %.4g/s (%s)", c.rate, c.poisson ? "poisson" : "constant")
                 : "",
      c.hit_max_duration ? "; stopped by --max-duration" : "", "</p>\n");
  out +=
      "<table><tr><th>concurrency</th><th>requests</th><th>successes</th><th>errors</th>"
      "<th>req/s</th><th>GB/s</th><th>p50 ms</th><th>p90 ms</th><th>p99 ms</th>"
      "<th>p99.9 ms</th><th>max ms</th><th>errors by code</th></tr>\n";
  for (const RunStats& r : runs) {
    std::vector<std::string> errors;
    for (const auto& [code, n] : r.errors_by_code) errors.push_back(absl::StrCat(code, " ", n));
    absl::StrAppend(
        &out,
        absl::StrFormat("<tr><td>%d</td><td>%d</td><td>%d</td><td>%d</td><td>%.2f</td><td>%.4f</"
                        "td><td>%.3f</td>"
                        "<td>%.3f</td><td>%.3f</td><td>%.3f</td><td>%.3f</td><td>%s</td></tr>\n",
                        r.concurrency, r.requests, r.successes, r.requests - r.successes,
                        r.successes_per_second, r.payload_gb_per_second, r.p50_ms, r.p90_ms,
                        r.p99_ms, r.p999_ms, r.max_ms, HtmlEscape(absl::StrJoin(errors, ", "))));
  }
  out += "</table>\n";
  if (c.sweep && !runs.empty()) {
    out += "<h2>Throughput</h2>\n";
    out += LineSvg(
        runs, [](const RunStats& r) { return r.successes_per_second; }, "successful requests/s");
    out += "\n<h2>p99 latency</h2>\n";
    out += LineSvg(
        runs, [](const RunStats& r) { return r.p99_ms; }, "p99 latency (ms)");
    out += "\n";
  }
  for (const RunStats& r : runs) {
    absl::StrAppend(&out, "<h2>Latency histogram, concurrency ", r.concurrency, "</h2>\n",
                    HistogramSvg(r), "\n");
  }
  out += "</body></html>\n";
  return out;
}

}  // namespace normgrad::tools
