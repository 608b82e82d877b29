#include "server/metrics/metrics_http_server.h"

#include <httplib.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "server/metrics/connection_time_limit.h"

namespace normgrad::server {

absl::Status SplitHostPort(absl::string_view address, absl::string_view flag, std::string* host,
                           int* port) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", address, " is not HOST:PORT"));
  }
  absl::string_view h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  int p = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &p) || p < 0 || p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", address, ": the port is not a number in 0..65535"));
  }
  *host = std::string(h.empty() ? "0.0.0.0" : h);
  *port = p;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    absl::string_view address, MetricsRegistry* registry, const MetricsTlsFiles& tls,
    const MetricsHttpLimits& limits) {
  std::string host;
  int port = 0;
  NORMGRAD_RETURN_IF_ERROR(SplitHostPort(address, "metrics-listen", &host, &port));
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    server->http_ = std::make_unique<httplib::Server>();
  } else {
    // Debian's cpp-httplib is built with CPPHTTPLIB_OPENSSL_SUPPORT (its pkg-config sets it).
    auto https = std::make_unique<httplib::SSLServer>(tls.cert_file.c_str(), tls.key_file.c_str());
    if (!https->is_valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-tls-cert=", tls.cert_file, " / --metrics-tls-key=",
                       tls.key_file, ": unreadable, not PEM, or the key does not match"));
    }
    server->http_ = std::move(https);
  }
  const int64_t io_us = absl::ToInt64Microseconds(limits.io_timeout);
  server->http_->set_read_timeout(io_us / 1000000, io_us % 1000000);
  server->http_->set_write_timeout(io_us / 1000000, io_us % 1000000);
  server->http_->set_keep_alive_max_count(1);  // a connection is one request: bounded as one
  server->http_->set_payload_max_length(64 * 1024);
  server->http_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->RenderText(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->http_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("normgrad metrics: GET /metrics\n", "text/plain");
  });
  const int bound = port == 0 ? server->http_->bind_to_any_port(host)
                              : (server->http_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen=", address, ": cannot listen there (in use?)"));
  }
  server->port_ = bound;
  httplib::Server* http = server->http_.get();
  http->new_task_queue = [bound, limits] {
    return new LimitedConnectionQueue(bound, limits.workers, limits.connection_time);
  };
  server->thread_ = std::thread([http] { http->listen_after_bind(); });
  // stop() only works once the listener runs; wait for it so that Stop() never races it.
  for (int i = 0; i < 5000 && !http->is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  return server;
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace normgrad::server
