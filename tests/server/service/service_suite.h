// What the service's gRPC suites share: ServiceTest (one in-process server per suite, started
// once, on 127.0.0.1:0), the reference check of a whole Backward stream, a client that stalls,
// a hand-made streaming call (GenericStreamingCall), and the EmitPtx / GetServerInfo callers.
#pragma once

#include <dlfcn.h>
#include <fcntl.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/process/normgrad_server.h"
#include "server/shared_memory/region_registry.h"
#include "tests/server/service/in_process_server_test.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server::service_test {

using testing::Batch;
using testing::BackwardResult;

inline double Tolerance() { return testing::TestBackendIsCuda() ? 1e-3 : 1e-5; }

// A client that sends the header and 10 rows of `batch`, then nothing more (without
// half-closing), and reads until the stream ends; its deadline is `deadline` from now.
struct StalledStream {
  int responses = 0;
  grpc::Status status;
};
inline StalledStream SendTenRowsThenStall(v1::NormGrad::Stub& stub, const Batch& batch,
                                          absl::Duration deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  auto stream = stub.RmsNormBackward(&context);
  StalledStream out;
  if (testing::WriteHeaderAndRows(*stream, batch, 10)) {
    v1::BackwardResponse response;
    while (stream->Read(&response)) ++out.responses;
  } else {
    ADD_FAILURE() << "the header or the first rows could not be written";
  }
  out.status = stream->Finish();
  return out;
}

// The suites' shared server: the test options, with one kernel preloaded (GetServerInfo's cache
// then holds an entry before the first call).
class ServiceTest : public testing::SharedServerTest<ServiceTest> {
 public:
  static ServerOptions Options() {
    ServerOptions options = testing::TestServerOptions();
    options.preload = {"batched_rms_norm_backward:sm_80:896"};
    return options;
  }
};

struct Shape {
  uint32_t hidden;
  uint64_t rows;
  uint64_t chunk_rows;  // chosen not to divide rows
};

inline void ExpectMatchesReference(v1::NormGrad::Stub& stub, const Batch& batch, uint64_t chunk_rows) {
  BackwardResult r = testing::RunBackward(stub, batch, chunk_rows);
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  ASSERT_TRUE(r.saw_final);
  std::vector<float> dx, dgamma;
  testing::ReferenceFor(batch, dx, dgamma);
  EXPECT_LE(testing::MaxDxError(batch, r.dx, dx), Tolerance());
  EXPECT_LE(testing::MaxScaledError(r.dgamma, dgamma), Tolerance());
  // Responses come in order, one per chunk, covering every row once.
  const uint64_t expected_chunks = (batch.rows + chunk_rows - 1) / chunk_rows;
  ASSERT_EQ(r.chunks.size(), expected_chunks);
  for (uint64_t i = 0; i < expected_chunks; ++i) {
    EXPECT_EQ(r.chunks[i].first, i * chunk_rows);
    EXPECT_EQ(r.chunks[i].second, std::min(chunk_rows, batch.rows - i * chunk_rows));
  }
  EXPECT_EQ(r.summary.rows(), batch.rows);
  EXPECT_EQ(r.summary.chunks(), expected_chunks);
  EXPECT_EQ(r.summary.backend(), testing::TestBackendName());
  EXPECT_FALSE(r.summary.kernel().empty());
  EXPECT_GE(r.summary.total_seconds(), r.summary.compute_seconds() * 0.0);
}

// A streaming call made by hand through a GenericStub (bytes the generated stub would not send),
// one operation at a time on a completion queue of its own; tags are small integers. Started
// with tag 1; 10 s deadline.
class GenericStreamingCall {
 public:
  GenericStreamingCall(grpc::GenericStub& stub, const std::string& method) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    call_ = stub.PrepareCall(&context_, method, &cq_);
    call_->StartCall(reinterpret_cast<void*>(1));
  }
  ~GenericStreamingCall() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  grpc::GenericClientAsyncReaderWriter* operator->() { return call_.get(); }
  // Writes `bytes` as one message tagged `tag` and waits for it: true when it went.
  bool Write(const std::string& bytes, intptr_t tag) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    call_->Write(buffer, reinterpret_cast<void*>(tag));
    return Step(tag);
  }
  // Waits for the next operation to complete; false when none can. `ok`: whether it succeeded.
  bool Next(bool* ok) {
    void* tag;
    return cq_.Next(&tag, ok);
  }
  // Waits for the next operation: true when it is the one tagged `want` and it succeeded.
  bool Step(intptr_t want) {
    void* tag;
    bool ok;
    return cq_.Next(&tag, &ok) && reinterpret_cast<intptr_t>(tag) == want && ok;
  }

 private:
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

inline v1::GetServerInfoResponse Info(v1::NormGrad::Stub& stub) {
  grpc::ClientContext context;
  v1::GetServerInfoResponse info;
  grpc::Status s = stub.GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return info;
}

inline grpc::Status Emit(v1::NormGrad::Stub& stub, const v1::EmitPtxRequest& request,
                  v1::EmitPtxResponse* response) {
  grpc::ClientContext context;
  return stub.EmitPtx(&context, request, response);
}

inline v1::EmitPtxRequest PtxRequest(uint32_t hidden, const std::string& target, bool cubin = false) {
  v1::EmitPtxRequest r;
  r.set_kernel("batched_rms_norm_backward");
  r.set_hidden_dim(hidden);
  r.set_target(target);
  r.set_cubin(cubin);
  return r;
}

}  // namespace normgrad::server::service_test
