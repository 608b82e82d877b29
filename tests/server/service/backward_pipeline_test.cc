// BackwardPipeline without gRPC: a hand-written driver plays gRPC's part (reads complete when the
// test says, writes too) so that flow control, byte admission, ordering and the one final status
// are checked step by step, with the CPU backend computing for real.
#include "server/service/backward_pipeline.h"

#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cpu/cpu_backend.h"
#include "server/service/service_metrics.h"
#include "server/service/admission.h"
#include "tests/server/service/batch_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

// gRPC's part: holds the read and the write the pipeline started, completes them when told,
// runs scheduled jobs when told, and records the responses and the one final status.
class FakeCall {
 public:
  explicit FakeCall(AdmissionLimits limits = {}, uint64_t rows_limit = 1 << 20,
                    MinStreamRate min_rate = {})
      : admission_(limits), backend_(NewCpuBackend({.threads = 1})) {
    StreamDeps deps;
    deps.limits.max_num_rows = rows_limit;
    deps.min_rate = min_rate;
    deps.backend = backend_.get();
    deps.admission = &admission_;
    deps.metrics = &metrics_;
    pipeline_ = std::make_unique<BackwardPipeline>(deps, absl::InfiniteFuture());
  }

  void Start(absl::Status refused = absl::OkStatus()) { Apply(pipeline_->Start(refused)); }
  // Starts, delivers the header of `batch` and runs the session start it schedules: the call
  // then reads its first chunk.
  void StartSession(const testing::Batch& batch) {
    Start();
    Deliver(testing::HeaderFor(batch));
    RunJobs();
  }

  bool read_pending() const { return read_into_ != nullptr; }
  bool write_pending() const { return write_from_ != nullptr; }
  int jobs_scheduled() const { return scheduled_; }

  // Completes the pending read with `message` (the client sent it).
  void Deliver(const v1::BackwardRequest& message) {
    ASSERT_NE(read_into_, nullptr) << "no read pending";
    *read_into_ = message;
    read_into_ = nullptr;
    Apply(pipeline_->OnReadDone(true, false));
  }
  void HalfClose() {
    ASSERT_NE(read_into_, nullptr) << "no read pending";
    read_into_ = nullptr;
    Apply(pipeline_->OnReadDone(false, false));
  }
  // Runs every scheduled job (each may schedule the next).
  void RunJobs() {
    while (scheduled_ > 0) {
      --scheduled_;
      Apply(pipeline_->RunOneJob());
    }
  }
  // Completes the pending write (the client read it).
  void CompleteWrite(bool ok = true) {
    ASSERT_NE(write_from_, nullptr) << "no write pending";
    responses_.push_back(write_from_->ToProto());
    write_from_ = nullptr;
    Apply(pipeline_->OnWriteDone(ok));
  }
  // Everything a patient client would see: jobs run, writes complete, until nothing moves.
  void Settle() {
    while (scheduled_ > 0 || write_from_ != nullptr) {
      RunJobs();
      if (write_from_ != nullptr) CompleteWrite();
    }
  }

  BackwardPipeline& pipeline() { return *pipeline_; }
  AdmissionController& admission() { return admission_; }
  const std::vector<v1::BackwardResponse>& responses() const { return responses_; }
  const std::vector<absl::Status>& finishes() const { return finishes_; }

  void Apply(StreamActions a) {
    if (a.read_into != nullptr) {
      ASSERT_EQ(read_into_, nullptr) << "two reads in flight";
      read_into_ = a.read_into;
    }
    if (a.write_from != nullptr) {
      ASSERT_EQ(write_from_, nullptr) << "two writes in flight";
      write_from_ = a.write_from;
    }
    if (a.schedule) ++scheduled_;
    std::optional<absl::Status> finish = std::move(a.finish);
    if (std::optional<absl::Status> deferred = pipeline_->Issued(a.issued())) finish = deferred;
    if (finish.has_value()) finishes_.push_back(*finish);
    if (a.try_cancel) try_cancels_++;
  }
  int try_cancels() const { return try_cancels_; }

 private:
  AdmissionController admission_;
  MetricsRegistry registry_;
  const ServiceMetrics metrics_{registry_};
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<BackwardPipeline> pipeline_;
  v1::BackwardRequest* read_into_ = nullptr;
  const Outgoing* write_from_ = nullptr;
  int scheduled_ = 0;
  int try_cancels_ = 0;
  std::vector<v1::BackwardResponse> responses_;
  std::vector<absl::Status> finishes_;
};

