#include "server/metrics/connection_time_limit.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace normgrad::server {
namespace {

// The local port of a connected TCP socket; 0 for anything else (the listening socket included).
int ConnectedLocalPort(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return 0;
  int port = 0;
  if (a.ss_family == AF_INET) port = ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) port = ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
  sockaddr_storage peer{};
  len = sizeof(peer);
  if (port == 0 || getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return 0;
  return port;
}

ino_t InodeOf(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? st.st_ino : 0;
}

}  // namespace

LimitedConnectionQueue::LimitedConnectionQueue(int port, size_t workers, absl::Duration limit)
    : port_(port), limit_(limit) {
  for (size_t i = 0; i < std::max<size_t>(workers, 1); ++i) {
    workers_.emplace_back([this] { Work(); });
  }
  watchdog_ = std::thread([this] { Watch(); });
}

LimitedConnectionQueue::~LimitedConnectionQueue() { shutdown(); }

int LimitedConnectionQueue::DuplicateNewSocket() {
  std::vector<ino_t> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held = held_;
  }
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    int fd;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd == dirfd(dir)) continue;
    char link[64];
    const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
    if (n <= 0 || !absl::StartsWith(absl::string_view(link, n), "socket:[")) continue;
    if (ConnectedLocalPort(fd) != port_) continue;
    // The descriptor may have been closed and reused since readlink: pin the socket first,
    // then make sure it is a connection of the metrics port that is not held yet.
    const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) continue;
    const ino_t inode = InodeOf(dup);
    if (inode == 0 || ConnectedLocalPort(dup) != port_ ||
        std::find(held.begin(), held.end(), inode) != held.end()) {
      close(dup);
      continue;
    }
    found = dup;
    break;
  }
  closedir(dir);
  return found;
}

void LimitedConnectionQueue::enqueue(std::function<void()> fn) {
  Connection c;
  c.serve = std::move(fn);
  c.socket = DuplicateNewSocket();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (c.socket >= 0) {
      c.inode = InodeOf(c.socket);
      held_.push_back(c.inode);
    }
    queued_.push_back(std::move(c));
  }
  work_.notify_one();
}

void LimitedConnectionQueue::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_.wait(lock, [this] { return stopping_ || !queued_.empty(); });
    if (queued_.empty()) return;  // stopping, nothing left
    running_.push_back(std::move(queued_.front()));
    queued_.pop_front();
    auto it = std::prev(running_.end());
    it->deadline = absl::Now() + limit_;
    if (stopping_ && it->socket >= 0) ::shutdown(it->socket, SHUT_RDWR);
    std::function<void()> serve = std::move(it->serve);
    lock.unlock();
    serve();  // httplib reads, answers and closes its descriptor
    lock.lock();
    if (it->socket >= 0) {
      held_.erase(std::remove(held_.begin(), held_.end(), it->inode), held_.end());
      close(it->socket);
    }
    running_.erase(it);
  }
}

void LimitedConnectionQueue::Watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    watch_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stopping_; });
    const absl::Time now = absl::Now();
    for (Connection& c : running_) {
      if (c.cut || c.socket < 0 || now < c.deadline) continue;
      ::shutdown(c.socket, SHUT_RDWR);
      c.cut = true;
      ++cut_;
    }
  }
}

void LimitedConnectionQueue::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    for (Connection& c : running_) {
      if (c.socket >= 0) ::shutdown(c.socket, SHUT_RDWR);
    }
  }
  work_.notify_all();
  watch_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  if (watchdog_.joinable()) watchdog_.join();
}

uint64_t LimitedConnectionQueue::cut() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cut_;
}

}  // namespace normgrad::server
