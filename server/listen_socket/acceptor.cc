#include "server/listen_socket/acceptor.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/time/clock.h"

namespace normgrad::server {

Acceptor::Acceptor(int listen_fd, std::vector<uint32_t> allowed_uids, std::string what,
                           std::atomic<uint64_t>* refused)
    : listen_fd_(listen_fd),
      allowed_uids_(std::move(allowed_uids)),
      what_(std::move(what)),
      refused_counter_(refused) {}

bool Acceptor::listening() const { return absl::Now() >= paused_until_; }

int Acceptor::PollTimeoutMs() const {
  const absl::Duration left = paused_until_ - absl::Now();
  if (left <= absl::ZeroDuration()) return -1;
  return static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))));
}

std::optional<AcceptedPeer> Acceptor::AcceptOne() {
  if (!listening()) return std::nullopt;
  while (true) {
    AcceptedPeer peer;
    peer.address_len = sizeof(peer.address);
    const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer.address),
                           &peer.address_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // The connection stays queued and the socket readable: polling it again at once would
        // spin. Pause; clients' connects wait in the backlog meanwhile.
        if (exhausted_++ == 0 || exhausted_ % 100 == 0) {
          std::fprintf(stderr, "normgrad-server: %s: accept: %s; pausing accepts for %s (%llu "
                       "times so far)\n", what_.c_str(), std::strerror(errno),
                       absl::FormatDuration(kBackoff).c_str(),
                       static_cast<unsigned long long>(exhausted_));
        }
        paused_until_ = absl::Now() + kBackoff;
      }
      return std::nullopt;  // EAGAIN: none pending
    }
    peer.fd = fd;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (peer.address.ss_family == AF_UNIX &&
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      peer.pid = cred.pid;
      peer.uid = cred.uid;
      peer.gid = cred.gid;
    }
    if (allowed_uids_.empty() ||
        std::find(allowed_uids_.begin(), allowed_uids_.end(), peer.uid) != allowed_uids_.end()) {
      return peer;
    }
    close(fd);
    ++refused_;
    if (refused_counter_ != nullptr) refused_counter_->fetch_add(1);
    const absl::Time now = absl::Now();
    if (now - last_refusal_log_ >= absl::Seconds(1)) {  // a refused peer cannot flood the log
      last_refusal_log_ = now;
      std::fprintf(stderr, "normgrad-server: %s: refused a connection of uid:%u (pid %d), which "
                   "--unix-allowed-uids does not list (%llu refused so far)\n", what_.c_str(),
                   static_cast<unsigned>(peer.uid), static_cast<int>(peer.pid),
                   static_cast<unsigned long long>(refused_));
    }
  }
}

uint64_t RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : static_cast<uint64_t>(limit.rlim_cur);
}

uint32_t ConnectionBoundFor(uint64_t open_file_limit) {
  return static_cast<uint32_t>(std::clamp<uint64_t>(open_file_limit / 4, 16, 1u << 20));
}

}  // namespace normgrad::server
