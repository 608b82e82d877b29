// What `normgrad` and `normgrad-load` share on the command line, on CLI11: how a tool's CLI::App
// is set up and parsed, the client flags (read into a ClientOptions), and options whose values
// absl reads (integers, numbers, durations such as 30s) with messages that name the flag and the
// value. Re-entrant (no globals), so tests run the tools in-process.
//
//   CLI::App app;
//   ConfigureToolApp(app);
//   ClientFlags client;
//   AddClientFlags(app, client);
//   int concurrency = 8;
//   AddIntegerOption(app, "--concurrency", &concurrency);
//   if (absl::Status s = ParseToolArgs(app, args); !s.ok()) ...      // the message, one line
//   if (absl::Status s = CheckAllPlaced(app); !s.ok()) ...           // "unknown flag --x"
//   absl::StatusOr<ClientOptions> options = ClientOptionsFromFlags(client, "localhost:50051");
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "normgrad/client.h"

namespace normgrad::tools {

// No built-in -h/--help (each tool prints its own usage text); arguments the app cannot place
// are kept in remaining() for CheckAllPlaced instead of failing the parse; a flag given twice
// keeps its last value. Subcommands added afterwards inherit the last two.
void ConfigureToolApp(CLI::App& app);

// Parses `args` (without the program name). INVALID_ARGUMENT with CLI11's message for a flag
// without its value, a bad boolean, or an option's own message (AddIntegerOption and friends).
// CLI11 reports errors as exceptions (CLI::ParseError); this is the one place they become a
// Status, and nothing else here throws outside CLI11's parse.
absl::Status ParseToolArgs(CLI::App& app, const std::vector<std::string>& args);

// The first argument `app` could not place (its remaining()); a "--" there only ends the flags.
struct Unplaced {
  std::string arg;
  bool is_flag = false;  // "-x", "--x=1" before any "--"; else a word
};
std::optional<Unplaced> FirstUnplaced(const CLI::App& app);
// INVALID_ARGUMENT for FirstUnplaced: "unknown flag --x" for a flag, "unexpected argument \"x\""
// for a word; OK when every argument was placed.
absl::Status CheckAllPlaced(const CLI::App& app);

// The client flags, as given (unset when not given). The CLI binds one ClientFlags to its global
// flags and to each command's, so a command's flag overrides the same global one (CLI11 runs the
// app's options before its subcommand's).
struct ClientFlags {
  std::optional<std::string> token;
  std::optional<std::string> token_file;
  std::optional<std::string> deadline;
  std::optional<std::string> max_attempts;
  std::optional<std::string> chunk_bytes;
  std::optional<std::string> transport;
  bool tls = false;
  std::optional<std::string> tls_ca;
  std::optional<std::string> tls_cert;
  std::optional<std::string> tls_key;
  std::string tls_server_name;
};

// --token-file FILE (contents, trimmed) or --token T, else $NORMGRAD_TOKEN; --deadline (an absl
// duration: "30s", "500ms"), --max-attempts, --chunk-bytes, --transport auto|bytes|shm, --tls,
// --tls-ca FILE, --tls-cert FILE, --tls-key FILE, --tls-server-name NAME.
void AddClientFlags(CLI::App& app, ClientFlags& flags);
// INVALID_ARGUMENT naming the flag for a bad value; NOT_FOUND for an unreadable file.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags(const ClientFlags& flags, std::string target);
// "auto", "bytes", "shm".
const char* TransportName(Transport transport);

// Options read with absl rather than CLI11's converters: absl::ParseDuration has no CLI11
// counterpart, and the messages ("--concurrency: \"lots\" is not an integer") are the ones the
// docs and tests show. A bad value fails ParseToolArgs with that message.
//
// The general form: `read(text, value)` returns false for a text it rejects, and the message
// is NAME: "TEXT" is not WHAT.
template <typename T, typename Read>
CLI::Option* AddReadOption(CLI::App& app, const std::string& name, T* value, Read read,
                           const std::string& what, const std::string& type_name) {
  auto read_or_throw = [name, value, read, what](const std::string& text) {
    if (!read(text, value)) {
      throw CLI::ValidationError(name, absl::StrCat("\"", text, "\" is not ", what));
    }
  };
  return app.add_option_function<std::string>(name, read_or_throw)->type_name(type_name);
}
template <typename Integer>
CLI::Option* AddIntegerOption(CLI::App& app, const std::string& name, Integer* value) {
  auto read = [](absl::string_view text, Integer* v) { return absl::SimpleAtoi(text, v); };
  return AddReadOption(app, name, value, read, "an integer", "N");
}
CLI::Option* AddNumberOption(CLI::App& app, const std::string& name, double* value);
CLI::Option* AddDurationOption(CLI::App& app, const std::string& name, absl::Duration* value);

}  // namespace normgrad::tools
