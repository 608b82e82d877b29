// How the client handles what a server sends, against a scripted server in the test: on the
// RmsNormBackward stream, the whole-call retry on UNAVAILABLE (before or after a response) and on
// CANCELLED before any response (never for an in-place call once dx was written over dy),
// chunks placed by first_row, and malformed replies (row ranges that leave a gap or overlap
// included) reported as INTERNAL; the unary calls' retries on UNAVAILABLE.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "normgrad/v1/normgrad.grpc.pb.h"

namespace normgrad {
namespace {

enum class Script {
  kEchoX,                     // dx := x, dgamma := zeros, summary.chunks = request chunks
  kUnavailableFirstTwo,       // streams 1 and 2: UNAVAILABLE at once; then kEchoX
  kUnavailableAfterOneChunk,  // stream 1: one grad_input chunk, then UNAVAILABLE; then kEchoX
  kCancelledFirst,            // stream 1: CANCELLED at once (a server shutting down); then kEchoX
  kShortGradInput,            // grad_input one element short
  kNoFinalMessage,            // every chunk, then OK without grad_gamma
  kRowsOutOfRange,            // first_row past the batch
  kRepeatedRange,             // the second chunk's first_row is 0 again: rows 0-2 twice, 3-5 never
  kSkippedRow,                // the second chunk's first_row is 4: row 3 never, row 6 twice
};

class ScriptedStream final
    : public grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse> {
 public:
  ScriptedStream(Script script, int stream_index)
      : script_(script), first_stream_(stream_index == 1) {
    { std::lock_guard<std::mutex> lock(mu_); }  // published to the reactions (mu_ below)
    if (script_ == Script::kUnavailableFirstTwo && stream_index <= 2) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "scripted: not yet"));
      return;
    }
    if (script_ == Script::kCancelledFirst && first_stream_) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "scripted: shutting down"));
      return;
    }
    StartRead(&request_);
  }
  // One read or one write is in flight at a time, and each reaction starts the next: the ordering
  // gRPC gives between them is invisible to ThreadSanitizer (docs/testing.md), so each reaction
  // takes mu_ while it touches the state and releases it before it starts the next operation.
  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ok) {  // client half-closed: the final message
      if (script_ == Script::kNoFinalMessage) {
        lock.unlock();
        Finish(grpc::Status::OK);
        return;
      }
      response_.Clear();
      response_.set_grad_gamma(std::string(hidden_ * 4, '\0'));
      response_.mutable_summary()->set_backend("scripted");
      response_.mutable_summary()->set_chunks(chunks_);
      response_.mutable_summary()->set_rows(next_row_);
      finishing_ = true;
      lock.unlock();
      StartWrite(&response_);
      return;
    }
    if (request_.has_header()) {
      hidden_ = request_.header().hidden_dim();
      lock.unlock();
      StartRead(&request_);
      return;
    }
    const uint64_t rows = request_.x().size() / (hidden_ * 4);
    response_.Clear();
    uint64_t first_row = next_row_;
    if (script_ == Script::kRowsOutOfRange) first_row = 1000000;
    if (script_ == Script::kRepeatedRange && chunks_ == 1) first_row = 0;
    if (script_ == Script::kSkippedRow && chunks_ == 1) first_row = next_row_ + 1;
    response_.set_first_row(first_row);
    response_.set_num_rows(rows);
    std::string dx = request_.x();
    if (script_ == Script::kShortGradInput) dx.resize(dx.size() - 4);
    response_.set_grad_input(std::move(dx));
    next_row_ += rows;
    ++chunks_;
    lock.unlock();
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool finishing = finishing_;
    lock.unlock();
    if (finishing || !ok) {
      Finish(grpc::Status::OK);
      return;
    }
    if (script_ == Script::kUnavailableAfterOneChunk && first_stream_) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "scripted: gone mid-stream"));
      return;
    }
    StartRead(&request_);
  }
  void OnDone() override { delete this; }
  void OnCancel() override {}

 private:
  std::mutex mu_;
  Script script_;
  bool first_stream_;
  v1::BackwardRequest request_;
  v1::BackwardResponse response_;
  uint32_t hidden_ = 0;
  uint64_t next_row_ = 0;
  uint64_t chunks_ = 0;
  bool finishing_ = false;
};

