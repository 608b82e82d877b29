// Reports of a load run: a terminal summary (ghz-like), JSON, CSV (one row per run, as
// perf_analyzer writes per concurrency) and a self-contained HTML page with inline SVG charts.
#pragma once

#include <string>
#include <vector>

#include "client/tools/load_stats.h"

namespace normgrad::tools {

// What the run was, for report headers.
struct ReportContext {
  std::string call;    // "backward" or "emit-ptx"
  std::string target;  // as given
  std::string shapes;  // "64x4096,128x896"
  std::string transport = "auto";  // ClientOptions::transport: auto, bytes, shm
  int connections = 1;
  double rate = 0;  // 0: as fast as concurrency allows
  bool poisson = false;
  bool sweep = false;
  bool hit_max_duration = false;  // the run was cut short by --max-duration
};

std::string FormatSummary(const ReportContext& context, const std::vector<RunStats>& runs);
std::string FormatJson(const ReportContext& context, const std::vector<RunStats>& runs);
std::string FormatCsv(const std::vector<RunStats>& runs);
// Latency histogram of every run; for a sweep also throughput and p99 against concurrency.
// No scripts, no external resources.
std::string FormatHtml(const ReportContext& context, const std::vector<RunStats>& runs);

}  // namespace normgrad::tools
