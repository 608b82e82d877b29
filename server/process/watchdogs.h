// The server's watchdog threads, each a PeriodicTask: the stream watchdog visits every live
// stream (idle timeout, minimum rate: StreamWatchdog judges each), the device watchdog polls the
// backend for work overdue by --device-timeout (a worker stuck in the driver cannot be
// interrupted, so the check runs on a thread of its own), and the listener watchdog looks for a
// TCP port gRPC listens on itself (TLS) whose accept loop has died (ListenerWatchdog).
//
//   PeriodicTask t(StreamWatchdogPeriod(options), [&] { streams.CheckIdle(...); return true; });
//   ...
//   t.Stop();  // wakes and joins it; the destructor does too
#pragma once

#include <condition_variable>
#include <cstdint>
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

// Whether a TCP port that gRPC listens on itself still accepts. gRPC 1.51's accept loop stops for
// good at the first accept4 that fails for want of descriptors; the kernel then keeps queueing
// connections that nobody takes. The server accepts plaintext ports itself (GrpcListener), so
// only a TLS port can die so; the server then says NOT_SERVING, so that an orchestrator restarts
// the replica. A live loop empties the queue as soon as it is woken: connections waiting at
// `visits` visits in a row mean a dead one.
//
//   ListenerWatchdog w(50051, 10);
//   PeriodicTask t(absl::Seconds(1), [&] { return w.Visit(); });   // false once it died
class ListenerWatchdog {
 public:
  ListenerWatchdog(int port, int visits) : port_(port), visits_(visits) {}
  // False once connections waited at `visits` visits in a row: the listener is dead.
  bool Visit();
  bool dead() const { return dead_; }

 private:
  const int port_;
  const int visits_;
  int waiting_visits_ = 0;
  bool dead_ = false;
};

// How many connections wait to be accepted on the listening TCP sockets of `port` (IPv4 and
// IPv6), from /proc/net/tcp and /proc/net/tcp6: a listening socket's receive queue there is its
// accept queue. 0 when there is no such socket or the tables cannot be read.
uint64_t AcceptQueueLength(int port);

}  // namespace normgrad::server