TEST(BackwardPipelineTest, AWholeStreamGivesTheReferenceGradientsInOrderAndOneOkStatus) {
  const testing::Batch b = testing::RandomBatch(10, 33, 1);
  FakeCall call;
  call.Start();
  call.Deliver(testing::HeaderFor(b));
  for (uint64_t first = 0; first < b.rows; first += 4) {
    call.Deliver(testing::ChunkFor(b, first, std::min<uint64_t>(4, b.rows - first)));
    call.Settle();
  }
  call.HalfClose();
  call.Settle();
  ASSERT_EQ(call.finishes().size(), 1u);
  EXPECT_TRUE(call.finishes()[0].ok()) << call.finishes()[0];
  std::vector<float> want_dx, want_dgamma;
  testing::ReferenceFor(b, want_dx, want_dgamma);
  std::vector<float> dx(b.rows * b.hidden, -1), dgamma;
  uint64_t next_row = 0;
  for (const v1::BackwardResponse& r : call.responses()) {
    if (r.has_summary()) {
      dgamma.resize(r.grad_gamma().size() / 4);
      if (!dgamma.empty()) std::memcpy(dgamma.data(), r.grad_gamma().data(), dgamma.size() * 4);
      EXPECT_EQ(r.summary().rows(), b.rows);
      continue;
    }
    EXPECT_EQ(r.first_row(), next_row);  // in request order
    std::memcpy(dx.data() + r.first_row() * b.hidden, r.grad_input().data(),
                r.grad_input().size());
    next_row += r.num_rows();
  }
  EXPECT_EQ(next_row, b.rows);
  EXPECT_LT(testing::MaxScaledError(dx, want_dx), 1e-5);
  EXPECT_LT(testing::MaxScaledError(dgamma, want_dgamma), 1e-5);
  EXPECT_TRUE(call.responses().back().has_summary());
  const StreamTotals t = call.pipeline().OnDone();
  EXPECT_EQ(t.code, absl::StatusCode::kOk);
  EXPECT_EQ(t.rows, b.rows);
  EXPECT_EQ(call.admission().active_streams(), 0u);
  EXPECT_EQ(call.admission().inflight_bytes(), 0u);
}

TEST(BackwardPipelineTest, StopsReadingWithThreeChunksHeldAndResumesWhenOneIsWritten) {
  const testing::Batch b = testing::RandomBatch(8, 16, 2);
  FakeCall call;
  call.StartSession(b);
  // Each chunk holds its whole message (x, dy and the fields around them) and its dx.
  std::vector<uint64_t> chunk_bytes;
  for (int i = 0; i < kMaxChunksHeldPerStream; ++i) {
    ASSERT_TRUE(call.read_pending()) << "chunk " << i;
    const v1::BackwardRequest chunk = testing::ChunkFor(b, i, 1);
    chunk_bytes.push_back(chunk.ByteSizeLong() + b.hidden * 4);
    EXPECT_GT(chunk_bytes.back(), 3 * b.hidden * 4);  // x, dy, dx
    call.Deliver(chunk);
  }
  EXPECT_FALSE(call.read_pending()) << "a fourth read with three chunks held";
  const uint64_t held = call.admission().inflight_bytes();
  EXPECT_EQ(held, chunk_bytes[0] + chunk_bytes[1] + chunk_bytes[2]);
  call.RunJobs();
  EXPECT_FALSE(call.read_pending()) << "computed but not written is still held";
  call.CompleteWrite();
  EXPECT_TRUE(call.read_pending());
  EXPECT_EQ(call.admission().inflight_bytes(), held - chunk_bytes[0]);
}

TEST(BackwardPipelineTest, AChunkOverTheByteBudgetWithNothingHeldFailsWithResourceExhausted) {
  const testing::Batch b = testing::RandomBatch(4, 64, 3);
  FakeCall call(AdmissionLimits{.max_streams = 4, .max_inflight_bytes = 1000});
  call.StartSession(b);
  call.Deliver(testing::ChunkFor(b, 0, 2));  // 2 rows x 64 x 4 B x 3 = 1536 B > 1000
  ASSERT_EQ(call.finishes().size(), 1u);
  EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(call.finishes()[0].message(), HasSubstr("--max-inflight-bytes"));
  EXPECT_FALSE(call.read_pending());
  EXPECT_EQ(call.admission().inflight_bytes(), 0u);
}

