// The load generator's engine: drives RmsNormBackward or EmitPtx through normgrad::Client's
// asynchronous calls with a bounded number in flight, optionally paced by a constant or Poisson
// arrival rate, and records every completed request.
//
//   absl::StatusOr<std::unique_ptr<LoadRunner>> runner = LoadRunner::Create(config);
//   absl::StatusOr<std::vector<RunStats>> runs = (*runner)->Run();
//
// Always bounded: a fixed run stops issuing at --total requests or --duration, whichever comes
// first, and never later than --max-duration; a sweep step stops after --max-windows windows.
// In-flight requests are then awaited (each has the client's deadline).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/tools/load_stats.h"
#include "normgrad/client.h"

namespace normgrad::tools {

struct Shape {
  uint64_t rows = 0;
  uint32_t hidden_dim = 0;
};

enum class LoadCall { kBackward, kEmitPtx };

struct LoadConfig {
  ClientOptions client;  // target, TLS, token, deadline...
  LoadCall call = LoadCall::kBackward;
  int concurrency = 8;
  int connections = 1;
  uint64_t total = 0;                               // 0: bounded by duration only
  absl::Duration duration = absl::ZeroDuration();   // zero: bounded by total only
  absl::Duration max_duration = absl::Seconds(60);  // hard bound of every phase
  double rate = 0;                                  // requests/s; 0: unpaced
  bool poisson = false;
  std::vector<Shape> shapes = {{64, 4096}};  // requests cycle through these
  uint64_t warmup = 0;                       // requests before measuring
  // EmitPtx requests: kernel, GPU target and dtype; hidden_dim comes from the shapes.
  std::string kernel = "batched_rms_norm_backward";
  std::string gpu_target = "sm_90";
  // Concurrency sweep: sweep_start..sweep_end by sweep_step, each measured in windows.
  bool sweep = false;
  int sweep_start = 1, sweep_end = 1, sweep_step = 1;
  absl::Duration window = absl::Seconds(1);
  double stability_percent = 10;
  int max_windows = 10;
  uint64_t seed = 1;
};

class LoadRunner {
 public:
  static absl::StatusOr<std::unique_ptr<LoadRunner>> Create(const LoadConfig& config);
  ~LoadRunner();

  // Warm-up, then the fixed run (one RunStats) or the sweep (one per concurrency).
  absl::StatusOr<std::vector<RunStats>> Run();

  // Live counters for a progress line (any thread).
  uint64_t completed() const { return completed_.load(); }
  uint64_t failed() const { return failed_.load(); }
  int current_concurrency() const { return current_concurrency_.load(); }
  bool hit_max_duration() const { return hit_max_duration_; }

 private:
  struct ShapeData {
    Shape shape;
    std::vector<float> x, dy, gamma;
    uint64_t payload_bytes = 0;
  };

  explicit LoadRunner(const LoadConfig& config) : config_(config) {}
  // Issues requests until `count` were issued, `until` passes or stop_ is set, keeping at most
  // concurrency_ in flight; then waits for all in flight. Records go to records_ when `record`.
  void Drive(uint64_t count, absl::Time until, bool record);
  void Issue(uint64_t index, bool record);
  void Complete(std::chrono::steady_clock::time_point start, absl::StatusCode code,
                uint64_t payload, bool record);
  std::vector<RequestRecord> TakeRecords();

  LoadConfig config_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<ShapeData> data_;

  std::mutex mu_;
  std::condition_variable changed_;  // in_flight_, concurrency_ or stop_ changed
  int in_flight_ = 0;  // guarded by mu_
  int concurrency_ = 1;  // guarded by mu_
  bool stop_ = false;  // guarded by mu_
  std::vector<RequestRecord> records_;  // guarded by mu_

  std::atomic<uint64_t> completed_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<int> current_concurrency_{0};
  bool hit_max_duration_ = false;
};

}  // namespace normgrad::tools
