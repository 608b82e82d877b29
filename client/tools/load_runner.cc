#include "client/tools/load_runner.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace normgrad::tools {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

absl::Status ValidateConfig(const LoadConfig& c) {
  auto positive = [](const char* flag, int64_t v) {
    return v >= 1 ? absl::OkStatus()
                  : absl::InvalidArgumentError(absl::StrCat(flag, ": must be >= 1, got ", v));
  };
  for (auto s : {positive("--concurrency", c.concurrency), positive("--connections", c.connections),
                 positive("--max-windows", c.max_windows)}) {
    if (!s.ok()) return s;
  }
  if (c.shapes.empty()) return absl::InvalidArgumentError("--shapes: empty");
  for (const Shape& s : c.shapes) {
    if (s.rows == 0 || s.hidden_dim == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shapes: ", s.rows, "x", s.hidden_dim, " has a zero dimension"));
    }
  }
  if (c.max_duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max-duration: must be > 0");
  }
  if (c.rate < 0) return absl::InvalidArgumentError("--rate: must be >= 0");
  if (c.sweep) {
    if (c.sweep_start < 1 || c.sweep_end < c.sweep_start || c.sweep_step < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--concurrency-sweep: need 1 <= start <= end and step >= 1, got ",
                       c.sweep_start, ":", c.sweep_end, ":", c.sweep_step));
    }
    if (c.window <= absl::ZeroDuration())
      return absl::InvalidArgumentError("--window: must be > 0");
  } else if (c.total == 0 && c.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("one of --total or --duration must be set");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadRunner>> LoadRunner::Create(const LoadConfig& config) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  std::unique_ptr<LoadRunner> runner(new LoadRunner(config));
  for (int i = 0; i < config.connections; ++i) {
    ClientOptions options = config.client;
    options.own_connection = config.connections > 1;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    if (!client.ok()) return client.status();
    runner->clients_.push_back(std::move(*client));
  }
  std::mt19937_64 rng(config.seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (const Shape& shape : config.shapes) {
    ShapeData d;
    d.shape = shape;
    if (config.call == LoadCall::kBackward) {
      const uint64_t n = shape.rows * shape.hidden_dim;
      d.x.resize(n);
      d.dy.resize(n);
      d.gamma.resize(shape.hidden_dim);
      for (float& v : d.x) v = uniform(rng);
      for (float& v : d.dy) v = uniform(rng);
      for (float& v : d.gamma) v = 1.0f + 0.1f * uniform(rng);
      // Sent: x, dy, gamma. Received: dx, dgamma.
      d.payload_bytes = (3 * n + 2 * uint64_t{shape.hidden_dim}) * sizeof(float);
    }
    runner->data_.push_back(std::move(d));
  }
  return runner;
}

LoadRunner::~LoadRunner() = default;

void LoadRunner::Complete(std::chrono::steady_clock::time_point start, absl::StatusCode code,
                          uint64_t payload, bool record) {
  const double latency = SecondsSince(start);
  completed_.fetch_add(1);
  if (code != absl::StatusCode::kOk) failed_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (record) records_.push_back({latency, code, payload});
    --in_flight_;
  }
  changed_.notify_all();
}

void LoadRunner::Issue(uint64_t index, bool record) {
  const ShapeData& d = data_[index % data_.size()];
  Client& client = *clients_[index % clients_.size()];
  const auto start = std::chrono::steady_clock::now();
  if (config_.call == LoadCall::kBackward) {
    const uint64_t payload = d.payload_bytes;
    client.BackwardAsync(d.x, d.dy, d.gamma, 1e-5f, {},
                         [this, start, payload, record](absl::StatusOr<Gradients> r) {
                           Complete(start, r.status().code(), payload, record);
                         });
  } else {
    v1::EmitPtxRequest request;
    request.set_kernel(config_.kernel);
    request.set_hidden_dim(d.shape.hidden_dim);
    request.set_target(config_.gpu_target);
    client.EmitPtxAsync(request, {}, [this, start, record](absl::StatusOr<v1::EmitPtxResponse> r) {
      const uint64_t payload = r.ok() ? r->ptx().size() + r->cubin().size() : 0;
      Complete(start, r.status().code(), payload, record);
    });
  }
}