class ScriptedService final : public v1::NormGrad::CallbackService {
 public:
  grpc::ServerBidiReactor<v1::BackwardRequest, v1::BackwardResponse>* RmsNormBackward(
      grpc::CallbackServerContext*) override {
    return new ScriptedStream(script, ++streams);
  }
  // A server that predates RmsNormBackwardUnary (what gRPC answers for a method not served).
  grpc::ServerUnaryReactor* RmsNormBackwardUnary(grpc::CallbackServerContext* context,
                                                 const v1::BackwardRequest*,
                                                 v1::BackwardResponse*) override {
    ++unary_backward_calls;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "scripted: no such method"));
    return reactor;
  }
  // The unary methods: the first `unary_failures` calls end with `unary_code`, the rest answer.
  grpc::ServerUnaryReactor* EmitPtx(grpc::CallbackServerContext* context,
                                    const v1::EmitPtxRequest* request,
                                    v1::EmitPtxResponse* response) override {
    response->set_entry(request->kernel());
    // An answer the size of the largest EmitPtx batch the real server sends (32 artifacts of
    // up to ~190 KB of PTX and cubin): over gRPC's default 4 MiB receive limit.
    if (request->kernel() == "largest-batch") response->set_ptx(std::string(6 << 20, 'p'));
    return Unary(context);
  }
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest*,
                                          v1::GetServerInfoResponse* response) override {
    response->set_backend("scripted");
    return Unary(context);
  }

  std::atomic<Script> script{Script::kEchoX};
  std::atomic<int> streams{0};
  std::atomic<int> unary_calls{0};
  std::atomic<int> unary_backward_calls{0};
  std::atomic<int> unary_failures{0};
  std::atomic<grpc::StatusCode> unary_code{grpc::StatusCode::UNAVAILABLE};

 private:
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (++unary_calls <= unary_failures.load()) {
      reactor->Finish(grpc::Status(unary_code.load(), "scripted: unary not yet"));
    } else {
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }
};

class ClientProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    client_ = Connect(Options());
    ASSERT_NE(client_, nullptr);
    for (size_t i = 0; i < x_.size(); ++i) x_[i] = static_cast<float>(i);
  }
  // client_'s options: 3 rows per message, 3 attempts, 1 ms backoff.
  ClientOptions Options() const {
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", port_);
    options.chunk_bytes = 3 * kHidden * 4;
    options.initial_backoff = absl::Milliseconds(1);
    options.max_attempts = 3;
    return options;
  }
  std::unique_ptr<Client> Connect(const ClientOptions& options) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  void TearDown() override {
    client_.reset();
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  absl::StatusOr<Gradients> Call(Script script) {
    service_.script = script;
    return client_->Backward(x_, dy_, gamma_, 1e-5f);
  }
  // The call succeeds after `attempts` streams, the last of which wrote every output.
  void ExpectWholeStreamRetried(Script script, int attempts) {
    absl::StatusOr<Gradients> g = Call(script);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->attempts, attempts);
    EXPECT_EQ(service_.streams.load(), attempts);
    EXPECT_EQ(g->dx, x_);
    EXPECT_EQ(g->summary.chunks, 4u);  // 3 + 3 + 3 + 1 rows
  }
  // A malformed reply: INTERNAL, with `message` in its message.
  void ExpectInternal(Script script, absl::string_view message) {
    absl::StatusOr<Gradients> g = Call(script);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInternal);
    EXPECT_NE(g.status().message().find(message), absl::string_view::npos) << g.status();
  }

  static constexpr uint32_t kHidden = 4;
  static constexpr uint64_t kRows = 10;
  std::vector<float> x_ = std::vector<float>(kRows * kHidden);
  std::vector<float> dy_ = std::vector<float>(kRows * kHidden, 1.0f);
  std::vector<float> gamma_ = std::vector<float>(kHidden, 1.0f);
  ScriptedService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
  int port_ = 0;
};

TEST_F(ClientProtocolTest, ChunksArePlacedByFirstRow) {
  absl::StatusOr<Gradients> g = Call(Script::kEchoX);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->dx, x_);
  EXPECT_EQ(g->summary.chunks, 4u);  // 3 + 3 + 3 + 1 rows
  EXPECT_EQ(g->summary.backend, "scripted");
}