TEST(BackwardPipelineTest, AChunkOverTheBudgetWaitsForTheStreamsOwnWritesInsteadOfFailing) {
  const testing::Batch b = testing::RandomBatch(4, 64, 4);
  // One row chunk holds 768 B: room for one, not two.
  FakeCall call(AdmissionLimits{.max_streams = 4, .max_inflight_bytes = 1000});
  call.StartSession(b);
  call.Deliver(testing::ChunkFor(b, 0, 1));
  call.Deliver(testing::ChunkFor(b, 1, 1));  // waits: the first still holds 768 B
  EXPECT_TRUE(call.finishes().empty());
  EXPECT_FALSE(call.read_pending()) << "reading on with a chunk waiting for bytes";
  call.RunJobs();
  call.CompleteWrite();  // releases the first chunk's bytes: the second is admitted
  EXPECT_TRUE(call.read_pending());
  call.Settle();
  call.Deliver(testing::ChunkFor(b, 2, 1));
  call.Settle();
  call.Deliver(testing::ChunkFor(b, 3, 1));
  call.Settle();
  call.HalfClose();
  call.Settle();
  ASSERT_EQ(call.finishes().size(), 1u);
  EXPECT_TRUE(call.finishes()[0].ok()) << call.finishes()[0];
  EXPECT_EQ(call.responses().size(), 5u);
}

TEST(BackwardPipelineTest, AFinishDecidedWhileAReadIsBeingIssuedWaitsForIt) {
  FakeCall call;
  StreamActions first = call.pipeline().Start();
  ASSERT_NE(first.read_into, nullptr);
  // Before the reactor issued that read, another thread reports a cancel.
  StreamActions cancel = call.pipeline().OnCancel();
  EXPECT_FALSE(cancel.finish.has_value()) << "finish overtook a read not yet issued";
  std::optional<absl::Status> deferred = call.pipeline().Issued(first.issued());
  ASSERT_TRUE(deferred.has_value());
  EXPECT_EQ(deferred->code(), absl::StatusCode::kCancelled);
}

TEST(BackwardPipelineTest, AChunkBeforeTheHeaderIsInvalidArgumentAndStopsReading) {
  const testing::Batch b = testing::RandomBatch(2, 8, 5);
  FakeCall call;
  call.Start();
  call.Deliver(testing::ChunkFor(b, 0, 2));
  ASSERT_EQ(call.finishes().size(), 1u);
  EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(call.read_pending());
  EXPECT_EQ(call.jobs_scheduled(), 0);
}

TEST(BackwardPipelineTest, HalfClosingBeforeEveryRowArrivedIsInvalidArgumentNamingTheRows) {
  const testing::Batch b = testing::RandomBatch(6, 8, 6);
  FakeCall call;
  call.Start();
  call.Deliver(testing::HeaderFor(b));
  call.Deliver(testing::ChunkFor(b, 0, 2));
  call.Settle();
  call.HalfClose();
  ASSERT_EQ(call.finishes().size(), 1u);
  EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(call.finishes()[0].message(), HasSubstr("after 2 of header.num_rows = 6"));
}

TEST(BackwardPipelineTest, TheWatchdogEndsAStreamWaitingForARequestOrCancelsOneThatDoesNotRead) {
  const testing::Batch b = testing::RandomBatch(4, 8, 7);
  {
    FakeCall call;
    call.Start();
    call.Apply(call.pipeline().CheckIdle(absl::Now(), absl::Seconds(30)));
    EXPECT_TRUE(call.finishes().empty()) << "ended before the timeout";
    call.Apply(call.pipeline().CheckIdle(absl::Now() + absl::Seconds(31), absl::Seconds(30)));
    ASSERT_EQ(call.finishes().size(), 1u);
    EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(call.finishes()[0].message(), HasSubstr("no request message"));
  }
  {
    FakeCall call;
    call.Start();
    call.Deliver(testing::HeaderFor(b));
    call.Deliver(testing::ChunkFor(b, 0, 2));
    call.RunJobs();
    ASSERT_TRUE(call.write_pending());  // and a read: the client sends but does not read
    call.Apply(call.pipeline().CheckIdle(absl::Now() + absl::Seconds(31), absl::Seconds(30)));
    EXPECT_EQ(call.try_cancels(), 1);
    EXPECT_TRUE(call.finishes().empty());
    call.Apply(call.pipeline().OnCancel());
    ASSERT_EQ(call.finishes().size(), 1u);
    EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(call.finishes()[0].message(), HasSubstr("read no response"));
  }
}

