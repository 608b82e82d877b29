#include "client/tools/cli.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/tools/npy.h"

namespace normgrad::tools {
namespace {

constexpr char kUsage[] =
    "usage: normgrad [--target=HOST:PORT] <command> [flags]\n"
    "commands:\n"
    "  backward --x X.npy --dy DY.npy --gamma G.npy [--rms RMS.npy] [--eps 1e-5]\n"
    "           [--kernel NAME] [--dx DX.npy] [--dgamma DG.npy]\n"
    "  emit-ptx --kernel NAME --hidden-dim N [--target sm_90] [--ptx-version 8.0]\n"
    "           [--dtype f32|bf16|f16] [-o FILE] [--cubin FILE]   (server: --server or global "
    "--target)\n"
    "  info     server version, backend, device, limits, cache (JSON)\n"
    "  health   [--service NAME]   grpc.health.v1 check; exit 0 when SERVING, 3 otherwise\n"
    "client flags (any command): --token-file FILE (else $NORMGRAD_TOKEN; --token T is visible\n"
    "  to other users in the process list) --deadline 30s --max-attempts N --chunk-bytes N\n"
    "  --tls --tls-ca FILE --tls-cert FILE --tls-key FILE --tls-server-name NAME\n"
    "the server is --target, else $NORMGRAD_TARGET, else localhost:50051\n";

int UsageError(std::ostream& err, absl::string_view message) {
  err << "normgrad: " << message << "\n";
  return kExitUsage;
}

int ServerError(std::ostream& err, const absl::Status& status) {
  err << "error: " << absl::StatusCodeToString(status.code()) << ": " << status.message() << "\n";
  return kExitServerError;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, ": cannot open ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// Progress bar on stderr (a terminal): "[#######.........]  43%  4300/10000 rows".
class ProgressBar {
 public:
  explicit ProgressBar(std::ostream& err) : err_(err) {}
  void Update(uint64_t done, uint64_t total) {
    std::lock_guard<std::mutex> lock(mu_);
    constexpr int kWidth = 30;
    const int filled = total == 0 ? kWidth : static_cast<int>(kWidth * done / total);
    err_ << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] "
         << absl::StrFormat("%3d%%  %d/%d rows", total == 0 ? 100 : 100 * done / total, done, total)
         << std::flush;
    drawn_ = true;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    if (drawn_) err_ << "\r\033[K" << std::flush;
  }

 private:
  std::mutex mu_;
  std::ostream& err_;
  bool drawn_ = false;
};

int Backward(const ParsedArgs& args, const ClientOptions& options, const CliEnvironment& env,
             std::ostream& out, std::ostream& err) {
  for (const char* required : {"x", "dy", "gamma"}) {
    if (!args.Has(required))
      return UsageError(err, absl::StrCat("backward: --", required, " is required"));
  }
  float eps = 1e-5f;
  if (args.Has("eps") && !absl::SimpleAtof(args.Get("eps"), &eps)) {
    return UsageError(err, absl::StrCat("--eps: not a number: \"", args.Get("eps"), "\""));
  }
  absl::StatusOr<npy::Array> x = npy::ReadF32(args.Get("x"));
  if (!x.ok()) return UsageError(err, x.status().message());
  absl::StatusOr<npy::Array> dy = npy::ReadF32(args.Get("dy"));
  if (!dy.ok()) return UsageError(err, dy.status().message());
  absl::StatusOr<npy::Array> gamma = npy::ReadF32(args.Get("gamma"));
  if (!gamma.ok()) return UsageError(err, gamma.status().message());

  if (x->shape.size() < 2) {
    return UsageError(err, absl::StrCat(args.Get("x"), ": shape ", npy::ShapeString(x->shape),
                                        "; x needs 2 or more dimensions (rows..., hidden)"));
  }
  const uint64_t hidden = x->shape.back();
  const uint64_t rows = hidden == 0 ? 0 : x->data.size() / hidden;
  if (dy->shape != x->shape) {
    return UsageError(err, absl::StrCat(args.Get("dy"), ": shape ", npy::ShapeString(dy->shape),
                                        " differs from x's ", npy::ShapeString(x->shape)));
  }
  if (gamma->shape.size() != 1 || gamma->shape[0] != hidden) {
    return UsageError(err,
                      absl::StrCat(args.Get("gamma"), ": shape ", npy::ShapeString(gamma->shape),
                                   "; expected (", hidden, ",) to match x's last dimension"));
  }
  if (rows == 0 || hidden == 0) {
    return UsageError(
        err, absl::StrCat(args.Get("x"), ": shape ", npy::ShapeString(x->shape), " is empty"));
  }
  std::vector<float> rms;
  if (args.Has("rms")) {
    absl::StatusOr<npy::Array> r = npy::ReadF32(args.Get("rms"));
    if (!r.ok()) return UsageError(err, r.status().message());
    const std::vector<uint64_t> row_shape(x->shape.begin(), x->shape.end() - 1);
    if (r->data.size() != rows || (r->shape != row_shape && r->shape.size() != 1)) {
      return UsageError(
          err, absl::StrCat(args.Get("rms"), ": shape ", npy::ShapeString(r->shape), "; expected ",
                            npy::ShapeString(row_shape), " (one value per row)"));
    }
    rms = std::move(r->data);
  }

  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  BackwardOptions call;
  call.kernel = args.Get("kernel");
  call.rms = rms;
  ProgressBar bar(err);
  // A bar only for batches that take several messages, and only on a terminal.
  if (env.stderr_is_terminal && x->data.size() * sizeof(float) > options.chunk_bytes) {
    call.on_progress = [&bar](uint64_t done, uint64_t total) { bar.Update(done, total); };
  }
  absl::StatusOr<Gradients> g = (*client)->Backward(x->data, dy->data, gamma->data, eps, call);
  bar.Clear();
  if (!g.ok()) return ServerError(err, g.status());

  if (args.Has("dx")) {
    if (absl::Status s = npy::WriteF32(args.Get("dx"), x->shape, g->dx); !s.ok()) {
      return UsageError(err, s.message());
    }
  }
  if (args.Has("dgamma")) {
    const uint64_t shape[] = {hidden};
    if (absl::Status s = npy::WriteF32(args.Get("dgamma"), shape, g->dgamma); !s.ok()) {
      return UsageError(err, s.message());
    }
  }
  out << absl::StrFormat(
      "rows=%d hidden_dim=%d backend=%s kernel=%s chunks=%d compute_seconds=%.6f "
      "server_seconds=%.6f\n",
      rows, hidden, g->summary.backend, g->summary.kernel, g->summary.chunks,
      g->summary.compute_seconds, g->summary.total_seconds);
  return kExitOk;
}

int EmitPtx(const ParsedArgs& args, const ClientOptions& options, std::ostream& out,
            std::ostream& err) {
  if (!args.Has("kernel")) return UsageError(err, "emit-ptx: --kernel is required");
  v1::EmitPtxRequest request;
  request.set_kernel(args.Get("kernel"));
  if (args.Has("hidden-dim")) {
    uint32_t hidden = 0;
    if (!absl::SimpleAtoi(args.Get("hidden-dim"), &hidden)) {
      return UsageError(err, absl::StrCat("--hidden-dim: not a non-negative integer: \"",
                                          args.Get("hidden-dim"), "\""));
    }
    request.set_hidden_dim(hidden);
  }
  const std::string dtype = args.Get("dtype", "f32");
  if (dtype == "f32") {
    request.set_dtype(v1::DTYPE_F32);
  } else if (dtype == "bf16") {
    request.set_dtype(v1::DTYPE_BF16);
  } else if (dtype == "f16") {
    request.set_dtype(v1::DTYPE_F16);
  } else {
    return UsageError(err, absl::StrCat("--dtype: \"", dtype, "\" is not f32, bf16 or f16"));
  }
  request.set_target(args.Get("target"));
  request.set_ptx_version(args.Get("ptx-version"));
  request.set_cubin(args.Has("cubin"));

  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  absl::StatusOr<v1::EmitPtxResponse> ptx = (*client)->EmitPtx(request);
  if (!ptx.ok()) return ServerError(err, ptx.status());

  auto write = [&](const std::string& path, const std::string& bytes) -> bool {
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    file.close();
    if (!file) {
      err << "normgrad: " << path << ": cannot write\n";
      return false;
    }
    return true;
  };
  if (args.Has("o")) {
    if (!write(args.Get("o"), ptx->ptx())) return kExitUsage;
    err << absl::StrFormat("wrote %s: entry %s, %s, PTX %s, sha256 %s (%d bytes)\n", args.Get("o"),
                           ptx->entry(), ptx->target(), ptx->ptx_version(), ptx->digest().sha256(),
                           ptx->digest().size_bytes());
  } else {
    out << ptx->ptx();
  }
  if (args.Has("cubin")) {
    if (!write(args.Get("cubin"), ptx->cubin())) return kExitUsage;
    err << absl::StrFormat("wrote %s: cubin sha256 %s (%d bytes)\n", args.Get("cubin"),
                           ptx->cubin_digest().sha256(), ptx->cubin().size());
  }
  return kExitOk;
}

int Info(const ClientOptions& options, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->ServerInfo();
  if (!info.ok()) return ServerError(err, info.status());
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.always_print_primitive_fields = true;
  print.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(*info, &json, print).ok()) {
    err << "normgrad: cannot print the server's reply as JSON\n";
    return kExitServerError;
  }
  out << json;
  return kExitOk;
}

int Health(const ParsedArgs& args, const ClientOptions& options, std::ostream& out,
           std::ostream& err) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  absl::StatusOr<HealthStatus> health = (*client)->Health(args.Get("service"));
  if (!health.ok()) return ServerError(err, health.status());
  out << HealthStatusName(*health) << "\n";
  return *health == HealthStatus::kServing ? kExitOk : kExitNotServing;
}

}  // namespace

