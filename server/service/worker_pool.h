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

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_SERVICE_WORKER_POOL_H_
