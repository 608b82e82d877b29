// A fixed set of threads that run the service's blocking work (chunk compute, module compiles)
// so that no gRPC reaction ever blocks. Tasks run in FIFO order; a stream keeps at most one task
// queued or running, so streams take turns.
//
//   WorkerPool pool(4);
//   pool.Schedule([] { ... });
//
// Thread-safe. The destructor runs every task already scheduled, then joins the threads.
#ifndef NORMGRAD_SERVER_SERVICE_WORKER_POOL_H_
#define NORMGRAD_SERVER_SERVICE_WORKER_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace normgrad::server {

class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Schedule(std::function<void()> task);
  size_t size() const { return threads_.size(); }

 private:
  void Run();

  // std::mutex, not absl::Mutex, throughout our code: ThreadSanitizer sees pthread locks, while
  // Debian's abseil is built without it (docs/testing.md).
  std::mutex mu_;
  std::condition_variable work_or_stopping_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                     // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_SERVICE_WORKER_POOL_H_