// A batch that fits one message asks for RmsNormBackwardUnary once; a server without it gets the
// stream, for that call and every later one.
TEST_F(ClientProtocolTest, AServerWithoutTheUnaryMethodGetsTheStream) {
  service_.script = Script::kEchoX;
  const std::vector<float> x(x_.begin(), x_.begin() + 2 * kHidden);
  for (int call = 1; call <= 3; ++call) {
    absl::StatusOr<Gradients> g =
        client_->Backward(x, absl::MakeConstSpan(dy_).subspan(0, x.size()), gamma_, 1e-5f);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->dx, x);
    EXPECT_EQ(service_.streams.load(), call);
    EXPECT_EQ(service_.unary_backward_calls.load(), 1) << "asked again after UNIMPLEMENTED";
  }
}

TEST_F(ClientProtocolTest, UnavailableBeforeAnyResponseRetriesTheWholeStream) {
  ExpectWholeStreamRetried(Script::kUnavailableFirstTwo, 3);
}

TEST_F(ClientProtocolTest, RetriesStopAtMaxAttempts) {
  ClientOptions options = Options();
  options.max_attempts = 2;
  std::unique_ptr<Client> two = Connect(options);
  ASSERT_NE(two, nullptr);
  service_.script = Script::kUnavailableFirstTwo;
  absl::StatusOr<Gradients> g = two->Backward(x_, dy_, gamma_, 1e-5f);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(g.status().message(), "scripted: not yet");
  EXPECT_EQ(service_.streams.load(), 2);
}

// A replica that dies mid-stream: the whole (idempotent) call is redone and every output
// rewritten by the second stream.
TEST_F(ClientProtocolTest, UnavailableAfterAResponseRetriesTheWholeStream) {
  ExpectWholeStreamRetried(Script::kUnavailableAfterOneChunk, 2);
}

// dx written over dy (in place): once a chunk's grad_input was written, dy is partly gone and a
// retry would send dx as dy, a wrong gradient with OK. The call fails instead, not retried.
absl::StatusOr<RawBackwardResult> InPlaceCall(Client& client, const std::vector<float>& x,
                                              std::vector<float>& dy_then_dx,
                                              std::vector<float>& dgamma,
                                              const std::vector<float>& gamma) {
  RawBackwardArgs a;
  a.num_rows = dy_then_dx.size() / gamma.size();
  a.hidden_dim = static_cast<uint32_t>(gamma.size());
  a.x = {reinterpret_cast<const uint8_t*>(x.data()), x.size() * 4};
  a.dy = {reinterpret_cast<const uint8_t*>(dy_then_dx.data()), dy_then_dx.size() * 4};
  a.dx = {reinterpret_cast<uint8_t*>(dy_then_dx.data()), dy_then_dx.size() * 4};
  a.gamma = {reinterpret_cast<const uint8_t*>(gamma.data()), gamma.size() * 4};
  a.dgamma = {reinterpret_cast<uint8_t*>(dgamma.data()), dgamma.size() * 4};
  a.in_place = true;
  return client.BackwardRaw(a, {});
}

TEST_F(ClientProtocolTest, InPlaceIsNotRetriedOnceAChunksGradInputWasWritten) {
  service_.script = Script::kUnavailableAfterOneChunk;
  std::vector<float> dy = dy_, dgamma(kHidden);
  absl::StatusOr<RawBackwardResult> r = InPlaceCall(*client_, x_, dy, dgamma, gamma_);
  ASSERT_FALSE(r.ok()) << "retried in place: attempts " << r->attempts;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("not retried: the call is in place"), std::string::npos)
      << r.status();
  EXPECT_EQ(service_.streams.load(), 1);
}

TEST_F(ClientProtocolTest, InPlaceIsRetriedWhileNoChunkWasAnswered) {
  service_.script = Script::kUnavailableFirstTwo;
  std::vector<float> dy = dy_, dgamma(kHidden);
  absl::StatusOr<RawBackwardResult> r = InPlaceCall(*client_, x_, dy, dgamma, gamma_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->attempts, 3);
  EXPECT_EQ(dy, x_);  // the scripted server's dx
}

TEST_F(ClientProtocolTest, CancelledBeforeAnyResponseRetriesTheWholeStream) {
  ExpectWholeStreamRetried(Script::kCancelledFirst, 2);
}

TEST_F(ClientProtocolTest, ShortGradInputIsInternal) {
  ExpectInternal(Script::kShortGradInput, "grad_input bytes for 3 rows, expected 48");
}

