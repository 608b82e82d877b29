// What the unix-socket tests share: a temporary directory for their socket files (removed with
// everything in it), a connection to a socket path, and a message with one descriptor passed
// along (SCM_RIGHTS), as a client registering a region sends it.
//
//   TempDir dir("normgrad-region-socket");
//   const int fd = ConnectUnix(dir.path() + "/s.sock", SOCK_SEQPACKET);  // -1 on failure
//   SendWithDescriptor(fd, request.SerializeAsString(), memfd);
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/strings/string_view.h"

namespace normgrad::testing {

class TempDir {
 public:
  // A fresh directory /tmp/<prefix>-XXXXXX; aborts the test program when none can be made.
  explicit TempDir(absl::string_view prefix);
  ~TempDir();  // removes the directory and everything in it
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A connected unix socket of `type` (SOCK_STREAM, SOCK_SEQPACKET) to `path`; -1 on failure.
int ConnectUnix(const std::string& path, int type);

// sendmsg of `bytes` with `fd` attached (SCM_RIGHTS); what sendmsg returned.
ssize_t SendWithDescriptor(int socket, absl::string_view bytes, int fd);

}  // namespace normgrad::testing
