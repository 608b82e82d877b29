// A normgrad server for client tests: NormGradServer in-process on 127.0.0.1:0 with the CPU
// backend and no metrics endpoint.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/rmsnorm/reference.h"
#include "server/backend_factory/backend_factory.h"
#include "server/process/normgrad_server.h"
#include "tests/common/gated_backend.h"

namespace normgrad::testing {

inline std::unique_ptr<server::NormGradServer> StartTestServer(
    const std::function<void(server::ServerOptions&)>& adjust = {}) {
  server::ServerOptions options;
  options.listen = {"127.0.0.1:0"};
  options.metrics_listen = "";
  options.backend.kind = server::BackendKind::kCpu;
  options.backend.cpu_threads = 2;
  options.worker_threads = 2;
  if (adjust) adjust(options);
  absl::StatusOr<std::unique_ptr<server::NormGradServer>> s =
      server::NormGradServer::Start(options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// A server on the unix socket `socket` (shared memory on) whose backend is the CPU backend
// behind `gates` (tests/common/gated_backend.h), so that a test holds a chunk's job where it wants.
inline std::unique_ptr<server::NormGradServer> StartGatedServer(const std::string& socket,
                                                                std::shared_ptr<ChunkGates> gates) {
  server::ServerOptions o;
  o.listen = {"unix:" + socket};
  o.metrics_listen = "";
  o.shared_memory = true;
  o.worker_threads = 2;
  o.backend.kind = server::BackendKind::kCpu;
  o.backend.cpu_threads = 1;
  absl::StatusOr<std::unique_ptr<server::Backend>> cpu = server::CreateBackend(o.backend);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (!cpu.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<server::NormGradServer>> s = server::NormGradServer::Start(
      o, std::make_unique<GatedBackend>(*std::move(cpu), std::move(gates)));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

inline std::string Address(const server::NormGradServer& s) {
  return absl::StrCat("127.0.0.1:", s.port());
}

// A test server per test, started in SetUp; a fixture that needs other options overrides
// AdjustServer.
class TestServerFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartTestServer([this](server::ServerOptions& options) { AdjustServer(options); });
    ASSERT_NE(server_, nullptr);
  }
  virtual void AdjustServer(server::ServerOptions& options) {}

  std::unique_ptr<server::NormGradServer> server_;
};

// A loopback port with nothing listening (bound, then closed).
inline int DeadPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Random inputs of one batch and the reference gradients.
struct Batch {
  uint64_t rows = 0;
  uint32_t hidden = 0;
  std::vector<float> x, dy, gamma, rms;
  std::vector<float> dx, dgamma;  // ReferenceBackward's

  Batch(uint64_t r, uint32_t h, uint64_t seed, float eps = 1e-5f, bool with_rms = false)
      : rows(r), hidden(h) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    x.resize(rows * hidden);
    dy.resize(rows * hidden);
    gamma.resize(hidden);
    for (float& v : x) v = u(rng);
    for (float& v : dy) v = u(rng);
    for (float& v : gamma) v = 1.0f + 0.25f * u(rng);
    if (with_rms) {
      rms.resize(rows);
      for (uint64_t i = 0; i < rows; ++i) {
        double sum = 0;
        for (uint32_t j = 0; j < hidden; ++j) sum += double{x[i * hidden + j]} * x[i * hidden + j];
        rms[i] = static_cast<float>(std::sqrt(sum / hidden + eps));
      }
    }
    dx.resize(rows * hidden);
    dgamma.resize(hidden);
    kernels::ReferenceBackward({x, dy, gamma, rms, rows, hidden, eps}, absl::MakeSpan(dx),
                               absl::MakeSpan(dgamma));
  }
};

// Element-wise closeness to the double-accumulated reference (the CPU backend sums in float
// over up to `hidden` or `rows` terms).
inline void ExpectClose(absl::Span<const float> got, absl::Span<const float> want,
                        const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float tolerance = 1e-3f * std::max(1.0f, std::abs(want[i]));
    if (std::abs(got[i] - want[i]) > tolerance && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", reference " << want[i];
    }
  }
}

// dx and dgamma against the batch's reference gradients (ExpectClose).
inline void ExpectGradientsClose(absl::Span<const float> dx, absl::Span<const float> dgamma,
                                 const Batch& batch) {
  ExpectClose(dx, batch.dx, "dx");
  ExpectClose(dgamma, batch.dgamma, "dgamma");
}

}  // namespace normgrad::testing
