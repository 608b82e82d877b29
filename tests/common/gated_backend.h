// A Backend for tests that stops a chosen chunk where the test wants it: it wraps a real backend
// (the CPU backend) and, for one armed (session, chunk, point), blocks the server's job there
// until the test releases it. The points are before the chunk touches the client's memory,
// half-way (the first half of its rows computed and written, the second not yet), and after it
// was computed (the job not yet returned). It also counts, per session, the chunk jobs inside
// the backend now, so that a test can tell whether a job could still write when a call ended.
//
//   auto gates = std::make_shared<ChunkGates>();
//   server = NormGradServer::Start(options, std::make_unique<GatedBackend>(cpu, gates));
//   const int gate = gates->Arm(/*session=*/0, /*chunk=*/1, ChunkGates::kDuring);
//   ... start a call; gates->WaitReached(gate, ...); inject an ending; gates->Release(gate); ...
//
// Sessions are numbered in the order StartBackward created them, from 0.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"

namespace normgrad::testing {

class ChunkGates {
 public:
  enum Point { kBefore, kDuring, kAfter };

  // Arms a gate: the job of `chunk` (0-based, in the session's order) of session `session`
  // stops at `point` until Release(gate). Returns the gate's number.
  int Arm(int session, uint64_t chunk, Point point) {
    std::lock_guard<std::mutex> lock(mu_);
    gates_.push_back({session, chunk, point, false, false});
    return static_cast<int>(gates_.size()) - 1;
  }
  // True once a job waits at gate `gate` (false after `timeout`).
  bool WaitReached(int gate, absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [&] { return gates_[gate].reached; });
  }
  void Release(int gate) {
    std::lock_guard<std::mutex> lock(mu_);
    gates_[gate].released = true;
    cv_.notify_all();
  }
  void ReleaseAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (Gate& g : gates_) g.released = true;
    cv_.notify_all();
  }
  // Chunk jobs of `session` inside the backend now (0 once its last job returned).
  int Active(int session) {
    std::lock_guard<std::mutex> lock(mu_);
    return session < kMaxSessions ? active_[session] : 0;
  }
  // Waits until no chunk job of `session` is inside the backend; false after `timeout`.
  bool WaitIdle(int session, absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [&] { return active_[session] == 0; });
  }

  // Every chunk job sleeps a random 0..max_us microseconds at each point (so that a schedule's
  // cancels and deadlines land before, inside and after chunks alike).
  void SetJitter(int max_us) { jitter_us_.store(max_us); }
  // The wrapped session's side.
  int NewSession() { return next_session_.fetch_add(1); }
  void Enter(int session) {
    std::lock_guard<std::mutex> lock(mu_);
    if (session < kMaxSessions) ++active_[session];
  }
  void Leave(int session) {
    std::lock_guard<std::mutex> lock(mu_);
    if (session < kMaxSessions) --active_[session];
    cv_.notify_all();
  }
  void MaybeWait(int session, uint64_t chunk, Point point) {
    if (const int jitter = jitter_us_.load(); jitter > 0) {
      thread_local std::mt19937 rng(std::random_device{}());
      absl::SleepFor(absl::Microseconds(std::uniform_int_distribution<int>(0, jitter)(rng)));
    }
    std::unique_lock<std::mutex> lock(mu_);
    for (Gate& g : gates_) {
      if (g.session != session || g.chunk != chunk || g.point != point || g.released) continue;
      g.reached = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return g.released; });
      return;
    }
  }
  bool IsGated(int session, uint64_t chunk) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Gate& g : gates_) {
      if (g.session == session && g.chunk == chunk && !g.released) return true;
    }
    return false;
  }

 private:
  struct Gate {
    int session;
    uint64_t chunk;
    Point point;
    bool reached;
    bool released;
  };
  static constexpr int kMaxSessions = 1 << 16;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Gate> gates_;  // a deque: references stay valid while gates are added
  std::atomic<int> next_session_{0};
  std::atomic<int> jitter_us_{0};
  std::unique_ptr<int[]> active_{new int[kMaxSessions]()};
};

