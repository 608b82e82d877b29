// Every way a call can end, at every point of its chunks, on every transport the server writes
// through (docs/api.md, "The end of a call"): a cancel, the deadline, or a server drain, while
// the server's job for chunk k waits before touching the client's memory, half-way through its
// rows, or after computing them. The server's backend is a real CPU backend behind gates
// (tests/common/gated_backend.h) that hold the job exactly there.
//
// What must hold, each an assertion that fails on the defect it guards against:
// - A call whose memory the server writes (a shared-memory staging region, or the caller's own
//   region) returns only once no job of it is inside the backend, or says that it may still be
//   written (the region) or throws its memory away (staging): checked by the gates' job count
//   when the call's callback ran.
// - Memory the caller reuses after such a call returned is never written by its late job: a
//   canary written at once into the region's grad_input range survives the job's end, and a
//   next call that takes the same staging pool, held while the previous call's job finishes,
//   still gets the reference gradients.
// - Every OK result equals the reference, and the status says what ended the call.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "normgrad/shared_memory.h"
#include "server/backend_factory/backend_factory.h"
#include "server/process/normgrad_server.h"
#include "tests/client/test_server.h"
#include "tests/common/gated_backend.h"

namespace normgrad {
namespace {

using ::normgrad::testing::Batch;
using ::normgrad::testing::ChunkGates;
using ::normgrad::testing::StartGatedServer;

enum class Via { kBytes, kStaging, kRegion };
enum class Ending { kCancel, kDeadline, kDrain };

const char* ViaName(Via v) {
  return v == Via::kBytes ? "bytes" : v == Via::kStaging ? "staging" : "region";
}
const char* EndingName(Ending e) {
  return e == Ending::kCancel ? "cancel" : e == Ending::kDeadline ? "deadline" : "drain";
}
const char* PointName(ChunkGates::Point p) {
  return p == ChunkGates::kBefore ? "before" : p == ChunkGates::kDuring ? "during" : "after";
}

constexpr uint32_t kHidden = 64;
constexpr uint64_t kRowsPerChunk = 16;
constexpr uint64_t kRows = 6 * kRowsPerChunk;  // six chunks

// Where one call's tensors are: caller vectors (bytes, staging) or a registered region.
struct Tensors {
  std::vector<float> dx, dgamma;
  std::unique_ptr<SharedMemoryRegion> region;
  float* x = nullptr;
  float* dy = nullptr;
  float* region_dx = nullptr;

  Tensors(const Batch& b, Via via) : dgamma(b.hidden) {
    const uint64_t n = b.rows * b.hidden;
    if (via == Via::kRegion) {
      region = *SharedMemoryRegion::Create(3 * n * 4);
      x = region->As<float>(0);
      dy = region->As<float>(n * 4);
      region_dx = region->As<float>(2 * n * 4);
      std::memcpy(x, b.x.data(), n * 4);
      std::memcpy(dy, b.dy.data(), n * 4);
    } else {
      dx.resize(n);
    }
  }
  RawBackwardArgs Args(const Batch& b) {
    const uint64_t n = b.rows * b.hidden;
    RawBackwardArgs a;
    a.type = ElementType::kF32;
    a.num_rows = b.rows;
    a.hidden_dim = b.hidden;
    a.eps = 1e-5f;
    auto bytes = [](const float* p, uint64_t count) {
      return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(p), count * 4);
    };
    a.x = region ? bytes(x, n) : bytes(b.x.data(), n);
    a.dy = region ? bytes(dy, n) : bytes(b.dy.data(), n);
    a.gamma = bytes(b.gamma.data(), b.hidden);
    float* out = region ? region_dx : dx.data();
    a.dx = absl::MakeSpan(reinterpret_cast<uint8_t*>(out), n * 4);
    a.dgamma = absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma.data()), b.hidden * 4);
    return a;
  }
};

// The outcome of one call, filled by its callback.
struct Outcome {
  std::promise<absl::Status> status;
  // Chunk jobs of the call's session inside the backend when the callback ran.
  std::atomic<int> active_at_done{-1};
};

