#include "client/tools/tool_flags.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"

namespace normgrad::tools {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, ": cannot open ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace

void ConfigureToolApp(CLI::App& app) {
  app.set_help_flag();
  app.allow_extras();
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

absl::Status ParseToolArgs(CLI::App& app, const std::vector<std::string>& args) {
  // CLI11 takes the arguments last first.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  return absl::OkStatus();
}

std::optional<Unplaced> FirstUnplaced(const CLI::App& app) {
  bool flags_ended = false;
  for (const std::string& arg : app.remaining()) {
    if (arg == "--" && !flags_ended) {
      flags_ended = true;
      continue;
    }
    return Unplaced{arg, !flags_ended && arg.size() > 1 && arg[0] == '-'};
  }
  return std::nullopt;
}

absl::Status CheckAllPlaced(const CLI::App& app) {
  const std::optional<Unplaced> first = FirstUnplaced(app);
  if (!first) return absl::OkStatus();
  if (first->is_flag) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown flag ", first->arg.substr(0, first->arg.find('='))));
  }
  return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", first->arg, "\""));
}

const char* TransportName(Transport transport) {
  switch (transport) {
    case Transport::kAuto:
      return "auto";
    case Transport::kBytes:
      return "bytes";
    case Transport::kSharedMemory:
      return "shm";
  }
  return "auto";
}

void AddClientFlags(CLI::App& app, ClientFlags& flags) {
  app.add_option("--token", flags.token)->type_name("T");
  app.add_option("--token-file", flags.token_file)->type_name("FILE");
  app.add_option("--deadline", flags.deadline)->type_name("DURATION");
  app.add_option("--max-attempts", flags.max_attempts)->type_name("N");
  app.add_option("--chunk-bytes", flags.chunk_bytes)->type_name("N");
  app.add_option("--transport", flags.transport)->type_name("auto|bytes|shm");
  app.add_flag("--tls", flags.tls);
  app.add_option("--tls-ca", flags.tls_ca)->type_name("FILE");
  app.add_option("--tls-cert", flags.tls_cert)->type_name("FILE");
  app.add_option("--tls-key", flags.tls_key)->type_name("FILE");
  app.add_option("--tls-server-name", flags.tls_server_name)->type_name("NAME");
}

absl::StatusOr<ClientOptions> ClientOptionsFromFlags(const ClientFlags& flags, std::string target) {
  ClientOptions options;
  options.target = std::move(target);
  // The token: --token-file (contents, whitespace trimmed), else --token, else $NORMGRAD_TOKEN.
  if (flags.token_file && flags.token) {
    return absl::InvalidArgumentError("--token and --token-file exclude each other");
  }
  if (flags.token_file) {
    absl::StatusOr<std::string> token = ReadFile(*flags.token_file, "token-file");
    if (!token.ok()) return token.status();
    options.bearer_token = std::string(absl::StripAsciiWhitespace(*token));
    if (options.bearer_token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token-file: ", *flags.token_file, " is empty"));
    }
  } else if (flags.token) {
    options.bearer_token = *flags.token;
  } else if (const char* env = std::getenv("NORMGRAD_TOKEN"); env != nullptr) {
    options.bearer_token = std::string(absl::StripAsciiWhitespace(env));
  }
  if (flags.deadline && !absl::ParseDuration(*flags.deadline, &options.default_deadline)) {
    return absl::InvalidArgumentError(absl::StrCat("--deadline: \"", *flags.deadline,
                                                   "\" is not a duration such as 30s or 500ms"));
  }
  if (flags.max_attempts &&
      (!absl::SimpleAtoi(*flags.max_attempts, &options.max_attempts) || options.max_attempts < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-attempts: \"", *flags.max_attempts, "\" is not an integer >= 1"));
  }
  if (flags.chunk_bytes &&
      (!absl::SimpleAtoi(*flags.chunk_bytes, &options.chunk_bytes) || options.chunk_bytes == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--chunk-bytes: \"", *flags.chunk_bytes, "\" is not an integer >= 1"));
  }
  if (flags.transport) {
    if (*flags.transport == "auto") {
      options.transport = Transport::kAuto;
    } else if (*flags.transport == "bytes") {
      options.transport = Transport::kBytes;
    } else if (*flags.transport == "shm") {
      options.transport = Transport::kSharedMemory;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--transport: \"", *flags.transport, "\" is not auto, bytes or shm"));
    }
  }
  options.use_tls = flags.tls || flags.tls_ca || flags.tls_cert;
  if (flags.tls_cert.has_value() != flags.tls_key.has_value()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  const std::tuple<const char*, const std::optional<std::string>&, std::string*> files[] = {
      {"tls-ca", flags.tls_ca, &options.tls.root_certs_pem},
      {"tls-cert", flags.tls_cert, &options.tls.client_cert_pem},
      {"tls-key", flags.tls_key, &options.tls.client_key_pem}};
  for (const auto& [flag, path, field] : files) {
    if (!path) continue;
    absl::StatusOr<std::string> pem = ReadFile(*path, flag);
    if (!pem.ok()) return pem.status();
    *field = std::move(*pem);
  }
  options.tls.server_name_override = flags.tls_server_name;
  return options;
}

CLI::Option* AddNumberOption(CLI::App& app, const std::string& name, double* value) {
  return AddReadOption(app, name, value, absl::SimpleAtod, "a number", "X");
}

CLI::Option* AddDurationOption(CLI::App& app, const std::string& name, absl::Duration* value) {
  return AddReadOption(app, name, value, absl::ParseDuration, "a duration such as 10s or 500ms",
                       "DURATION");
}

}  // namespace normgrad::tools