void AddClientFlags(FlagSpec& spec) {
  for (const char* name : {"token", "token-file", "deadline", "max-attempts", "chunk-bytes", "tls-ca", "tls-cert",
                           "tls-key", "tls-server-name"}) {
    spec[name] = true;
  }
  spec["tls"] = false;
}

absl::StatusOr<ClientOptions> ClientOptionsFromFlags(const ParsedArgs& args, std::string target) {
  ClientOptions options;
  options.target = std::move(target);
  // The token: --token-file (contents, whitespace trimmed), else --token, else $NORMGRAD_TOKEN.
  if (args.Has("token-file") && args.Has("token")) {
    return absl::InvalidArgumentError("--token and --token-file exclude each other");
  }
  if (args.Has("token-file")) {
    absl::StatusOr<std::string> token = ReadFile(args.Get("token-file"), "token-file");
    if (!token.ok()) return token.status();
    options.bearer_token = std::string(absl::StripAsciiWhitespace(*token));
    if (options.bearer_token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token-file: ", args.Get("token-file"), " is empty"));
    }
  } else if (args.Has("token")) {
    options.bearer_token = args.Get("token");
  } else if (const char* env = std::getenv("NORMGRAD_TOKEN"); env != nullptr) {
    options.bearer_token = std::string(absl::StripAsciiWhitespace(env));
  }
  if (args.Has("deadline") &&
      !absl::ParseDuration(args.Get("deadline"), &options.default_deadline)) {
    return absl::InvalidArgumentError(absl::StrCat("--deadline: \"", args.Get("deadline"),
                                                   "\" is not a duration such as 30s or 500ms"));
  }
  if (args.Has("max-attempts") &&
      (!absl::SimpleAtoi(args.Get("max-attempts"), &options.max_attempts) ||
       options.max_attempts < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-attempts: \"", args.Get("max-attempts"), "\" is not an integer >= 1"));
  }
  if (args.Has("chunk-bytes") &&
      (!absl::SimpleAtoi(args.Get("chunk-bytes"), &options.chunk_bytes) ||
       options.chunk_bytes == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--chunk-bytes: \"", args.Get("chunk-bytes"), "\" is not an integer >= 1"));
  }
  options.use_tls = args.Has("tls") || args.Has("tls-ca") || args.Has("tls-cert");
  if (args.Has("tls-cert") != args.Has("tls-key")) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  const std::pair<const char*, std::string*> files[] = {{"tls-ca", &options.tls.root_certs_pem},
                                                        {"tls-cert", &options.tls.client_cert_pem},
                                                        {"tls-key", &options.tls.client_key_pem}};
  for (const auto& [flag, field] : files) {
    if (!args.Has(flag)) continue;
    absl::StatusOr<std::string> pem = ReadFile(args.Get(flag), flag);
    if (!pem.ok()) return pem.status();
    *field = std::move(*pem);
  }
  options.tls.server_name_override = args.Get("tls-server-name");
  return options;
}

