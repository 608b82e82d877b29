// A fixed set of worker threads and one FIFO queue of tasks: the service's pool for blocking work
// (chunk compute, compiles: no gRPC reaction ever blocks) and each CPU backend's pool for row
// partitions are two instances of it.
//
//   ThreadPool pool(3);                          // 3 worker threads
//   pool.Schedule([] { ... });                   // runs on a worker, in FIFO order
//   pool.ParallelFor(n, [&](size_t i) { ... });  // the caller and the workers; returns when
//                                                // fn ran for every i in [0, n)
//
// Thread-safe. ParallelFor may be called by several threads at once: the calling thread always
// works on its own call, so every call makes progress even when the workers are busy elsewhere.
// Which thread runs which index is unspecified: callers that need reproducible results make each
// index's work independent of the thread that runs it. The destructor runs every task already
// scheduled (tasks may schedule more while it drains), then joins the workers; no ParallelFor may
// be running.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace normgrad::server {

class ThreadPool {
 public:
  // Starts `workers` threads; none when workers <= 0: such a pool runs ParallelFor on the
  // caller alone and must not be given tasks to Schedule (no thread would run them).
  explicit ThreadPool(int workers);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  size_t size() const { return workers_.size(); }  // worker threads (the caller not counted)

  void Schedule(std::function<void()> task);
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();

  // std::mutex, not absl::Mutex, throughout our code: ThreadSanitizer sees pthread locks, while
  // Debian's abseil is built without it (docs/testing.md).
  std::mutex mu_;
  std::condition_variable work_or_stopping_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace normgrad::server
