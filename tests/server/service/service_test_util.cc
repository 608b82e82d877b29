#include "tests/server/service/service_test_util.h"

#include <grpcpp/generic/generic_stub.h>
#include <httplib.h>

#include <cmath>
#include <future>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace normgrad::server::testing {

std::string TestBackendName() {
  const char* env = std::getenv("NORMGRAD_TEST_BACKEND");
  return env != nullptr && std::string(env) == "cuda" ? "cuda" : "cpu";
}

bool TestBackendIsCuda() { return TestBackendName() == "cuda"; }

uint64_t ShapeScale(uint64_t cpu_value, uint64_t cuda_value) {
  return TestBackendIsCuda() ? cuda_value : cpu_value;
}

ServerOptions TestServerOptions() {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  o.metrics_listen = "127.0.0.1:0";
  o.backend.kind = TestBackendIsCuda() ? BackendKind::kCuda : BackendKind::kCpu;
  o.backend.cpu_threads = 2;
  o.worker_threads = 4;
  o.stream_idle_timeout = absl::Seconds(60);
  return o;
}

bool WriteHeaderAndRows(ClientBackwardStream& stream, const Batch& batch, uint64_t rows) {
  if (!stream.Write(HeaderFor(batch))) return false;
  return rows == 0 || stream.Write(ChunkFor(batch, 0, rows));
}

bool WriteHeaderAndRowsThenRead(ClientBackwardStream& stream, const Batch& batch, uint64_t rows,
                                v1::BackwardResponse& response) {
  return WriteHeaderAndRows(stream, batch, rows) && stream.Read(&response);
}

BackwardResult RunBackward(v1::NormGrad::Stub& stub, const Batch& b, uint64_t rows_per_chunk,
                           absl::Duration deadline) {
  BackwardResult result;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  auto stream = stub.RmsNormBackward(&context);
  std::thread writer([&] {
    if (!stream->Write(HeaderFor(b))) return;
    for (uint64_t first = 0; first < b.rows; first += rows_per_chunk) {
      const uint64_t rows = std::min(rows_per_chunk, b.rows - first);
      if (!stream->Write(ChunkFor(b, first, rows))) return;
    }
    stream->WritesDone();
  });
  result.dx.assign(b.rows * b.hidden, std::nanf(""));
  v1::BackwardResponse response;
  while (stream->Read(&response)) {
    if (response.has_summary()) {
      result.saw_final = true;
      result.summary = response.summary();
      result.dgamma.resize(response.grad_gamma().size() / 4);
      if (!result.dgamma.empty()) {  // none for a batch without gamma
        std::memcpy(result.dgamma.data(), response.grad_gamma().data(),
                    result.dgamma.size() * 4);
      }
      continue;
    }
    result.chunks.emplace_back(response.first_row(), response.num_rows());
    const uint64_t offset = response.first_row() * b.hidden;
    if (offset * 4 + response.grad_input().size() <= result.dx.size() * 4) {
      std::memcpy(result.dx.data() + offset, response.grad_input().data(),
                  response.grad_input().size());
    }
  }
  writer.join();
  result.status = stream->Finish();
  return result;
}

grpc::Status SendMessages(v1::NormGrad::Stub& stub,
                          const std::vector<v1::BackwardRequest>& messages, int* responses) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto stream = stub.RmsNormBackward(&context);
  std::thread writer([&] {
    for (const v1::BackwardRequest& m : messages) {
      if (!stream->Write(m)) return;
    }
    stream->WritesDone();
  });
  v1::BackwardResponse response;
  int count = 0;
  while (stream->Read(&response)) ++count;
  writer.join();
  if (responses != nullptr) *responses = count;
  return stream->Finish();
}

namespace {
std::shared_ptr<grpc::Channel> LoopbackChannel(int port, bool own_connection) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}
}  // namespace

std::shared_ptr<grpc::Channel> ChannelFor(int port) { return LoopbackChannel(port, false); }

std::shared_ptr<grpc::Channel> OwnConnectionFor(int port) { return LoopbackChannel(port, true); }

std::unique_ptr<v1::NormGrad::Stub> StubFor(int port) {
  return v1::NormGrad::NewStub(ChannelFor(port));
}

std::map<std::string, double> ParsePrometheusText(const std::string& text, std::string* error) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "#")) continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    absl::string_view v = space == absl::string_view::npos ? "" : line.substr(space + 1);
    bool ok = space != absl::string_view::npos;
    if (ok) {
      if (v == "+Inf") {
        value = INFINITY;
      } else if (v == "-Inf") {
        value = -INFINITY;
      } else if (v == "NaN") {
        value = NAN;
      } else {
        ok = absl::SimpleAtod(v, &value);
      }
    }
    if (!ok) {
      if (error != nullptr) *error = absl::StrCat("bad line: ", line);
      return {};
    }
    out[std::string(line.substr(0, space))] = value;
  }
  return out;
}

std::string HttpGet(int port, const std::string& path, int* status) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  auto res = client.Get(path.c_str());
  if (!res) {
    *status = -1;
    return "";
  }
  *status = res->status;
  return res->body;
}

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  grpc::GenericStub stub(channel);
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);  // field 1, length-delimited
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer in(&slice, 1), out;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &in, &out,
                 [&](grpc::Status s) { done.set_value(s); });
  grpc::Status s = done.get_future().get();
  if (!s.ok()) return -static_cast<int>(s.error_code());
  std::vector<grpc::Slice> slices;
  if (!out.Dump(&slices).ok()) return -2;
  std::string bytes;
  for (const grpc::Slice& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  if (bytes.size() == 2 && bytes[0] == 0x08) return bytes[1];
  return bytes.empty() ? 0 : -2;  // 0: UNKNOWN (proto3 leaves the default out)
}

}  // namespace normgrad::server::testing
