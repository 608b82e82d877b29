#include "server/process/watchdogs.h"

#include <algorithm>
#include <utility>

namespace normgrad::server {

PeriodicTask::PeriodicTask(absl::Duration period, std::function<bool()> visit)
    : period_(period), visit_(std::move(visit)), thread_([this] { Run(); }) {}

PeriodicTask::~PeriodicTask() { Stop(); }

void PeriodicTask::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void PeriodicTask::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    wake_.wait_for(lock, absl::ToChronoMilliseconds(period_), [this] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    const bool more = visit_();
    lock.lock();
    if (!more) break;
  }
}

absl::Duration StreamWatchdogPeriod(const ServerOptions& options) {
  absl::Duration shortest = options.min_stream_bytes_per_second > 0
                                ? options.min_stream_rate_window
                                : absl::InfiniteDuration();
  if (options.stream_idle_timeout > absl::ZeroDuration()) {
    shortest = std::min(shortest, options.stream_idle_timeout);
  }
  if (shortest == absl::InfiniteDuration()) return shortest;
  return std::clamp(shortest / 4, absl::Milliseconds(10), absl::Seconds(1));
}

absl::Duration DeviceWatchdogPeriod(absl::Duration device_timeout) {
  return std::clamp(device_timeout / 10, absl::Milliseconds(10), absl::Seconds(1));
}

}  // namespace normgrad::server