// --min-stream-bytes-per-second: judged per window of waiting on the client; a trickle ends
// with DEADLINE_EXCEEDED naming the rate and the flag, a stream at the rate starts a new window.
TEST(BackwardPipelineTest, AStreamSlowerThanTheMinimumRateEndsNamingTheRateAndTheFlag) {
  const testing::Batch b = testing::RandomBatch(64, 256, 8);  // a row: 1 KiB of x, 1 of dy
  const MinStreamRate slow{.bytes_per_second = 1000, .window = absl::Seconds(10)};
  {  // the header and one row (4 KiB with gamma and dx), then nothing
    FakeCall call({}, 1 << 20, slow);
    call.Start();
    call.Deliver(testing::HeaderFor(b));
    call.Deliver(testing::ChunkFor(b, 0, 1));
    call.Settle();
    ASSERT_TRUE(call.read_pending());
    // The idle timeout is off (0): only the rate judges.
    call.Apply(call.pipeline().CheckIdle(absl::Now() + absl::Seconds(5), absl::ZeroDuration()));
    EXPECT_TRUE(call.finishes().empty()) << "ended before its window was over";
    call.Apply(call.pipeline().CheckIdle(absl::Now() + absl::Seconds(11), absl::ZeroDuration()));
    ASSERT_EQ(call.finishes().size(), 1u);
    EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(call.finishes()[0].message(), HasSubstr("stream too slow: 4096 bytes"));
    EXPECT_THAT(call.finishes()[0].message(), HasSubstr("below --min-stream-bytes-per-second=1000"));
  }
  {  // 8 rows (25 KiB) in the first window pass; nothing in the second does not
    FakeCall call({}, 1 << 20, slow);
    call.Start();
    call.Deliver(testing::HeaderFor(b));
    call.Deliver(testing::ChunkFor(b, 0, 8));
    call.Settle();
    const absl::Time now = absl::Now();
    call.Apply(call.pipeline().CheckIdle(now + absl::Seconds(11), absl::ZeroDuration()));
    EXPECT_TRUE(call.finishes().empty()) << call.finishes()[0];
    call.Apply(call.pipeline().CheckIdle(now + absl::Seconds(22), absl::ZeroDuration()));
    ASSERT_EQ(call.finishes().size(), 1u);
    EXPECT_THAT(call.finishes()[0].message(), HasSubstr("stream too slow: 0 bytes"));
  }
  {  // time with a job queued or running does not count against the client
    FakeCall call({}, 1 << 20, slow);
    call.Start();
    call.Deliver(testing::HeaderFor(b));  // the session start is scheduled, not yet run
    const absl::Time now = absl::Now();
    call.Apply(call.pipeline().CheckIdle(now + absl::Seconds(11), absl::ZeroDuration()));
    EXPECT_TRUE(call.finishes().empty()) << "judged while the server was busy";
    call.RunJobs();
    call.Apply(call.pipeline().CheckIdle(now + absl::Seconds(12), absl::ZeroDuration()));
    EXPECT_TRUE(call.finishes().empty()) << "the server's 11 s counted against the client";
    call.Apply(call.pipeline().CheckIdle(now + absl::Seconds(22), absl::ZeroDuration()));
    ASSERT_EQ(call.finishes().size(), 1u);
    EXPECT_THAT(call.finishes()[0].message(), HasSubstr("moved in 11s of waiting on the client"));
  }
  {  // 0: no minimum
    FakeCall call;
    call.Start();
    call.Apply(call.pipeline().CheckIdle(absl::Now() + absl::Hours(1), absl::ZeroDuration()));
    EXPECT_TRUE(call.finishes().empty());
  }
}

TEST(BackwardPipelineTest, ARefusedStreamEndsWithTheRefusalAndAdmitsNothing) {
  FakeCall call;
  call.Start(absl::UnavailableError("the server is shutting down"));
  ASSERT_EQ(call.finishes().size(), 1u);
  EXPECT_EQ(call.finishes()[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(call.read_pending());
  EXPECT_EQ(call.admission().active_streams(), 0u);
}

}  // namespace
}  // namespace normgrad::server