int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err) {
  // Global flags come before the command; the command's own flags after it. For emit-ptx,
  // "--target" after the command is the GPU architecture (as in normgrad-ptx).
  FlagSpec global = {{"target", true}, {"server", true}, {"help", false}};
  AddClientFlags(global);
  size_t command_at = 0;
  while (command_at < args.size() && absl::StartsWith(args[command_at], "-")) {
    const std::string& a = args[command_at];
    std::string name = a.substr(a.find_first_not_of('-'));
    const bool inline_value = name.find('=') != std::string::npos;
    name = name.substr(0, name.find('='));
    auto it = global.find(name);
    command_at += (it != global.end() && it->second && !inline_value) ? 2 : 1;
  }
  absl::StatusOr<ParsedArgs> global_args = ParseArgs(
      std::vector<std::string>(args.begin(), args.begin() + std::min(command_at, args.size())),
      global);
  if (!global_args.ok()) return UsageError(err, global_args.status().message());
  if (command_at >= args.size() || global_args->Has("help")) {
    if (global_args->Has("help")) {
      out << kUsage;
      return kExitOk;
    }
    err << kUsage;
    return kExitUsage;
  }
  const std::string command = args[command_at];
  if (command == "help") {
    out << kUsage;
    return kExitOk;
  }

  FlagSpec spec = global;
  spec.erase("help");
  if (command == "backward") {
    for (const char* f : {"x", "dy", "gamma", "rms", "eps", "kernel", "dx", "dgamma"})
      spec[f] = true;
  } else if (command == "emit-ptx") {
    for (const char* f : {"kernel", "hidden-dim", "ptx-version", "dtype", "o", "cubin"})
      spec[f] = true;
  } else if (command == "health") {
    spec["service"] = true;
  } else if (command != "info") {
    return UsageError(
        err, absl::StrCat("unknown command \"", command, "\" (backward, emit-ptx, info, health)"));
  }
  absl::StatusOr<ParsedArgs> parsed =
      ParseArgs(std::vector<std::string>(args.begin() + command_at + 1, args.end()), spec);
  if (!parsed.ok()) return UsageError(err, absl::StrCat(command, ": ", parsed.status().message()));
  if (!parsed->positional.empty()) {
    return UsageError(
        err, absl::StrCat(command, ": unexpected argument \"", parsed->positional.front(), "\""));
  }
  // Command flags override global ones, except --target of emit-ptx (the GPU architecture).
  ParsedArgs merged = *global_args;
  for (const auto& [name, value] : parsed->values) {
    if (command == "emit-ptx" && name == "target") continue;
    merged.values[name] = value;
  }
  std::string target = env.normgrad_target.empty() ? "localhost:50051" : env.normgrad_target;
  if (merged.Has("target")) target = merged.Get("target");
  if (merged.Has("server")) target = merged.Get("server");
  absl::StatusOr<ClientOptions> options = ClientOptionsFromFlags(merged, target);
  if (!options.ok()) return UsageError(err, options.status().message());

  if (command == "backward") return Backward(*parsed, *options, env, out, err);
  if (command == "emit-ptx") return EmitPtx(*parsed, *options, out, err);
  if (command == "info") return Info(*options, out, err);
  return Health(*parsed, *options, out, err);
}

}  // namespace normgrad::tools