TEST_F(ClientProtocolTest, MissingFinalMessageIsInternal) {
  ExpectInternal(Script::kNoFinalMessage, "no grad_gamma");
}

TEST_F(ClientProtocolTest, RowsOutsideTheBatchAreInternal) {
  ExpectInternal(Script::kRowsOutOfRange, "of a 10-row batch");
}

// Both scripts send 3 + 3 + 3 + 1 rows, as many as the batch has, but not each row once.
TEST_F(ClientProtocolTest, RepeatedRowRangeIsInternal) {
  ExpectInternal(Script::kRepeatedRange, "server sent rows [0, 3) after rows [0, 3)");
}

TEST_F(ClientProtocolTest, SkippedRowIsInternal) {
  ExpectInternal(Script::kSkippedRow, "server sent rows [4, 7) after rows [0, 3)");
}

// Unary calls get the client's own retries too (gRPC's retry layer is off, see client.cc):
// UNAVAILABLE is retried within max_attempts, other codes are not.
// The client's default receive limit takes the largest answer the server sends.
TEST_F(ClientProtocolTest, TheLargestEmitPtxBatchFitsTheDefaultReceiveLimit) {
  v1::EmitPtxRequest request;
  request.set_kernel("largest-batch");
  absl::StatusOr<v1::EmitPtxResponse> r = client_->EmitPtx(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ptx().size(), size_t{6} << 20);
}

TEST_F(ClientProtocolTest, UnaryCallsRetryOnUnavailableUntilTheyGetThrough) {
  service_.unary_failures = 2;  // max_attempts is 3
  v1::EmitPtxRequest request;
  request.set_kernel("rms_norm_backward");
  absl::StatusOr<v1::EmitPtxResponse> ptx = client_->EmitPtx(request);
  ASSERT_TRUE(ptx.ok()) << ptx.status();
  EXPECT_EQ(ptx->entry(), "rms_norm_backward");
  EXPECT_EQ(service_.unary_calls.load(), 3);

  service_.unary_calls = 0;
  absl::StatusOr<v1::GetServerInfoResponse> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "scripted");
  EXPECT_EQ(service_.unary_calls.load(), 3);
}

TEST_F(ClientProtocolTest, UnaryRetriesStopAtMaxAttemptsAndSkipOtherCodes) {
  service_.unary_failures = 100;
  absl::StatusOr<v1::GetServerInfoResponse> info = client_->ServerInfo();
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(info.status().message(), "scripted: unary not yet");
  EXPECT_EQ(service_.unary_calls.load(), 3);

  service_.unary_calls = 0;
  service_.unary_code = grpc::StatusCode::FAILED_PRECONDITION;
  absl::StatusOr<v1::EmitPtxResponse> ptx = client_->EmitPtx(v1::EmitPtxRequest());
  ASSERT_FALSE(ptx.ok());
  EXPECT_EQ(ptx.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(service_.unary_calls.load(), 1);
}

TEST_F(ClientProtocolTest, NoRetryWhoseBackoffWouldOutlastTheDeadline) {
  ClientOptions options = Options();
  options.max_attempts = 5;
  options.initial_backoff = absl::Milliseconds(300);
  options.max_backoff = absl::Milliseconds(300);
  std::unique_ptr<Client> slow = Connect(options);
  ASSERT_NE(slow, nullptr);
  service_.unary_failures = 100;
  CallOptions call;
  call.deadline = absl::Milliseconds(100);
  absl::StatusOr<v1::GetServerInfoResponse> info = slow->ServerInfo(call);
  ASSERT_FALSE(info.ok());
  // The backoff (240-360 ms) would outlast the deadline: no retry, and the caller hears the
  // server's UNAVAILABLE at once rather than a DEADLINE_EXCEEDED later.
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
  EXPECT_EQ(service_.unary_calls.load(), 1);

  // The same for the stream.
  service_.script = Script::kUnavailableFirstTwo;
  BackwardOptions backward;
  backward.deadline = absl::Milliseconds(100);
  absl::StatusOr<Gradients> g = slow->Backward(x_, dy_, gamma_, 1e-5f, backward);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable) << g.status();
  EXPECT_EQ(service_.streams.load(), 1);
}

}  // namespace
}  // namespace normgrad