using Case = std::tuple<Via, Ending, ChunkGates::Point, uint64_t>;

class CallEndingsTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
    socket_ = dir_ + "/grpc.sock";
    server_ = StartGatedServer(socket_, gates_);
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    gates_->ReleaseAll();
    client_.reset();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<Client> Connect(Via via) {
    ClientOptions o;
    o.target = "unix:" + socket_;
    o.transport = via == Via::kBytes ? Transport::kBytes : Transport::kSharedMemory;
    o.max_attempts = 1;
    o.chunk_bytes = kRowsPerChunk * kHidden * 4;
    o.shm_chunk_bytes = kRowsPerChunk * kHidden * 4;
    o.writes_done_grace = absl::Seconds(20);
    return *Client::Create(o);
  }

  // Starts a call; its callback records the status and the session's jobs in the backend.
  std::future<absl::Status> Start(Client& c, const RawBackwardArgs& args, BackwardOptions options,
                                  int session, std::shared_ptr<Outcome> outcome) {
    std::future<absl::Status> f = outcome->status.get_future();
    c.BackwardRawAsync(args, options,
                       [this, session, outcome](absl::StatusOr<RawBackwardResult> r) {
                         outcome->active_at_done.store(gates_->Active(session));
                         outcome->status.set_value(r.status());
                       });
    return f;
  }

  std::string dir_ = "/tmp/normgrad-endings-XXXXXX";
  std::string socket_;
  std::shared_ptr<ChunkGates> gates_ = std::make_shared<ChunkGates>();
  std::unique_ptr<server::NormGradServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_P(CallEndingsTest, NoByteLandsInMemoryTheCallerReusedAndEveryOkIsRight) {
  const auto [via, ending, point, chunk] = GetParam();
  SCOPED_TRACE(absl::StrCat(ViaName(via), " ", EndingName(ending), " ", PointName(point),
                            " chunk ", chunk));
  client_ = Connect(via);
  const Batch a(kRows, kHidden, /*seed=*/11);
  Tensors ta(a, via);
  if (via == Via::kRegion) {
    ASSERT_TRUE(client_->RegisterSharedMemory(*ta.region).ok());
  }
  const int gate = gates_->Arm(/*session=*/0, chunk, point);

  BackwardOptions options;
  options.cancellation = std::make_shared<CallCancellation>();
  const absl::Duration deadline = absl::Milliseconds(300);
  if (ending == Ending::kDeadline) options.deadline = deadline;
  const absl::Time started = absl::Now();
  auto outcome = std::make_shared<Outcome>();
  std::future<absl::Status> done = Start(*client_, ta.Args(a), options, 0, outcome);
  ASSERT_TRUE(gates_->WaitReached(gate, absl::Seconds(10)));

  std::thread drain;
  switch (ending) {
    case Ending::kCancel:
      options.cancellation->Cancel();
      break;
    case Ending::kDeadline:
      absl::SleepFor(started + deadline + absl::Milliseconds(50) - absl::Now());
      break;
    case Ending::kDrain:
      drain = std::thread([this] { server_->Shutdown(absl::Milliseconds(100)); });
      break;
  }
  // Time for a call that does not wait for its job to come back.
  const bool early = done.wait_for(std::chrono::milliseconds(400)) == std::future_status::ready;
  absl::Status status_early = early ? done.get() : absl::OkStatus();
  const bool in_doubt =
      early && absl::StrContains(status_early.message(), "did not confirm that it stopped");
  const float kCanary = -12345.0f;
  if (early && via == Via::kRegion && !in_doubt) {
    // The caller takes its memory back: the canary must survive whatever the job does now.
    for (uint64_t i = 0; i < a.rows * a.hidden; ++i) ta.region_dx[i] = kCanary;
  }

  // A next call on the same client while the first call's job still waits: with the first
  // call's staging region back in the pool, its late grad_input would land in this call's rows.
  std::unique_ptr<Batch> b;
  std::unique_ptr<Tensors> tb;
  std::future<absl::Status> next_done;
  auto next_outcome = std::make_shared<Outcome>();
  int next_gate = -1;
  if (early && ending != Ending::kDrain && via != Via::kRegion) {
    b = std::make_unique<Batch>(2 * kRows, kHidden, /*seed=*/12);
    tb = std::make_unique<Tensors>(*b, via);
    next_gate = gates_->Arm(/*session=*/1, 0, ChunkGates::kBefore);
    next_done = Start(*client_, tb->Args(*b), {}, 1, next_outcome);
    ASSERT_TRUE(gates_->WaitReached(next_gate, absl::Seconds(10)));
  }
  gates_->Release(gate);
  ASSERT_TRUE(gates_->WaitIdle(0, absl::Seconds(10)));
  if (next_gate >= 0) gates_->Release(next_gate);
  absl::Status status = early ? status_early : absl::OkStatus();
  if (!early) {
    ASSERT_EQ(done.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    status = done.get();
  }
  if (drain.joinable()) drain.join();

  // The call returned only once its job was out of the backend, unless it says otherwise (its
  // region), or the client threw the memory away (its staging region, when a drain cut it off:
  // the next call on a new server gets a new one).
  const bool must_wait = via == Via::kRegion    ? !in_doubt
                         : via == Via::kStaging ? ending != Ending::kDrain
                                                : false;
  if (must_wait) {
    EXPECT_EQ(outcome->active_at_done.load(), 0)
        << "the call returned (" << status << ") while the server's job could still write its "
        << "memory, and did not say so";
  }
  if (via == Via::kRegion && early && !in_doubt) {
    for (uint64_t i = 0; i < a.rows * a.hidden; ++i) {
      ASSERT_EQ(ta.region_dx[i], kCanary) << "the server wrote grad_input[" << i
                                          << "] after the call returned " << status;
    }
  }
  if (status.ok()) {
    testing::ExpectGradientsClose(via == Via::kRegion
                                      ? absl::MakeConstSpan(ta.region_dx, a.rows * a.hidden)
                                      : absl::MakeConstSpan(ta.dx),
                                  ta.dgamma, a);
  } else if (ending == Ending::kCancel) {
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  } else if (ending == Ending::kDeadline) {
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  } else {
    EXPECT_THAT(status.code(), ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                                absl::StatusCode::kCancelled))
        << status;
  }
  if (next_gate >= 0) {
    ASSERT_EQ(next_done.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    const absl::Status s = next_done.get();
    ASSERT_TRUE(s.ok()) << s;
    testing::ExpectGradientsClose(tb->dx, tb->dgamma, *b);
  }
  if (ending == Ending::kDrain) return;  // the server is gone

  // The client and the server go on: a call with a new shape (a staging region from the pool)
  // gets the reference.
  const Batch c(2 * kRows + 5, kHidden, /*seed=*/13);
  Tensors tc(c, via == Via::kRegion ? Via::kStaging : via);
  absl::StatusOr<RawBackwardResult> r = client_->BackwardRaw(tc.Args(c), {});
  ASSERT_TRUE(r.ok()) << r.status();
  testing::ExpectGradientsClose(tc.dx, tc.dgamma, c);
}

INSTANTIATE_TEST_SUITE_P(
    AllEndings, CallEndingsTest,
    ::testing::Combine(::testing::Values(Via::kBytes, Via::kStaging, Via::kRegion),
                       ::testing::Values(Ending::kCancel, Ending::kDeadline, Ending::kDrain),
                       ::testing::Values(ChunkGates::kBefore, ChunkGates::kDuring,
                                         ChunkGates::kAfter),
                       ::testing::Values(0u, 2u, 5u)),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(ViaName(std::get<0>(info.param)), "_",
                          EndingName(std::get<1>(info.param)), "_",
                          PointName(std::get<2>(info.param)), "_chunk",
                          std::get<3>(info.param));
    });

}  // namespace
}  // namespace normgrad
