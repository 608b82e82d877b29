#include "server/process/server_options.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "base/status_macros.h"
#include "server/metrics/metrics_http_server.h"
#include "server/process/listen_address.h"
#include "server/process/grpc_listener.h"

namespace normgrad::server {
namespace {

// Each value and combination on its own: no file is read.
absl::Status ValidateOptions(const ServerOptions& o) {
  if (o.max_message_bytes < 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-message-bytes=", o.max_message_bytes, " is below the minimum of 4096"));
  }
  if (o.max_message_bytes > (2ull << 30) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-message-bytes=", o.max_message_bytes,
                                                   " is above protobuf's 2 GiB ceiling"));
  }
  if (o.batch.max_hidden_dim == 0) {
    return absl::InvalidArgumentError("--max-hidden-dim=0: must be > 0");
  }
  if (o.batch.max_num_rows == 0) {
    return absl::InvalidArgumentError("--max-num-rows=0: must be > 0");
  }
  // A batch's byte counts (rows x row bytes, and sums of a few of them) are computed in 64 bits
  // throughout the service: the largest batch accepted must leave them room.
  if (unsigned __int128 batch_bytes =
          static_cast<unsigned __int128>(o.batch.max_num_rows) * o.batch.max_hidden_dim * 4;
      batch_bytes > (uint64_t{1} << 60)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-num-rows=", o.batch.max_num_rows, " with --max-hidden-dim=",
        o.batch.max_hidden_dim, " allows batches above 2^60 bytes of x; lower one of them"));
  }
  // One row of x and dy (plus rms and framing) must fit in one message.
  const uint64_t one_row = 2 * uint64_t{o.batch.max_hidden_dim} * 4 + 4 + 64;
  if (one_row > o.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-hidden-dim=", o.batch.max_hidden_dim, " needs messages of at least ", one_row,
        " bytes for one row of x and dy, above --max-message-bytes=", o.max_message_bytes));
  }
  if (o.admission.max_streams == 0) {
    return absl::InvalidArgumentError("--max-streams=0: must be > 0");
  }
  NORMGRAD_RETURN_IF_ERROR(CheckAdmissionLimits(o.admission));
  if (o.emit_ptx_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--emit-ptx-threads=", o.emit_ptx_threads, ": must be >= 1"));
  }
  if (o.min_stream_bytes_per_second > 0 && o.min_stream_rate_window <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-stream-rate-window=", absl::FormatDuration(o.min_stream_rate_window),
        ": must be > 0 when --min-stream-bytes-per-second=", o.min_stream_bytes_per_second));
  }
  if (o.admission.max_inflight_bytes < 3 * one_row) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-inflight-bytes=", o.admission.max_inflight_bytes,
        " cannot hold even one row of the largest hidden_dim (", 3 * one_row, " bytes)"));
  }
  if (o.stream_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stream-idle-timeout=", absl::FormatDuration(o.stream_idle_timeout), ": must be >= 0"));
  }
  if (o.device_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device-timeout=", absl::FormatDuration(o.device_timeout), ": must be >= 0 (0: no bound)"));
  }
  if (o.listen.empty()) {
    return absl::InvalidArgumentError("--listen: give at least one HOST:PORT or unix:/PATH");
  }
  int tcp_listeners = 0;
  for (const std::string& address : o.listen) {
    NORMGRAD_ASSIGN_OR_RETURN(ListenAddress a, ParseListenAddress(address));
    if (a.kind == ListenAddress::kTcp && ++tcp_listeners > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", absl::StrJoin(o.listen, ","), ": at most one HOST:PORT (and any number "
          "of unix:/PATH)"));
    }
  }
  if (o.shared_memory) {
    const bool has_unix = std::any_of(o.listen.begin(), o.listen.end(), [](const std::string& a) {
      return absl::StartsWith(a, "unix:");
    });
    if (!has_unix) {
      return absl::InvalidArgumentError(
          "--shared-memory needs a --listen=unix:/PATH (clients register regions on PATH.shm)");
    }
    if (o.regions.max_regions == 0 || o.regions.max_bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shared-memory-max-regions=", o.regions.max_regions, " --shared-memory-max-bytes=",
          o.regions.max_bytes, ": both must be > 0"));
    }
  }
  if (!o.unix_allowed_uids.empty()) {
    const bool has_unix = std::any_of(o.listen.begin(), o.listen.end(), [](const std::string& a) {
      return absl::StartsWith(a, "unix:");
    });
    if (!has_unix) {
      return absl::InvalidArgumentError(
          "--unix-allowed-uids needs a --listen=unix:/PATH (it governs unix-socket clients)");
    }
    if (!o.security.cert_file.empty() || !GrpcListener::Supported()) {
      return absl::InvalidArgumentError(
          "--unix-allowed-uids needs plaintext unix sockets: with --tls-cert gRPC accepts their "
          "connections itself and gives no peer credentials");
    }
  }
  if (o.unix_socket_mode > 0777) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--unix-socket-mode=%o: only permission bits (0..0777)", o.unix_socket_mode));
  }
  std::string host;
  int port;
  if (!o.metrics_listen.empty()) {
    NORMGRAD_RETURN_IF_ERROR(SplitHostPort(o.metrics_listen, "metrics-listen", &host, &port));
  }
  if (!o.health_listen.empty()) {
    NORMGRAD_RETURN_IF_ERROR(SplitHostPort(o.health_listen, "health-listen", &host, &port));
  }
  if (o.max_streams_per_connection == 0 || o.max_streams_per_connection > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-streams-per-connection=", o.max_streams_per_connection,
                     ": must be in 1..", INT32_MAX));
  }
  if (o.min_client_ping_interval < absl::ZeroDuration() ||
      o.min_client_ping_interval > absl::Milliseconds(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-client-ping-interval=", absl::FormatDuration(o.min_client_ping_interval),
        ": must be in 0..", absl::FormatDuration(absl::Milliseconds(INT32_MAX))));
  }
  if (o.metrics_tls_cert_file.empty() != o.metrics_tls_key_file.empty()) {
    return absl::InvalidArgumentError("--metrics-tls-cert and --metrics-tls-key go together");
  }
  if (!o.metrics_tls_cert_file.empty()) {
    NORMGRAD_RETURN_IF_ERROR(ReadPemFile(o.metrics_tls_cert_file, "metrics-tls-cert").status());
    NORMGRAD_RETURN_IF_ERROR(ReadPemFile(o.metrics_tls_key_file, "metrics-tls-key").status());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PreloadEntry> ParsePreloadEntry(absl::string_view text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() < 2 || parts.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\" is not KERNEL:TARGET[:HIDDEN_DIM]"));
  }
  PreloadEntry entry;
  entry.kernel = kernels::FindKernel(parts[0]);
  if (entry.kernel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": unknown kernel \"", parts[0], "\""));
  }
  absl::StatusOr<int> sm = kernels::ParseTarget(parts[1]);
  if (!sm.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": ", sm.status().message()));
  }
  entry.config.target_sm = *sm;
  entry.config.hidden_dim = 4096;
  if (parts.size() == 3 && !absl::SimpleAtoi(parts[2], &entry.config.hidden_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": hidden_dim \"", parts[2],
                     "\" is not a number"));
  }
  if (absl::Status s = entry.kernel->CanImplement(entry.config); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preload entry \"", text, "\": ", s.message()));
  }
  return entry;
}

absl::StatusOr<std::vector<PreloadEntry>> ParsePreloadEntries(
    const std::vector<std::string>& texts) {
  std::vector<PreloadEntry> entries;
  for (const std::string& text : texts) {
    NORMGRAD_ASSIGN_OR_RETURN(const PreloadEntry entry, ParsePreloadEntry(text));
    entries.push_back(entry);
  }
  return entries;
}

absl::Status CheckServerOptions(const ServerOptions& options) {
  NORMGRAD_RETURN_IF_ERROR(ValidateOptions(options));
  NORMGRAD_RETURN_IF_ERROR(MakeServerCredentials(options.security).status());
  return ParsePreloadEntries(options.preload).status();
}

}  // namespace normgrad::server
