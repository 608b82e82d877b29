// Accepting connections on a listening socket the server owns (the gRPC listeners, unix and
// plaintext TCP, and the region socket): each connection's address, a unix peer's credentials
// (SO_PEERCRED), the uid allow-list (--unix-allowed-uids: a peer it does not list is closed at
// accept, before it can say anything), and a pause instead of a busy loop when the process runs out of descriptors or
// memory (accept4 fails with EMFILE, ENFILE, ENOBUFS or ENOMEM while the connection stays
// queued, so the listening socket stays readable).
//
//   Acceptor acceptor(listen_fd, allowed_uids, "region socket");
//   while (...) {
//     pollfd fds[] = {..., {acceptor.listening() ? listen_fd : -1, POLLIN, 0}};
//     poll(fds, n, acceptor.PollTimeoutMs());
//     while (std::optional<AcceptedPeer> p = acceptor.AcceptOne()) { ... p->fd is ours ... }
//   }
//
// Not thread-safe: one accepting thread.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace normgrad::server {

struct AcceptedPeer {
  int fd = -1;  // the accepted connection (SOCK_CLOEXEC | SOCK_NONBLOCK)
  pid_t pid = 0;  // pid, uid, gid: a unix peer's; TCP peers have none
  uid_t uid = static_cast<uid_t>(-1);  // -1 when the kernel gave no credentials
  gid_t gid = static_cast<gid_t>(-1);
  sockaddr_storage address{};  // the peer's address, as accept4 gave it
  socklen_t address_len = 0;
};

class Acceptor {
 public:
  // How long accepting pauses after the process ran out of descriptors or memory.
  static constexpr absl::Duration kBackoff = absl::Milliseconds(100);

  // `allowed_uids` empty: every peer is taken. `what` names the socket in the log. `refused`
  // (optional, outliving this) counts the peers the allow-list refused, for metrics.
  Acceptor(int listen_fd, std::vector<uint32_t> allowed_uids, std::string what,
               std::atomic<uint64_t>* refused = nullptr);

  // The next pending connection whose peer the allow-list admits; nullopt when none is pending,
  // while pausing, or when accept4 failed for want of descriptors or memory (the pause starts).
  // A refused peer's connection is closed here and counted.
  std::optional<AcceptedPeer> AcceptOne();

  // False while pausing: do not poll the listening socket then (it stays readable).
  bool listening() const;
  // A poll timeout that ends the pause: -1 (none) unless pausing.
  int PollTimeoutMs() const;

  uint64_t refused() const { return refused_; }      // peers the allow-list refused
  uint64_t exhausted() const { return exhausted_; }  // accept4 failures that started a pause

 private:
  const int listen_fd_;
  const std::vector<uint32_t> allowed_uids_;
  const std::string what_;
  std::atomic<uint64_t>* const refused_counter_;
  absl::Time paused_until_ = absl::InfinitePast();
  absl::Time last_refusal_log_ = absl::InfinitePast();
  uint64_t refused_ = 0;
  uint64_t exhausted_ = 0;
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit (a server holds a descriptor per
// connection and per region; the soft default of 1024 is a shell's, not a server's) and returns
// the soft limit in force afterwards.
uint64_t RaiseOpenFileLimit();

// How many connections a socket the server owns may hold at once, from the descriptor limit:
// a quarter of it, at least 16, so that no single socket can take every descriptor.
uint32_t ConnectionBoundFor(uint64_t open_file_limit);

}  // namespace normgrad::server
