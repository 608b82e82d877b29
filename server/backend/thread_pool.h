// A fixed set of worker threads shared by every session of a CPU backend.
//
//   ThreadPool pool(4);                       // the caller of ParallelFor is one of the 4
//   pool.ParallelFor(n, [&](size_t i) { ... });  // returns when fn ran for every i in [0, n)
//
// Thread-safe: several sessions may call ParallelFor at once; the calling thread always works
// on its own call, so every call makes progress even when the workers are busy elsewhere.
// Which thread runs which index is unspecified: callers that need reproducible results make
// each index's work independent of the thread that runs it.
#ifndef NORMGRAD_SERVER_BACKEND_THREAD_POOL_H_
#define NORMGRAD_SERVER_BACKEND_THREAD_POOL_H_

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
  // num_threads >= 1 counts the caller of ParallelFor: num_threads - 1 workers are started.
  explicit ThreadPool(int num_threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();  // joins the workers; no ParallelFor may be running

  int NumThreads() const { return num_threads_; }

  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();

  const int num_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_BACKEND_THREAD_POOL_H_
