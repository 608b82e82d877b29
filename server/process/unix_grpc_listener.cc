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

#include "absl/strings/str_cat.h"

namespace normgrad::server {

bool UnixGrpcListener::Supported() {
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<UnixGrpcListener>> UnixGrpcListener::Start(const std::string& path,
                                                                         mode_t mode,
                                                                         grpc::Server* server,
                                                                         UnixPeers* peers) {
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
  std::unique_ptr<UnixGrpcListener> l(new UnixGrpcListener(fd, wake, server, peers));
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
  while (!stopped_.load()) {
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "normgrad-server: unix listener: poll: %s\n", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    if ((fds[1].revents & POLLIN) == 0) continue;
    while (true) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        // EAGAIN: all taken. Out of descriptors (EMFILE) or memory: that client's connect
        // fails; poll again rather than spin on the same error.
        break;
      }
      ucred cred{};
      socklen_t len = sizeof(cred);
      if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        peers_->Set(fd, {cred.pid, cred.uid, cred.gid});
      } else {
        peers_->Set(fd, {0, static_cast<uid_t>(-1), static_cast<gid_t>(-1)});
      }
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
      grpc::AddInsecureChannelFromFd(server_, fd);  // gRPC owns the descriptor from here
#else
      close(fd);
#endif
    }
  }
}

}  // namespace normgrad::server
