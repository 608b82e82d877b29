#include "server/thread_pool/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

namespace normgrad::server {

ThreadPool::ThreadPool(int workers) {
  workers_.reserve(std::max(workers, 0));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_or_stopping_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Schedule(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  work_or_stopping_.notify_one();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_or_stopping_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  const size_t helpers = std::min(n - 1, workers_.size());
  if (helpers == 0) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Shared with helper tasks that may start after this call returned (they then find no
  // index left and touch nothing but this state).
  struct Work {
    std::atomic<size_t> next{0};
    size_t finished = 0;  // guarded by mu
    std::mutex mu;
    std::condition_variable done;
  };
  auto work = std::make_shared<Work>();
  const std::function<void(size_t)>* body = &fn;  // valid until every index finished
  auto drain = [work, body, n] {
    size_t ran = 0;
    for (size_t i = work->next.fetch_add(1); i < n; i = work->next.fetch_add(1)) {
      (*body)(i);
      ++ran;
    }
    if (ran == 0) return;
    std::lock_guard<std::mutex> lock(work->mu);
    work->finished += ran;
    if (work->finished == n) work->done.notify_all();
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < helpers; ++i) tasks_.push_back(drain);
  }
  work_or_stopping_.notify_all();
  drain();
  std::unique_lock<std::mutex> lock(work->mu);
  work->done.wait(lock, [&] { return work->finished == n; });
}

}  // namespace normgrad::server
