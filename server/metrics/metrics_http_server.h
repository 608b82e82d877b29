// Serves a MetricsRegistry as Prometheus text on GET /metrics (cpp-httplib, its own threads),
// over plain HTTP or, given a certificate and key, HTTPS. A connection is one request, and its
// whole time is bounded (MetricsHttpLimits; server/metrics/connection_time_limit.h): a slow
// client holds a worker for that long at most.
//
//   absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s =
//       MetricsHttpServer::Start("127.0.0.1:0", &registry);
//   int port = (*s)->port();
//
// The registry must outlive the server. Stop() (or the destructor) returns after the listener
// thread has exited.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/metrics/metrics.h"

namespace httplib {
class Server;
}

namespace normgrad::server {

// Splits "HOST:PORT" ("[::1]:80" for IPv6). INVALID_ARGUMENT naming `flag` when malformed.
absl::Status SplitHostPort(absl::string_view address, absl::string_view flag, std::string* host,
                           int* port);

// PEM files of the HTTPS certificate and key; both empty: plain HTTP.
struct MetricsTlsFiles {
  std::string cert_file;
  std::string key_file;
};

// What a client may hold: `workers` connections served at once (more wait), each for at most
// `connection_time` in all (its request read, the answer written), and each read or write for
// at most `io_timeout`.
struct MetricsHttpLimits {
  size_t workers = 8;
  absl::Duration connection_time = absl::Seconds(10);
  absl::Duration io_timeout = absl::Seconds(5);
};

class MetricsHttpServer {
 public:
  // INVALID_ARGUMENT naming the flag for an unreadable or unusable certificate or key.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      absl::string_view address, MetricsRegistry* registry, const MetricsTlsFiles& tls = {},
      const MetricsHttpLimits& limits = {});
  ~MetricsHttpServer();
  void Stop();
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace normgrad::server
