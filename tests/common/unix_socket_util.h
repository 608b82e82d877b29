// What the unix-socket tests share: a temporary directory for their socket files (removed with
// everything in it) and a connection to a socket path. A message with a descriptor is sent as
// the client sends it (client/src/descriptor_passing.h).
//
//   TempDir dir("normgrad-region-socket");
//   const int fd = ConnectUnix(dir.path() + "/s.sock", SOCK_SEQPACKET);  // -1 on failure
#pragma once

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

}  // namespace normgrad::testing
