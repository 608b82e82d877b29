// The server's two watchdog threads, each a PeriodicTask: the stream watchdog visits every live
// stream (idle timeout, minimum rate: StreamWatchdog judges each), the device watchdog polls the
// backend for work overdue by --device-timeout (a worker stuck in the driver cannot be
// interrupted, so the check runs on a thread of its own).
//
//   PeriodicTask t(StreamWatchdogPeriod(options), [&] { streams.CheckIdle(...); return true; });
//   ...
//   t.Stop();  // wakes and joins it; the destructor does too
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/time/time.h"
#include "server/process/server_options.h"

namespace normgrad::server {

// Runs `visit` on a thread of its own every `period` until Stop() or until `visit` returns false
// (nothing more to watch). The first visit comes one period after the start. Stop is prompt: it
// wakes the thread between visits and waits for a visit in progress.
class PeriodicTask {
 public:
  PeriodicTask(absl::Duration period, std::function<bool()> visit);
  ~PeriodicTask();  // Stop()

  PeriodicTask(const PeriodicTask&) = delete;
  PeriodicTask& operator=(const PeriodicTask&) = delete;

  void Stop();  // idempotent; not from two threads at once

 private:
  void Run();

  const absl::Duration period_;
  const std::function<bool()> visit_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;     // last: starts once the rest is set
};

// How often the stream watchdog visits: a quarter of the shortest of --stream-idle-timeout and
// --min-stream-rate-window (the latter only with a minimum rate), within 10 ms .. 1 s. Infinite
// when neither is on (no watchdog).
absl::Duration StreamWatchdogPeriod(const ServerOptions& options);

// How often the device watchdog polls: a tenth of --device-timeout within 10 ms .. 1 s.
absl::Duration DeviceWatchdogPeriod(absl::Duration device_timeout);

}  // namespace normgrad::server
