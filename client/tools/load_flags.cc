#include "client/tools/load_flags.h"

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/tools/cli.h"
#include "client/tools/flag_parser.h"
#include "client/tools/load_report.h"

namespace normgrad::tools {

const char kLoadUsage[] =
    "usage: normgrad-load [flags]\n"
    "  --target ADDR[,ADDR...]   server(s) (default $NORMGRAD_TARGET or localhost:50051)\n"
    "  --call backward|emit-ptx  RPC to drive (default backward)\n"
    "  --concurrency N           requests in flight (default 8)\n"
    "  --connections N           separate connections, requests spread round-robin (default 1)\n"
    "  --total N                 requests to send (default 200 when --duration is not set)\n"
    "  --duration D              run time such as 10s (issuing stops; in-flight ones finish)\n"
    "  --max-duration D          hard bound of every phase (default 60s)\n"
    "  --rate R                  requests/s (default 0: as fast as --concurrency allows)\n"
    "  --rate-dist constant|poisson\n"
    "  --shapes RxH[,RxH...]     rows x hidden_dim mix, cycled (default 64x4096)\n"
    "  --warmup N                unmeasured requests first (default 0)\n"
    "  --concurrency-sweep S:E:P measure concurrency S..E step P until stable\n"
    "  --window D                sweep measurement window (default 1s)\n"
    "  --stability-percent P     sweep stability band (default 10)\n"
    "  --max-windows N           sweep windows per step at most (default 10)\n"
    "  --kernel NAME --gpu-target sm_XX   EmitPtx request (defaults batched_rms_norm_backward, "
    "sm_90)\n"
    "  --format summary|json|csv -o FILE --html FILE\n"
    "  client flags: --token-file (else $NORMGRAD_TOKEN) --token --deadline --max-attempts\n"
    "                --chunk-bytes --tls --tls-ca --tls-cert --tls-key --tls-server-name\n";

absl::StatusOr<std::vector<Shape>> ParseShapes(absl::string_view text) {
  std::vector<Shape> shapes;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, 'x');
    Shape shape;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &shape.rows) ||
        !absl::SimpleAtoi(parts[1], &shape.hidden_dim) || shape.rows == 0 ||
        shape.hidden_dim == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shapes: \"", item, "\" is not ROWSxHIDDEN with both > 0"));
    }
    shapes.push_back(shape);
  }
  if (shapes.empty()) return absl::InvalidArgumentError("--shapes: empty");
  return shapes;
}

absl::StatusOr<LoadCommand> ParseLoadCommand(const std::vector<std::string>& args,
                                             const std::string& env_target) {
  FlagSpec spec;
  for (const char* f : {"target",
                        "call",
                        "concurrency",
                        "connections",
                        "total",
                        "duration",
                        "max-duration",
                        "rate",
                        "rate-dist",
                        "shapes",
                        "warmup",
                        "concurrency-sweep",
                        "window",
                        "stability-percent",
                        "max-windows",
                        "kernel",
                        "gpu-target",
                        "format",
                        "o",
                        "html",
                        "seed"}) {
    spec[f] = true;
  }
  spec["help"] = false;
  AddClientFlags(spec);
  absl::StatusOr<ParsedArgs> parsed = ParseArgs(args, spec);
  if (!parsed.ok()) return parsed.status();
  LoadCommand cmd;
  if (parsed->Has("help")) {
    cmd.help = true;
    return cmd;
  }
  if (!parsed->positional.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", parsed->positional.front(), "\""));
  }
  cmd.target_text = parsed->Get("target", env_target.empty() ? "localhost:50051" : env_target);
  absl::StatusOr<ClientOptions> client = ClientOptionsFromFlags(*parsed, cmd.target_text);
  if (!client.ok()) return client.status();
  LoadConfig& c = cmd.config;
  c.client = *client;
  if (!parsed->Has("deadline")) c.client.default_deadline = absl::Seconds(30);

  auto int_flag = [&](const char* name, auto* value) -> absl::Status {
    if (parsed->Has(name) && !absl::SimpleAtoi(parsed->Get(name), value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": \"", parsed->Get(name), "\" is not an integer"));
    }
    return absl::OkStatus();
  };
  auto duration_flag = [&](const char* name, absl::Duration* value) -> absl::Status {
    if (parsed->Has(name) && !absl::ParseDuration(parsed->Get(name), value)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": \"", parsed->Get(name),
                                                     "\" is not a duration such as 10s or 500ms"));
    }
    return absl::OkStatus();
  };
  auto double_flag = [&](const char* name, double* value) -> absl::Status {
    if (parsed->Has(name) && !absl::SimpleAtod(parsed->Get(name), value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": \"", parsed->Get(name), "\" is not a number"));
    }
    return absl::OkStatus();
  };
  for (absl::Status s :
       {int_flag("concurrency", &c.concurrency), int_flag("connections", &c.connections),
        int_flag("total", &c.total), int_flag("warmup", &c.warmup),
        int_flag("max-windows", &c.max_windows), int_flag("seed", &c.seed),
        duration_flag("duration", &c.duration), duration_flag("max-duration", &c.max_duration),
        duration_flag("window", &c.window), double_flag("rate", &c.rate),
        double_flag("stability-percent", &c.stability_percent)}) {
    if (!s.ok()) return s;
  }
  if (!parsed->Has("total") && !parsed->Has("duration")) c.total = 200;

  const std::string call = parsed->Get("call", "backward");
  if (call == "backward") {
    c.call = LoadCall::kBackward;
  } else if (call == "emit-ptx") {
    c.call = LoadCall::kEmitPtx;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--call: \"", call, "\" is not backward or emit-ptx"));
  }
  const std::string dist = parsed->Get("rate-dist", "constant");
  if (dist != "constant" && dist != "poisson") {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate-dist: \"", dist, "\" is not constant or poisson"));
  }
  c.poisson = dist == "poisson";
  cmd.shapes_text = parsed->Get("shapes", "64x4096");
  absl::StatusOr<std::vector<Shape>> shapes = ParseShapes(cmd.shapes_text);
  if (!shapes.ok()) return shapes.status();
  c.shapes = *shapes;
  c.kernel = parsed->Get("kernel", c.kernel);
  c.gpu_target = parsed->Get("gpu-target", c.gpu_target);

  if (parsed->Has("concurrency-sweep")) {
    std::vector<absl::string_view> parts = absl::StrSplit(parsed->Get("concurrency-sweep"), ':');
    if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtoi(parts[0], &c.sweep_start) ||
        !absl::SimpleAtoi(parts[1], &c.sweep_end) ||
        (parts.size() == 3 && !absl::SimpleAtoi(parts[2], &c.sweep_step))) {
      return absl::InvalidArgumentError(absl::StrCat("--concurrency-sweep: \"",
                                                     parsed->Get("concurrency-sweep"),
                                                     "\" is not START:END[:STEP]"));
    }
    c.sweep = true;
  }

  cmd.output.format = parsed->Get("format", "summary");
  if (cmd.output.format != "summary" && cmd.output.format != "json" && cmd.output.format != "csv") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format: \"", cmd.output.format, "\" is not summary, json or csv"));
  }
  cmd.output.output_path = parsed->Get("o");
  cmd.output.html_path = parsed->Get("html");
  return cmd;
}

