#include "server/listen_socket/listen_socket.h"

#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace normgrad::server {
namespace {

// The eventfd that wakes a listening socket's poll, once `fd` listens (`listening`); else, or
// when the eventfd cannot be made, `fd` is closed and the result is -errno (`listen_errno`, the
// failure to listen, or eventfd's).
int WakeFdFor(int fd, bool listening, int listen_errno) {
  if (!listening) {
    close(fd);
    return -listen_errno;
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int err = errno;
    close(fd);
    return -err;
  }
  return wake;
}

absl::Status ListenError(const std::string& what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": cannot listen there: ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ListenSocket>> ListenSocket::Open(const std::string& path,
                                                                         Options options) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(options.what, ": the path is ", path.size(),
                                                   " bytes, the most is ",
                                                   sizeof(addr.sun_path) - 1));
  }
  const int fd = socket(AF_UNIX, options.type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Created owner-only, then opened up to the mode: no moment where a wider mode lets anyone in.
  const mode_t old_umask = umask(0077);
  const int rc = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_umask);
  const bool listening =
      rc == 0 && listen(fd, options.backlog) == 0 && chmod(path.c_str(), options.mode) == 0;
  const int wake = WakeFdFor(fd, listening, rc != 0 ? bind_errno : errno);
  if (wake < 0) return ListenError(options.what, -wake);
  std::unique_ptr<ListenSocket> s(new ListenSocket(path, std::move(options), fd, wake));
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) s->inode_ = st.st_ino;
  return s;
}

absl::StatusOr<std::unique_ptr<ListenSocket>> ListenSocket::OpenTcp(const sockaddr* address,
                                                                   socklen_t address_len,
                                                                   Options options) {
  const int fd = socket(address->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  const int zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (address->sa_family == AF_INET6) {
    // "[::]:PORT" takes IPv4 peers too, as gRPC's own listener does.
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(address);
    if (IN6_IS_ADDR_UNSPECIFIED(&a6->sin6_addr)) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
  }
  const bool listening = bind(fd, address, address_len) == 0 && listen(fd, options.backlog) == 0;
  const int wake = WakeFdFor(fd, listening, errno);
  if (wake < 0) return ListenError(options.what, -wake);
  options.remove_on_stop = false;
  return std::unique_ptr<ListenSocket>(new ListenSocket("", std::move(options), fd, wake));
}

int ListenSocket::port() const {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return 0;
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
  return 0;
}

ListenSocket::ListenSocket(std::string path, Options options, int listen_fd, int wake_fd)
    : path_(std::move(path)), options_(std::move(options)), listen_fd_(listen_fd),
      wake_fd_(wake_fd) {}

ListenSocket::~ListenSocket() {
  Stop();
  close(listen_fd_);
  close(wake_fd_);
}

void ListenSocket::Start(std::function<void()> serve) {
  thread_ = std::thread(std::move(serve));
}

bool ListenSocket::Poll(const Acceptor& acceptor, std::vector<pollfd>& connections) {
  fds_.clear();
  fds_.push_back({wake_fd_, POLLIN, 0});
  // Not polled while the acceptor pauses (out of descriptors): it would stay readable.
  fds_.push_back({acceptor.listening() ? listen_fd_ : -1, POLLIN, 0});
  fds_.insert(fds_.end(), connections.begin(), connections.end());
  if (poll(fds_.data(), fds_.size(), acceptor.PollTimeoutMs()) < 0) {
    if (errno == EINTR) {
      for (pollfd& c : connections) c.revents = 0;
      return !stopped_.load();
    }
    std::fprintf(stderr, "normgrad-server: %s: poll: %s\n", options_.what.c_str(),
                 std::strerror(errno));
    return false;
  }
  if (fds_[0].revents != 0) return false;
  for (size_t i = 0; i < connections.size(); ++i) connections[i].revents = fds_[i + 2].revents;
  return true;
}

void ListenSocket::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  (void)write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  if (!options_.remove_on_stop) return;
  struct stat st;
  if (lstat(path_.c_str(), &st) == 0 && st.st_ino == inode_) unlink(path_.c_str());
}

}  // namespace normgrad::server
