#include "server/process/listen_address.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/metrics/metrics_http_server.h"

namespace normgrad::server {

absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view text) {
  ListenAddress a;
  a.text = std::string(text);
  if (absl::StartsWith(text, "unix:")) {
    a.kind = ListenAddress::kUnix;
    a.path = std::string(text.substr(5));
    if (absl::StartsWith(a.path, "//")) a.path = a.path.substr(2);  // unix:///abs is gRPC's too
    if (a.path.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen=", text, ": unix: needs a socket path, e.g. unix:/run/normgrad.sock"));
    }
    if (a.path.size() >= sizeof(sockaddr_un{}.sun_path)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen=", text, ": the socket path is ", a.path.size(),
                       " bytes; unix sockets allow at most ", sizeof(sockaddr_un{}.sun_path) - 1));
    }
    return a;
  }
  if (absl::StartsWith(text, "unix-abstract:")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=", text, ": abstract sockets have no file mode to restrict who connects; use "
        "unix:/PATH"));
  }
  a.kind = ListenAddress::kTcp;
  if (absl::Status s = SplitHostPort(text, "listen", &a.host, &a.port); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.message(), " (or unix:/PATH for a unix-domain socket)"));
  }
  return a;
}

absl::Status PrepareUnixSocketPath(const std::string& path, int type) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("unix socket ", path, ": cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(
        "unix socket ", path, ": the path exists and is not a socket; not removing it"));
  }
  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  close(fd);
  if (rc == 0) {
    return absl::UnavailableError(absl::StrCat(
        "unix socket ", path, ": another server is listening on this socket (address in use)"));
  }
  if (err != ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat("unix socket ", path,
                                               ": cannot tell whether the socket is in use: ",
                                               std::strerror(err)));
  }
  // Nobody listens: a socket left behind by a server that died.
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(absl::StrCat("unix socket ", path,
                                               ": cannot remove the stale socket: ",
                                               std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status SetUnixSocketMode(const std::string& path, mode_t mode) {
  if ((mode & ~mode_t{0777}) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--unix-socket-mode=%o: only permission bits (0..0777)", mode));
  }
  if (chmod(path.c_str(), mode) != 0) {
    return absl::UnavailableError(absl::StrCat("chmod ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

ino_t UnixSocketInode(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

void RemoveUnixSocket(const std::string& path, ino_t inode) {
  if (inode != 0 && UnixSocketInode(path) == inode) unlink(path.c_str());
}

}  // namespace normgrad::server
