// A bound on the whole time of each metrics connection, for cpp-httplib 0.11, which bounds each
// read and each write (5 s) but not a connection: a client that trickles a byte every few seconds
// holds one of its workers for ever, and eight of them left none for scrapes.
//
// LimitedConnectionQueue is the server's task queue (httplib's `new_task_queue` hook): its
// workers run the connections httplib accepted. As httplib queues a connection (right after its
// accept, on the listening thread), the queue finds that connection's socket (the one connected
// socket of the metrics port it does not hold yet, from /proc/self/fd) and keeps a duplicate of
// it. A watchdog shuts the socket down once its connection has run for `limit`: httplib's
// blocked read or write fails, and it closes the connection. The duplicate pins the socket, so
// that no other connection that reuses the descriptor number is ever shut down; it is closed as
// soon as httplib is done with the connection.
//
//   httplib::Server http;
//   http.new_task_queue = [port] { return new LimitedConnectionQueue(port, 8, absl::Seconds(10)); };
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include <httplib.h>

#include "absl/time/time.h"

namespace normgrad::server {

class LimitedConnectionQueue final : public httplib::TaskQueue {
 public:
  // `port`: the metrics port, whose connections are the tasks; `workers` threads; `limit`: a
  // connection's whole time, counted from when a worker takes it.
  LimitedConnectionQueue(int port, size_t workers, absl::Duration limit);
  ~LimitedConnectionQueue() override;  // shutdown()

  void enqueue(std::function<void()> fn) override;
  // Cuts every connection still open, runs what is queued (each then fails at once), joins.
  void shutdown() override;

  uint64_t cut() const;  // connections shut down at the limit, so far

 private:
  struct Connection {
    std::function<void()> serve;
    int socket = -1;  // our duplicate; -1 when the socket was not found (no bound then)
    ino_t inode = 0;  // the socket's, in held_
    absl::Time deadline = absl::InfiniteFuture();  // once a worker took it
    bool cut = false;
  };
  int DuplicateNewSocket();  // the listening thread, with mu_ not held
  void Work();
  void Watch();

  const int port_;
  const absl::Duration limit_;
  mutable std::mutex mu_;
  std::condition_variable work_;   // a connection was queued, or shutting down
  std::condition_variable watch_;  // shutting down
  std::deque<Connection> queued_;  // guarded by mu_
  std::list<Connection> running_;  // guarded by mu_
  std::vector<ino_t> held_;        // inodes of the sockets duplicated; guarded by mu_
  bool stopping_ = false;          // guarded by mu_
  uint64_t cut_ = 0;               // guarded by mu_
  std::vector<std::thread> workers_;
  std::thread watchdog_;
};

}  // namespace normgrad::server