class GatedSession final : public server::BackwardSession {
 public:
  GatedSession(std::unique_ptr<server::BackwardSession> inner, std::shared_ptr<ChunkGates> gates,
               int number, uint64_t row_bytes)
      : inner_(std::move(inner)), gates_(std::move(gates)), number_(number), row_bytes_(row_bytes) {}

  absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows,
                            absl::Span<uint8_t> dx) override {
    const uint64_t chunk = chunks_++;
    gates_->Enter(number_);
    absl::Status s = Run(chunk, x, dy, rms, rows, dx);
    gates_->Leave(number_);
    return s;
  }
  absl::Status Finish(absl::Span<uint8_t> dgamma) override { return inner_->Finish(dgamma); }
  absl::string_view KernelName() const override { return inner_->KernelName(); }
  double ComputeSeconds() const override { return inner_->ComputeSeconds(); }

 private:
  absl::Status Run(uint64_t chunk, absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                   absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    gates_->MaybeWait(number_, chunk, ChunkGates::kBefore);
    if (!gates_->IsGated(number_, chunk) || rows < 2) {
      absl::Status s = inner_->ProcessChunk(x, dy, rms, rows, dx);
      gates_->MaybeWait(number_, chunk, ChunkGates::kDuring);
      gates_->MaybeWait(number_, chunk, ChunkGates::kAfter);
      return s;
    }
    // Half the rows, the gate, the other half: a job stopped in the middle of writing dx.
    const uint64_t first = rows / 2, bytes = first * row_bytes_;
    absl::Status s = inner_->ProcessChunk(x.subspan(0, bytes), dy.subspan(0, bytes),
                                          rms.empty() ? rms : rms.subspan(0, first), first,
                                          dx.subspan(0, bytes));
    gates_->MaybeWait(number_, chunk, ChunkGates::kDuring);
    if (s.ok()) {
      s = inner_->ProcessChunk(x.subspan(bytes), dy.subspan(bytes),
                               rms.empty() ? rms : rms.subspan(first), rows - first,
                               dx.subspan(bytes));
    }
    gates_->MaybeWait(number_, chunk, ChunkGates::kAfter);
    return s;
  }

  std::unique_ptr<server::BackwardSession> inner_;
  std::shared_ptr<ChunkGates> gates_;
  const int number_;
  const uint64_t row_bytes_;
  uint64_t chunks_ = 0;
};

class GatedBackend final : public server::Backend {
 public:
  GatedBackend(std::unique_ptr<server::Backend> inner, std::shared_ptr<ChunkGates> gates)
      : inner_(std::move(inner)), gates_(std::move(gates)) {}

  absl::string_view Name() const override { return inner_->Name(); }
  server::DeviceDescription Device() const override { return inner_->Device(); }
  absl::StatusOr<std::unique_ptr<server::BackwardSession>> StartBackward(
      const kernels::BackwardRequest& spec, absl::Span<const uint8_t> gamma) override {
    absl::StatusOr<std::unique_ptr<server::BackwardSession>> s = inner_->StartBackward(spec, gamma);
    if (!s.ok()) return s;
    const uint64_t row_bytes = uint64_t{spec.hidden_dim} * kernels::DTypeBytes(spec.dtype);
    return std::unique_ptr<server::BackwardSession>(
        new GatedSession(*std::move(s), gates_, gates_->NewSession(), row_bytes));
  }
  absl::Status Preload(const kernels::BackwardKernel& kernel,
                       const kernels::KernelConfig& config) override {
    return inner_->Preload(kernel, config);
  }
  server::ModuleCacheStats CacheStats() const override { return inner_->CacheStats(); }
  server::DeviceBackend* device() override { return inner_->device(); }

 private:
  std::unique_ptr<server::Backend> inner_;
  std::shared_ptr<ChunkGates> gates_;
};

}  // namespace normgrad::testing
