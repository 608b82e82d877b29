// A listening socket the server owns and the one thread that serves it: a unix socket whose file
// is created owner-only and only then opened up to its mode (no moment where a wider mode lets
// anyone in), or a TCP socket; an eventfd that wakes the thread's poll on Stop, and the poll
// itself (the wake descriptor, the listening socket while the acceptor is not pausing, and
// whatever connections the caller keeps). The gRPC listeners (unix and plaintext TCP) and the
// region socket are built on it.
//
//   auto socket = ListenSocket::Open(path, {.type = SOCK_SEQPACKET, .mode = 0660,
//                                               .what = "region socket " + path});
//   (*socket)->Start([s = socket->get(), ...] {
//     Acceptor acceptor(s->fd(), allowed_uids, "region socket");
//     std::vector<pollfd> connections;
//     while (s->Poll(acceptor, connections)) { ... read connections' revents, AcceptOne() ... }
//   });
//   (*socket)->Stop();   // wakes Poll (it returns false), joins the thread
//
// Thread safety: Poll only from the serving thread; Stop from any thread, once or more.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "server/listen_socket/acceptor.h"

namespace normgrad::server {

class ListenSocket {
 public:
  struct Options {
    int type = SOCK_STREAM;  // SOCK_STREAM or SOCK_SEQPACKET
    mode_t mode = 0660;      // the socket file's mode once it listens
    int backlog = SOMAXCONN;
    // Names the socket in errors and the log ("--listen=unix:/run/x.sock").
    std::string what;
    // Whether Stop removes the socket file (only when it is still the file Open made).
    bool remove_on_stop = false;
  };

  // Binds and listens on `path`, which must be free (the caller removes a stale socket).
  // INVALID_ARGUMENT when the path does not fit sockaddr_un (naming both lengths); UNAVAILABLE
  // when the socket cannot be made or bound (errno's words).
  static absl::StatusOr<std::unique_ptr<ListenSocket>> Open(const std::string& path,
                                                                Options options);
  // Binds and listens on one TCP address (`address`, `address_len`: from getaddrinfo), with
  // SO_REUSEADDR and, for an IPv6 wildcard, IPv4 too; `options.type` and `options.mode` do not
  // apply. UNAVAILABLE when it cannot (errno's words: in use, not local).
  static absl::StatusOr<std::unique_ptr<ListenSocket>> OpenTcp(const sockaddr* address,
                                                               socklen_t address_len,
                                                               Options options);
  ~ListenSocket();  // Stop(), then closes both descriptors
  ListenSocket(const ListenSocket&) = delete;
  ListenSocket& operator=(const ListenSocket&) = delete;

  int fd() const { return listen_fd_; }  // the listening socket (SOCK_NONBLOCK)
  const std::string& path() const { return path_; }  // empty for TCP
  int port() const;  // the TCP port it listens on (0 for a unix socket)

  // Runs `serve` on the socket's own thread; `serve` returns once Poll returns false.
  void Start(std::function<void()> serve);

  // Waits for the listening socket (while `acceptor` is not pausing), for `connections` (their
  // revents are filled in) or for Stop, for at most the acceptor's pause. False when Stop was
  // called or poll failed other than by a signal (logged); true otherwise, events or not.
  bool Poll(const Acceptor& acceptor, std::vector<pollfd>& connections);

  // Wakes Poll for good and joins the serving thread; removes the socket file when asked to.
  void Stop();

 private:
  ListenSocket(std::string path, Options options, int listen_fd, int wake_fd);

  const std::string path_;
  const Options options_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: Stop writes it to end the serving thread's Poll
  ino_t inode_ = 0;    // of the socket file Open made (unix)
  std::atomic<bool> stopped_{false};
  std::vector<pollfd> fds_;  // Poll's array, kept between calls (serving thread only)
  std::thread thread_;
};

}  // namespace normgrad::server