void LoadRunner::Drive(uint64_t count, absl::Time until, bool record) {
  std::mt19937_64 rng(config_.seed + 7);
  std::exponential_distribution<double> exponential(config_.rate > 0 ? config_.rate : 1.0);
  absl::Time next_arrival = absl::Now();
  for (uint64_t issued = 0; issued < count; ++issued) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_until(lock, absl::ToChronoTime(until),
                          [this] { return stop_ || in_flight_ < concurrency_; });
      if (stop_ || in_flight_ >= concurrency_ || absl::Now() >= until) break;
      if (config_.rate > 0) {
        // Pacing: wait for the next arrival time (or stop) while holding the slot.
        changed_.wait_until(lock, absl::ToChronoTime(std::min(next_arrival, until)),
                            [this] { return stop_; });
        if (stop_ || absl::Now() >= until) break;
        next_arrival += absl::Seconds(config_.poisson ? exponential(rng) : 1.0 / config_.rate);
      }
      ++in_flight_;
    }
    Issue(issued, record);
  }
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [this] { return in_flight_ == 0; });
}

std::vector<RequestRecord> LoadRunner::TakeRecords() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(records_, {});
}

absl::StatusOr<std::vector<RunStats>> LoadRunner::Run() {
  std::vector<RunStats> runs;
  auto set_concurrency = [this](int c) {
    std::lock_guard<std::mutex> lock(mu_);
    concurrency_ = c;
    stop_ = false;
    current_concurrency_.store(c);
  };
  const int first_concurrency = config_.sweep ? config_.sweep_start : config_.concurrency;
  if (config_.warmup > 0) {
    set_concurrency(first_concurrency);
    Drive(config_.warmup, absl::Now() + config_.max_duration, /*record=*/false);
    completed_.store(0);
    failed_.store(0);
  }

  if (!config_.sweep) {
    set_concurrency(config_.concurrency);
    const uint64_t count = config_.total > 0 ? config_.total : std::numeric_limits<uint64_t>::max();
    absl::Duration limit = config_.max_duration;
    if (config_.duration > absl::ZeroDuration()) limit = std::min(limit, config_.duration);
    const auto start = std::chrono::steady_clock::now();
    Drive(count, absl::Now() + limit, /*record=*/true);
    const double wall = SecondsSince(start);
    std::vector<RequestRecord> records = TakeRecords();
    hit_max_duration_ =
        config_.total > 0 && records.size() < config_.total &&
        (config_.duration <= absl::ZeroDuration() || config_.duration > config_.max_duration);
    runs.push_back(Summarize(records, wall, config_.concurrency));
    return runs;
  }

  for (int c = config_.sweep_start; c <= config_.sweep_end; c += config_.sweep_step) {
    set_concurrency(c);
    TakeRecords();
    std::thread driver([this] {
      Drive(std::numeric_limits<uint64_t>::max(), absl::Now() + config_.max_duration, true);
    });
    std::vector<RunStats> windows;
    std::vector<std::vector<RequestRecord>> window_records;
    std::vector<double> window_seconds;
    const absl::Time step_end = absl::Now() + config_.max_duration;
    auto window_start = std::chrono::steady_clock::now();
    while (static_cast<int>(windows.size()) < config_.max_windows && absl::Now() < step_end) {
      absl::SleepFor(config_.window);
      std::vector<RequestRecord> records = TakeRecords();
      const double seconds = SecondsSince(window_start);
      window_start = std::chrono::steady_clock::now();
      windows.push_back(Summarize(records, seconds, c));
      window_records.push_back(std::move(records));
      window_seconds.push_back(seconds);
      if (IsStable(windows, config_.stability_percent)) break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    changed_.notify_all();
    driver.join();
    TakeRecords();  // completions after the last window are not part of any window
    // The step's numbers: the last (up to) 3 windows together.
    std::vector<RequestRecord> merged;
    double seconds = 0;
    const size_t from = windows.size() > 3 ? windows.size() - 3 : 0;
    for (size_t i = from; i < windows.size(); ++i) {
      merged.insert(merged.end(), window_records[i].begin(), window_records[i].end());
      seconds += window_seconds[i];
    }
    RunStats step = Summarize(merged, seconds, c);
    step.windows = static_cast<int>(windows.size());
    step.stable = IsStable(windows, config_.stability_percent);
    runs.push_back(std::move(step));
    if (c > std::numeric_limits<int>::max() - config_.sweep_step) break;
  }
  return runs;
}

}  // namespace normgrad::tools
