#include "client/tools/load_flags.h"

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/tools/load_report.h"
#include "client/tools/tool_flags.h"

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
    "                --chunk-bytes --transport auto|bytes|shm --tls --tls-ca --tls-cert --tls-key\n"
    "                --tls-server-name\n";

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
  LoadCommand cmd;
  LoadConfig& c = cmd.config;
  cmd.target_text = env_target.empty() ? "localhost:50051" : env_target;
  cmd.shapes_text = "64x4096";
  std::string call = "backward";
  std::string rate_distribution = "constant";
  std::optional<std::string> sweep;
  ClientFlags client;

  CLI::App app("normgrad-load", "normgrad-load");
  ConfigureToolApp(app);
  app.add_option("--target", cmd.target_text)->type_name("ADDR[,ADDR...]");
  app.add_option("--call", call)->type_name("backward|emit-ptx");
  AddIntegerOption(app, "--concurrency", &c.concurrency);
  AddIntegerOption(app, "--connections", &c.connections);
  AddIntegerOption(app, "--total", &c.total);
  AddDurationOption(app, "--duration", &c.duration);
  AddDurationOption(app, "--max-duration", &c.max_duration);
  AddNumberOption(app, "--rate", &c.rate);
  app.add_option("--rate-dist", rate_distribution)->type_name("constant|poisson");
  app.add_option("--shapes", cmd.shapes_text)->type_name("RxH[,RxH...]");
  AddIntegerOption(app, "--warmup", &c.warmup);
  app.add_option("--concurrency-sweep", sweep)->type_name("S:E[:P]");
  AddDurationOption(app, "--window", &c.window);
  AddNumberOption(app, "--stability-percent", &c.stability_percent);
  AddIntegerOption(app, "--max-windows", &c.max_windows);
  app.add_option("--kernel", c.kernel)->type_name("NAME");
  app.add_option("--gpu-target", c.gpu_target)->type_name("sm_XX");
  app.add_option("--format", cmd.output.format)->type_name("summary|json|csv");
  app.add_option("-o", cmd.output.output_path)->type_name("FILE");
  app.add_option("--html", cmd.output.html_path)->type_name("FILE");
  AddIntegerOption(app, "--seed", &c.seed);
  app.add_flag("--help", cmd.help);
  AddClientFlags(app, client);

  if (absl::Status s = ParseToolArgs(app, args); !s.ok()) return s;
  if (absl::Status s = CheckAllPlaced(app); !s.ok()) return s;
  if (cmd.help) return cmd;
  absl::StatusOr<ClientOptions> options = ClientOptionsFromFlags(client, cmd.target_text);
  if (!options.ok()) return options.status();
  c.client = *std::move(options);
  if (!client.deadline) c.client.default_deadline = absl::Seconds(30);
  if (app.count("--total") == 0 && app.count("--duration") == 0) c.total = 200;

  if (call == "backward") {
    c.call = LoadCall::kBackward;
  } else if (call == "emit-ptx") {
    c.call = LoadCall::kEmitPtx;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--call: \"", call, "\" is not backward or emit-ptx"));
  }
  if (rate_distribution != "constant" && rate_distribution != "poisson") {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate-dist: \"", rate_distribution, "\" is not constant or poisson"));
  }
  c.poisson = rate_distribution == "poisson";
  absl::StatusOr<std::vector<Shape>> shapes = ParseShapes(cmd.shapes_text);
  if (!shapes.ok()) return shapes.status();
  c.shapes = *shapes;

  if (sweep) {
    std::vector<absl::string_view> parts = absl::StrSplit(*sweep, ':');
    if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtoi(parts[0], &c.sweep_start) ||
        !absl::SimpleAtoi(parts[1], &c.sweep_end) ||
        (parts.size() == 3 && !absl::SimpleAtoi(parts[2], &c.sweep_step))) {
      return absl::InvalidArgumentError(
          absl::StrCat("--concurrency-sweep: \"", *sweep, "\" is not START:END[:STEP]"));
    }
    c.sweep = true;
  }

  if (cmd.output.format != "summary" && cmd.output.format != "json" && cmd.output.format != "csv") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format: \"", cmd.output.format, "\" is not summary, json or csv"));
  }
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
  context.transport = TransportName(cmd->config.client.transport);
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
