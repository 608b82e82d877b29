#include "server/process/watchdogs.h"

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

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

uint64_t AcceptQueueLength(int port) {
  uint64_t waiting = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx_queue:rx_queue ...; LISTEN is state 0A.
      std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 5 || f[3] != "0A") continue;
      const size_t colon = f[1].rfind(':');
      uint32_t local_port = 0;
      if (colon == absl::string_view::npos ||
          !absl::SimpleHexAtoi(f[1].substr(colon + 1), &local_port) ||
          local_port != static_cast<uint32_t>(port)) {
        continue;
      }
      const size_t queue_colon = f[4].find(':');
      uint64_t queued = 0;
      if (queue_colon != absl::string_view::npos &&
          absl::SimpleHexAtoi(f[4].substr(queue_colon + 1), &queued)) {
        waiting += queued;
      }
    }
  }
  return waiting;
}

bool ListenerWatchdog::Visit() {
  if (dead_) return false;
  waiting_visits_ = AcceptQueueLength(port_) > 0 ? waiting_visits_ + 1 : 0;
  dead_ = waiting_visits_ >= visits_;
  return !dead_;
}

}  // namespace normgrad::server
