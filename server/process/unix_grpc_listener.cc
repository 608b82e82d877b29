#include "server/process/unix_grpc_listener.h"

#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/unix_socket/unix_acceptor.h"

namespace normgrad::server {

bool UnixGrpcListener::Supported() {
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<UnixGrpcListener>> UnixGrpcListener::Start(
    const std::string& path, mode_t mode, grpc::Server* server, UnixPeers* peers,
    std::vector<uint32_t> allowed_uids, std::atomic<uint64_t>* refused) {
  if (!Supported()) return absl::UnimplementedError("gRPC takes no connections from descriptors");
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--listen=unix:", path, ": the path is ",
                                                   path.size(), " bytes, the most is ",
                                                   sizeof(addr.sun_path) - 1));
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Created owner-only, then opened up to `mode`: no moment where a wider mode lets anyone in.
  const mode_t old_umask = umask(0077);
  const int rc = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_umask);
  if (rc != 0 || listen(fd, SOMAXCONN) != 0 || chmod(path.c_str(), mode) != 0) {
    const int err = rc != 0 ? bind_errno : errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("--listen=unix:", path, ": cannot listen there: ",
                                               std::strerror(err)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<UnixGrpcListener> l(
      new UnixGrpcListener(fd, wake, server, peers, std::move(allowed_uids), refused));
  l->thread_ = std::thread([raw = l.get()] { raw->Run(); });
  return l;
}

UnixGrpcListener::~UnixGrpcListener() {
  Stop();
  close(listen_fd_);
  close(wake_fd_);
}

void UnixGrpcListener::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  (void)write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

void UnixGrpcListener::Run() {
  UnixAcceptor acceptor(listen_fd_, allowed_uids_, "unix listener", refused_);
  while (!stopped_.load()) {
    // The listening socket is not polled while the acceptor pauses (out of descriptors).
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {acceptor.listening() ? listen_fd_ : -1, POLLIN, 0}};
    if (poll(fds, 2, acceptor.PollTimeoutMs()) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "normgrad-server: unix listener: poll: %s\n", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    while (std::optional<UnixPeer> peer = acceptor.AcceptOne()) {
      peers_->Set(peer->fd, {peer->pid, peer->uid, peer->gid});
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
      grpc::AddInsecureChannelFromFd(server_, peer->fd);  // gRPC owns the descriptor from here
#else
      close(peer->fd);
#endif
    }
  }
}

}  // namespace normgrad::server
