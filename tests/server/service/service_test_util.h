// Shared by the service's tests: the backend under test (env NORMGRAD_TEST_BACKEND = cpu|cuda,
// cpu by default; with cuda, NORMGRAD_CUDA_DRIVER may name an emulated driver), random batches
// (batch_test_util.h), a plain-stub driver for RmsNormBackward streams, and a Prometheus text parser.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "server/process/normgrad_server.h"
#include "tests/server/service/batch_test_util.h"

namespace normgrad::server::testing {

std::string TestBackendName();  // "cpu" or "cuda"
bool TestBackendIsCuda();
// Interpreted kernels are slow: tests scale their big shapes by this (1 on cpu).
uint64_t ShapeScale(uint64_t cpu_value, uint64_t cuda_value);

// 127.0.0.1:0 for gRPC and metrics, the backend under test, small idle timeout off.
ServerOptions TestServerOptions();

// An RmsNormBackward stream a test drives by hand (stub.RmsNormBackward(&context)).
using ClientBackwardStream = grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>;

// Writes the header of `batch`, then its first `rows` rows as one chunk (none when 0); false
// when a write fails.
bool WriteHeaderAndRows(ClientBackwardStream& stream, const Batch& batch, uint64_t rows);
// WriteHeaderAndRows (rows > 0), then the response to those rows read into `response`: a stream
// the server holds in flight. False when a write or the read fails.
bool WriteHeaderAndRowsThenRead(ClientBackwardStream& stream, const Batch& batch, uint64_t rows,
                                v1::BackwardResponse& response);

struct BackwardResult {
  grpc::Status status;
  std::vector<float> dx;      // assembled from the chunk responses
  std::vector<float> dgamma;  // from the final response
  v1::BackwardSummary summary;
  std::vector<std::pair<uint64_t, uint64_t>> chunks;  // (first_row, num_rows) per response
  bool saw_final = false;
};

// Streams `batch` in chunks of `rows_per_chunk` rows (writer thread) while reading responses.
BackwardResult RunBackward(v1::NormGrad::Stub& stub, const Batch& batch,
                           uint64_t rows_per_chunk, absl::Duration deadline = absl::Seconds(120));

// Sends `messages` as they are, half-closes, reads everything; returns the final status.
grpc::Status SendMessages(v1::NormGrad::Stub& stub, const std::vector<v1::BackwardRequest>& messages,
                          int* responses = nullptr);

std::unique_ptr<v1::NormGrad::Stub> StubFor(int port);
std::shared_ptr<grpc::Channel> ChannelFor(int port);
// A channel with a connection of its own, not shared with other channels to the same address
// through gRPC's process-wide subchannel pool: for clients the server may disconnect.
std::shared_ptr<grpc::Channel> OwnConnectionFor(int port);

// grpc.health.v1.Health/Check of `service` ("" for the whole server) by hand (no generated health
// stubs in the Debian packages): 1 SERVING, 2 NOT_SERVING, 0 UNKNOWN, or -(gRPC code) on error
// (-2 for an answer that is not a HealthCheckResponse).
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service = "");

// Polls `done` every 10 ms for at most `limit`; its last answer.
template <typename F>
bool WaitFor(F done, absl::Duration limit = absl::Seconds(20)) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

// "name{a=\"b\"}" (exactly as rendered) -> value; comment lines skipped. Empty on a bad line.
std::map<std::string, double> ParsePrometheusText(const std::string& text, std::string* error);
std::string HttpGet(int port, const std::string& path, int* status);

}  // namespace normgrad::server::testing