int RunLoad(const std::vector<std::string>& args, const std::string& env_target,
            bool progress_terminal, std::ostream& out, std::ostream& err) {
  absl::StatusOr<LoadCommand> cmd = ParseLoadCommand(args, env_target);
  if (!cmd.ok()) {
    err << "normgrad-load: " << cmd.status().message() << "\n";
    return 2;
  }
  if (cmd->help) {
    out << kLoadUsage;
    return 0;
  }
  absl::StatusOr<std::unique_ptr<LoadRunner>> runner = LoadRunner::Create(cmd->config);
  if (!runner.ok()) {
    err << "normgrad-load: " << runner.status().message() << "\n";
    return 2;
  }

  // Live progress line on a terminal, redrawn a few times a second.
  std::promise<void> done_promise;
  std::future<void> done = done_promise.get_future();
  std::thread progress;
  if (progress_terminal) {
    progress = std::thread([&] {
      const absl::Time start = absl::Now();
      while (done.wait_for(std::chrono::milliseconds(250)) != std::future_status::ready) {
        const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
        const uint64_t n = (*runner)->completed();
        err << absl::StrFormat("\r[%6.1fs] concurrency %d: %d done, %d errors, %.1f req/s   ",
                               seconds, (*runner)->current_concurrency(), n, (*runner)->failed(),
                               seconds > 0 ? n / seconds : 0.0)
            << std::flush;
      }
      err << "\r\033[K" << std::flush;
    });
  }
  absl::StatusOr<std::vector<RunStats>> runs = (*runner)->Run();
  done_promise.set_value();
  if (progress.joinable()) progress.join();
  if (!runs.ok()) {
    err << "normgrad-load: " << runs.status().message() << "\n";
    return 1;
  }

  ReportContext context;
  context.call = cmd->config.call == LoadCall::kBackward ? "backward" : "emit-ptx";
  context.target = cmd->target_text;
  context.shapes = cmd->shapes_text;
  context.connections = cmd->config.connections;
  context.rate = cmd->config.rate;
  context.poisson = cmd->config.poisson;
  context.sweep = cmd->config.sweep;
  context.hit_max_duration = (*runner)->hit_max_duration();

  std::string report;
  if (cmd->output.format == "json") {
    report = FormatJson(context, *runs);
  } else if (cmd->output.format == "csv") {
    report = FormatCsv(*runs);
  } else {
    report = FormatSummary(context, *runs);
  }
  auto write = [&err](const std::string& path, const std::string& text) {
    std::ofstream file(path, std::ios::trunc);
    file << text;
    file.close();
    if (!file) err << "normgrad-load: " << path << ": cannot write\n";
    return static_cast<bool>(file);
  };
  if (cmd->output.output_path.empty()) {
    out << report;
  } else if (!write(cmd->output.output_path, report)) {
    return 1;
  }
  if (!cmd->output.html_path.empty() && !write(cmd->output.html_path, FormatHtml(context, *runs))) {
    return 1;
  }
  return 0;
}

}  // namespace normgrad::tools
